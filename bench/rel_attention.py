"""Relative flash attention on one GPU at Inkling's shapes, against its peers measured in the same run.

Layers: batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16, bf16; full (8 KV heads, E 1024, causal) and
sliding (16 KV heads, window 512 = E). Peers: torch FlexAttention with the same bias as a score_mod (as in
shared/peers/inkling_peers.py) and cuDNN plain attention through jax.nn.dot_product_attention (no bias, same mask).
Ceiling: a measured XLA bf16 matmul (and a copy, for the record). FLOPs: 4 * B * Hq * D per visible (query, key)
pair (causal / windowed pairs only; bias FLOPs not counted); forward + backward counts 3.5x the forward.
Also times each kernel alone (a few dK/dV tile shapes on the full layer), and checks the tuned kernels against the
jnp reference on the device (1536 tokens, 16 query heads).

Run: PYTHONPATH=. python bench/rel_attention.py   (writes $OUT/rel_attention.json when $OUT is set)
The functions below take a `Layer` so that bench/kernels.py can reuse them (also at tiny shapes on CPU).
"""

import dataclasses
import gc
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # the rest is torch's, for FlexAttention

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.rel_attention import backward, forward, kernel, rel_attention, tuning  # noqa: E402
from pallas_kernels.rel_attention.tiles import Blocks  # noqa: E402



@dataclasses.dataclass(frozen=True)
class Layer:
    kv_heads: int
    extent: int
    window: int | None  # None: full causal attention
    batch: int = 1
    tokens: int = 8192
    heads: int = 64
    dim: int = 128
    d_rel: int = 16

    @property
    def groups(self):
        return self.heads // self.kv_heads

    def flops(self):
        """4 * B * Hq * D per visible (query, key) pair, bias not counted."""
        t, w = self.tokens, self.window
        pairs = t * (t + 1) / 2 if w is None else t * w - w * (w - 1) / 2
        return 4 * self.batch * self.heads * pairs * self.dim


LAYERS = {"full": Layer(kv_heads=8, extent=1024, window=None), "sliding": Layer(kv_heads=16, extent=512, window=512)}
FLEX_START_LIMIT_S = float(os.environ.get("FLEX_START_LIMIT_S", 220))  # FlexAttention compiles slowly
CHECK_START_LIMIT_S = float(os.environ.get("CHECK_START_LIMIT_S", 260))
CHECK_TOKENS = 1536  # long enough for tiles beyond E = 1024
START = time.time()
RESULTS = {"jax": jax.__version__}
TIMING = {"reps": 5, "rounds": 3}  # bench/kernels.py --smoke lowers these


def log(*a):
    print(f"[{time.time() - START:6.1f}s]", *a)
    sys.stdout.flush()


def save():
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rel_attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def time_ms(fn, *args):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(TIMING["rounds"]):
        t = time.perf_counter()
        for _ in range(TIMING["reps"]):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / TIMING["reps"])
    return 1e3 * float(np.median(times))


def inputs(layer, seed=0):
    """(q, k, v, r, P), tau (None on sliding layers) and an output cotangent, bf16."""
    b, t, h, d = layer.batch, layer.tokens, layer.heads, layer.dim
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, layer.kv_heads, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, layer.kv_heads, d), jnp.bfloat16)
    r = (0.5 * jax.random.normal(keys[3], (b, t, h, layer.d_rel))).astype(jnp.bfloat16)
    p = jax.random.normal(keys[4], (layer.d_rel, layer.extent), jnp.bfloat16)
    pos = jnp.arange(t, dtype=jnp.float32)
    tau = jnp.broadcast_to(1.0 + 0.1 * jnp.log(jnp.maximum(1.0, (pos + 1) / 128000.0)), (b, t))
    tau = tau if layer.window is None else None
    return (q, k, v, r, p), tau, jax.random.normal(keys[5], (b, t, h, d), jnp.bfloat16)


def prepared(layer, blocks=None, interpret=None, seed=0):
    """Geometries, padded kernel operands and the cotangent of one layer's call (tuned tiles by default)."""
    (q, k, v, r, p), tau, ct = inputs(layer, seed)
    blocks = blocks or tuning.blocks(layer.groups, layer.dim)
    geos, args = kernel.prepare(q, k, v, r, p, q_offset=0, window=layer.window, tau=tau, segment_ids=None,
                                scale=None, interpret=interpret, blocks=blocks)
    return geos, args, ct


def rooflines(matmul_n=8192, copy_elems=512 * 1024 * 1024):
    """Measured XLA bf16 matmul TFLOP/s and y = 2x GB/s, stored in RESULTS."""
    a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), jnp.bfloat16)
    mm = time_ms(jax.jit(lambda x, y: x @ y), a, a)
    x = jax.random.normal(jax.random.key(2), (copy_elems,), jnp.bfloat16)
    cp = time_ms(jax.jit(lambda x: x * 2), x)
    RESULTS["matmul_tflops"] = 2 * matmul_n ** 3 / mm / 1e9
    RESULTS["copy_gbs"] = 2 * x.size * 2 / cp / 1e6
    log(f"XLA bf16 matmul {matmul_n}^3: {RESULTS['matmul_tflops']:.0f} TFLOP/s; "
        f"y=2x copy: {RESULTS['copy_gbs']:.0f} GB/s")


def check_on_device(name, layer, blocks):
    """Tuned kernels vs the reference (fp32 on the same bf16 inputs) at the layer's group size, extent and
    window, but 1536 tokens and 16 query heads (the reference materialises [H, T, T]): relative L2 errors."""
    small = dataclasses.replace(layer, tokens=CHECK_TOKENS, heads=16, kv_heads=16 // layer.groups)
    (q, k, v, r, p), tau, ct = inputs(small, seed=3)
    pos = jnp.broadcast_to(jnp.arange(small.tokens), (small.batch, small.tokens))
    geos, args, ct = prepared(small, blocks, interpret=False, seed=3)
    ours = jax.jit(lambda *x: jax.vjp(lambda *y: kernel.padded_attention(geos, *y, *args[5:]), *x))
    ref = jax.jit(lambda *x: jax.vjp(lambda *y: rel_attention(*y, pos, pos, window=layer.window, tau=tau),
                                     *[a.astype(jnp.float32) for a in x]))
    out, vjp = ours(*args[:5])
    grads = vjp(ct)
    with jax.default_matmul_precision("highest"):
        want, want_vjp = ref(q, k, v, r, p)
        want_grads = want_vjp(ct.astype(jnp.float32))
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
    errs = {"out": rel(out, want)}
    for n, g, w in zip("q k v r".split(), grads, want_grads):
        errs["d" + n] = rel(g, w)
    errs["dP"] = rel(grads[4][:, geos[0].rel_left:geos[0].rel_left + layer.extent], want_grads[4])
    RESULTS.setdefault("device_check", {})[name] = errs
    log(f"[{name}] device check, rel. L2 error vs fp32 reference:", {k: f"{v:.1e}" for k, v in errs.items()})


# (rows = tokens * group heads, keys, warps, stages) per kernel: forward, dK/dV, dQ. The first run's sweep
# (recorded in pallas_kernels/rel_attention/tuning.py) settled the forward and dQ shapes.
CANDIDATES = (((128, 64, 8, 3),),
              ((64, 64, 8, 2), (64, 64, 4, 2)),
              ((128, 64, 8, 2),))


def as_blocks(rows, block_k, warps, stages, groups):
    return Blocks(rows // groups, block_k, warps, stages)


def sweep(name, layer, candidates=CANDIDATES):
    """Time each kernel alone under the candidate tile shapes; returns the fastest (forward, dK/dV, dQ) shapes."""
    geos, args, ct = prepared(layer)
    out, lse = jax.jit(lambda *a: forward.forward(geos[0], *a))(*args)
    res = backward.residual_args(*args, out, lse, ct)
    best = []
    for i, (kname, fn, operands) in enumerate((("forward", forward.forward, args), ("dkdv", backward.dkdv, res),
                                                ("dq", backward.dq, res))):
        timings = []
        for shape in candidates[i]:
            geo = dataclasses.replace(geos[i], blocks=as_blocks(*shape, layer.groups))
            try:
                ms = time_ms(jax.jit(lambda *x, geo=geo, fn=fn: fn(geo, *x)), *operands)
            except Exception as e:  # a shape the compiler refuses: report it and go on
                log(f"[{name}] {kname} {shape}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            timings.append((ms, shape))
            log(f"[{name}] {kname} rows/keys/warps/stages {shape}: {ms:.3f} ms")
        RESULTS.setdefault("sweep", {}).setdefault(name, {})[kname] = timings
        best.append(min(timings)[1] if timings else None)
    return best


def ours(layer, blocks=None, interpret=None):
    """Our kernels' forward and forward+backward times (ms) at the layer's shape."""
    geos, args, ct = prepared(layer, blocks, interpret)
    fwd = jax.jit(lambda *a: kernel.padded_attention(geos, *a))
    fwd_bwd = jax.jit(lambda *a: jax.vjp(lambda *x: kernel.padded_attention(geos, *x, *a[5:]), *a[:5])[1](ct))
    return {"fwd_ms": time_ms(fwd, *args), "fwd_bwd_ms": time_ms(fwd_bwd, *args),
            "blocks": [str(g.blocks) for g in geos]}


def cudnn(layer, implementation="cudnn"):
    """jax.nn.dot_product_attention without the bias, same causal / window mask (implementation=None: XLA)."""
    (q, k, v, _, _), _, ct = inputs(layer)
    window = None if layer.window is None else (layer.window - 1, 0)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0 / layer.dim, is_causal=True,
                                            local_window_size=window, implementation=implementation)
    fwd_bwd = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](ct))
    return {"fwd_ms": time_ms(jax.jit(attn), q, k, v), "fwd_bwd_ms": time_ms(fwd_bwd, q, k, v)}


def torch_ms(fn):
    """Median ms of fn(): triton's do_bench on CUDA, a plain loop on CPU (smoke runs)."""
    import torch
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(TIMING["rounds"]):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def flex(layer):
    """torch FlexAttention with the same bias as a score_mod (as in shared/peers/inkling_peers.py): fwd and
    fwd+bwd ms. Compiled on CUDA; eager and forward only on CPU (smoke runs: Flex has no CPU backward). Needs no
    JAX, so it can run in a child process."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    RESULTS["torch"] = torch.__version__
    cuda = torch.cuda.is_available()
    run_flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    dev, bf = ("cuda" if cuda else "cpu"), torch.bfloat16
    b, t, h, d = layer.batch, layer.tokens, layer.heads, layer.dim
    hkv, extent, window = layer.kv_heads, layer.extent, layer.window
    q = torch.randn(b, h, t, d, device=dev, dtype=bf, requires_grad=cuda)
    k = torch.randn(b, hkv, t, d, device=dev, dtype=bf, requires_grad=cuda)
    v = torch.randn(b, hkv, t, d, device=dev, dtype=bf, requires_grad=cuda)
    r = torch.randn(b, t, h, layer.d_rel, device=dev, dtype=bf)
    p = torch.randn(layer.d_rel, extent, device=dev, dtype=bf)
    rel = torch.einsum("bthd,de->bhte", r, p)

    def mask(b, h, qi, ki):
        return (qi >= ki) if window is None else ((qi >= ki) & (qi - ki < window))

    def score(s, b, h, qi, ki):
        d = qi - ki
        return s + torch.where(d < extent, rel[b, h, qi, torch.clamp(d, 0, extent - 1)].float(), 0.0)

    block = 128 if t % 128 == 0 else t  # create_block_mask's default block is 128
    block_mask = create_block_mask(mask, None, None, t, t, device=dev, BLOCK_SIZE=block)
    run = lambda: run_flex(q, k, v, score_mod=score, block_mask=block_mask, scale=1.0 / d, enable_gqa=True)
    with torch.no_grad():
        fwd = torch_ms(run)
    if not cuda:
        return {"fwd_ms": fwd, "fwd_bwd_ms": None}
    grad = torch.randn(b, h, t, d, device=dev, dtype=bf)
    fwd_bwd = torch_ms(lambda: torch.autograd.grad(run(), (q, k, v), grad))
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}


def table():
    mm = RESULTS["matmul_tflops"]
    lines = [f"device {RESULTS.get('device')}, jax {RESULTS['jax']}, torch {RESULTS.get('torch')}; "
             f"matmul {mm:.0f} TFLOP/s, copy {RESULTS['copy_gbs']:.0f} GB/s",
             f"{'layer':8} {'kernel':22} {'fwd ms':>8} {'TFLOP/s':>8} {'%mm':>5} {'f+b ms':>8} {'bwd ms':>8} "
             f"{'TFLOP/s':>8}"]
    for name, layer in LAYERS.items():
        fl = layer.flops()
        rows = RESULTS.get(name, {})
        for kname in ("ours", "cudnn (no bias)", "flex + bias"):
            x = rows.get(kname)
            if not x:
                continue
            bwd = x["fwd_bwd_ms"] - x["fwd_ms"]
            tf = fl / x["fwd_ms"] / 1e9
            lines.append(f"{name:8} {kname:22} {x['fwd_ms']:8.3f} {tf:8.1f} {100 * tf / mm:5.1f} "
                         f"{x['fwd_bwd_ms']:8.3f} {bwd:8.3f} {3.5 * fl / x['fwd_bwd_ms'] / 1e9:8.1f}")
        o, c, f = rows.get("ours"), rows.get("cudnn (no bias)"), rows.get("flex + bias")
        if o and f:
            lines.append(f"{name:8} fwd vs flex: {f['fwd_ms'] / o['fwd_ms']:.2f}x (target 5x); bwd vs flex: "
                         f"{(f['fwd_bwd_ms'] - f['fwd_ms']) / (o['fwd_bwd_ms'] - o['fwd_ms']):.2f}x (target 3x)")
        if o and c:
            lines.append(f"{name:8} fwd TFLOP/s vs cuDNN: {c['fwd_ms'] / o['fwd_ms']:.2f} (target 0.75)")
    return "\n".join(lines)


def guarded(label, fn):
    try:
        fn()
    except Exception as e:  # report and go on: one failure must not cost the rest of the run
        log(f"{label} FAILED {type(e).__name__}: {str(e)[:600]}")
    gc.collect()


def main():
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    rooflines()
    shapes = sweep("full", LAYERS["full"])  # the sliding layer reuses the winning tile shapes
    blocks = {}
    for name, layer in LAYERS.items():
        blocks[name] = tuple(t if s is None else as_blocks(*s, layer.groups)
                             for s, t in zip(shapes, tuning.blocks(layer.groups, layer.dim)))
        RESULTS[name] = {"blocks": blocks[name]}
        log(f"[{name}] blocks {blocks[name]}")
        guarded(f"[{name}] ours", lambda: RESULTS[name].__setitem__("ours", ours(layer, blocks[name], False)))
        guarded(f"[{name}] cudnn", lambda: RESULTS[name].__setitem__("cudnn (no bias)", cudnn(layer)))
        log(f"[{name}]", {k: v for k, v in RESULTS[name].items() if k != "blocks"})
        save()
    print(table())
    for name, layer in LAYERS.items():
        if time.time() - START > FLEX_START_LIMIT_S:
            log(f"[{name}] flex skipped: out of time")
            continue
        guarded(f"[{name}] flex", lambda: RESULTS[name].__setitem__("flex + bias", flex(layer)))
        log(f"[{name}] flex", RESULTS[name].get("flex + bias"))
        save()
    print(table())
    for name, layer in LAYERS.items():
        if time.time() - START > CHECK_START_LIMIT_S:
            log(f"[{name}] device check skipped: out of time")
            continue
        guarded(f"[{name}] check", lambda: check_on_device(name, layer, blocks[name]))
        save()


if __name__ == "__main__":
    main()
