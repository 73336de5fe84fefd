"""Relative flash attention on one GPU at Inkling's shapes, against its peers measured in the same run.

Layers: batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16, bf16; full (8 KV heads, E 1024, causal) and
sliding (16 KV heads, window 512 = E). Peers: torch FlexAttention with the same bias as a score_mod (as in
shared/peers/inkling_peers.py) and cuDNN plain attention through jax.nn.dot_product_attention (no bias, same mask).
Ceiling: a measured XLA bf16 matmul (and a copy, for the record). FLOPs: 4 * B * Hq * D per visible (query, key)
pair (causal / windowed pairs only; bias FLOPs not counted); forward + backward counts 3.5x the forward.
Also times each kernel alone (a few dK/dV tile shapes on the full layer), and checks the tuned kernels against the
jnp reference on the device (1536 tokens, 16 query heads).

Run: PYTHONPATH=. python bench/rel_attention.py   (writes $OUT/rel_attention.json when $OUT is set)
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

B, T, HQ, D, DREL = 1, 8192, 64, 128, 16
LAYERS = {"full": dict(kv_heads=8, extent=1024, window=None), "sliding": dict(kv_heads=16, extent=512, window=512)}
FLEX_START_LIMIT_S = float(os.environ.get("FLEX_START_LIMIT_S", 220))  # FlexAttention compiles slowly
CHECK_START_LIMIT_S = float(os.environ.get("CHECK_START_LIMIT_S", 260))
CHECK_TOKENS = 1536  # long enough for tiles beyond E = 1024
START = time.time()
RESULTS = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}


def log(*a):
    print(f"[{time.time() - START:6.1f}s]", *a)
    sys.stdout.flush()


def save():
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rel_attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def time_ms(fn, *args, reps=5, rounds=3):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    return 1e3 * float(np.median(times))


def pairs(window):
    return T * (T + 1) / 2 if window is None else T * window - window * (window - 1) / 2


def inputs(seq, kv_heads, extent, seed=0, heads=HQ):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, seq, heads, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, seq, kv_heads, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, seq, kv_heads, D), jnp.bfloat16)
    r = (0.5 * jax.random.normal(keys[3], (B, seq, heads, DREL))).astype(jnp.bfloat16)
    p = jax.random.normal(keys[4], (DREL, extent), jnp.bfloat16)
    pos = jnp.arange(seq, dtype=jnp.float32)
    tau = jnp.broadcast_to(1.0 + 0.1 * jnp.log(jnp.maximum(1.0, (pos + 1) / 128000.0)), (B, seq))
    return (q, k, v, r, p), tau, jax.random.normal(keys[5], (B, seq, heads, D), jnp.bfloat16)


def rooflines():
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    mm = time_ms(jax.jit(lambda x, y: x @ y), a, a)
    x = jax.random.normal(jax.random.key(2), (512 * 1024 * 1024,), jnp.bfloat16)
    cp = time_ms(jax.jit(lambda x: x * 2), x)
    RESULTS["matmul_tflops"] = 2 * 8192 ** 3 / mm / 1e9
    RESULTS["copy_gbs"] = 2 * x.size * 2 / cp / 1e6
    log(f"XLA bf16 matmul 8192^3: {RESULTS['matmul_tflops']:.0f} TFLOP/s; y=2x copy: {RESULTS['copy_gbs']:.0f} GB/s")


def check_on_device(name, layer, blocks):
    """Tuned kernels vs the reference (fp32 on the same bf16 inputs) at the layer's group size, extent and
    window, but 1536 tokens and 16 query heads (the reference materialises [H, T, T]): relative L2 errors."""
    seq, heads = CHECK_TOKENS, 16
    (q, k, v, r, p), tau, ct = inputs(seq, heads * layer["kv_heads"] // HQ, layer["extent"], seed=3, heads=heads)
    tau = tau if layer["window"] is None else None
    pos = jnp.broadcast_to(jnp.arange(seq), (B, seq))
    geos, args = kernel.prepare(q, k, v, r, p, q_offset=0, window=layer["window"], tau=tau, segment_ids=None,
                                scale=None, interpret=False, blocks=blocks)
    ours = jax.jit(lambda *x: jax.vjp(lambda *y: kernel.padded_attention(geos, *y, *args[5:]), *x))
    ref = jax.jit(lambda *x: jax.vjp(lambda *y: rel_attention(*y, pos, pos, window=layer["window"], tau=tau),
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
    errs["dP"] = rel(grads[4][:, geos[0].rel_left:geos[0].rel_left + layer["extent"]], want_grads[4])
    RESULTS.setdefault("device_check", {})[name] = errs
    log(f"[{name}] device check, rel. L2 error vs fp32 reference:", {k: f"{v:.1e}" for k, v in errs.items()})


# (rows = tokens * group heads, keys, warps, stages) per kernel: forward, dK/dV, dQ. The first run's sweep
# (recorded in pallas_kernels/rel_attention/tuning.py) settled the forward and dQ shapes.
CANDIDATES = (((128, 64, 8, 3),),
              ((64, 64, 8, 2), (64, 64, 4, 2)),
              ((128, 64, 8, 2),))


def as_blocks(rows, block_k, warps, stages, groups):
    return Blocks(rows // groups, block_k, warps, stages)


def sweep(name, layer):
    """Time each kernel alone under the candidate tile shapes; returns the fastest (forward, dK/dV, dQ) shapes."""
    groups = HQ // layer["kv_heads"]
    (q, k, v, r, p), tau, ct = inputs(T, layer["kv_heads"], layer["extent"])
    tuned = tuning.blocks(groups, D)
    geos, args = kernel.prepare(q, k, v, r, p, q_offset=0, window=layer["window"], tau=tau, segment_ids=None,
                                scale=None, interpret=False, blocks=tuned)
    out, lse = jax.jit(lambda *a: forward.forward(geos[0], *a))(*args)
    res = backward.residual_args(*args, out, lse, ct)
    best = []
    for i, (kname, fn, operands) in enumerate((("forward", forward.forward, args), ("dkdv", backward.dkdv, res),
                                                ("dq", backward.dq, res))):
        timings = []
        for shape in CANDIDATES[i]:
            geo = dataclasses.replace(geos[i], blocks=as_blocks(*shape, groups))
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


def ours(layer, blocks):
    (q, k, v, r, p), tau, ct = inputs(T, layer["kv_heads"], layer["extent"])
    tau = tau if layer["window"] is None else None
    geos, args = kernel.prepare(q, k, v, r, p, q_offset=0, window=layer["window"], tau=tau, segment_ids=None,
                                scale=None, interpret=False, blocks=blocks)
    fwd = jax.jit(lambda *a: kernel.padded_attention(geos, *a))
    fwd_bwd = jax.jit(lambda *a: jax.vjp(lambda *x: kernel.padded_attention(geos, *x, *a[5:]), *a[:5])[1](ct))
    return {"fwd_ms": time_ms(fwd, *args), "fwd_bwd_ms": time_ms(fwd_bwd, *args), "blocks": [str(b) for b in blocks]}


def cudnn(layer):
    (q, k, v, _, _), _, ct = inputs(T, layer["kv_heads"], layer["extent"])
    window = None if layer["window"] is None else (layer["window"] - 1, 0)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=1.0 / D, is_causal=True, local_window_size=window,
                                            implementation="cudnn")
    fwd_bwd = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v)[1](ct))
    return {"fwd_ms": time_ms(jax.jit(attn), q, k, v), "fwd_bwd_ms": time_ms(fwd_bwd, q, k, v)}


def flex(layer):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench
    RESULTS["torch"] = torch.__version__
    compiled = torch.compile(flex_attention, dynamic=False)
    dev, bf = "cuda", torch.bfloat16
    hkv, extent, window = layer["kv_heads"], layer["extent"], layer["window"]
    q = torch.randn(B, HQ, T, D, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(B, hkv, T, D, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(B, hkv, T, D, device=dev, dtype=bf, requires_grad=True)
    r = torch.randn(B, T, HQ, DREL, device=dev, dtype=bf)
    p = torch.randn(DREL, extent, device=dev, dtype=bf)
    rel = torch.einsum("bthd,de->bhte", r, p)

    def mask(b, h, qi, ki):
        return (qi >= ki) if window is None else ((qi >= ki) & (qi - ki < window))

    def score(s, b, h, qi, ki):
        d = qi - ki
        return s + torch.where(d < extent, rel[b, h, qi, torch.clamp(d, 0, extent - 1)].float(), 0.0)

    block_mask = create_block_mask(mask, None, None, T, T, device=dev)
    run = lambda: compiled(q, k, v, score_mod=score, block_mask=block_mask, scale=1.0 / D, enable_gqa=True)
    with torch.no_grad():
        fwd = do_bench(run, warmup=10, rep=50, return_mode="median")
    grad = torch.randn(B, HQ, T, D, device=dev, dtype=bf)
    fwd_bwd = do_bench(lambda: torch.autograd.grad(run(), (q, k, v), grad), warmup=10, rep=50, return_mode="median")
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}


def table():
    mm = RESULTS["matmul_tflops"]
    lines = [f"device {RESULTS['device']}, jax {RESULTS['jax']}, torch {RESULTS.get('torch')}; "
             f"matmul {mm:.0f} TFLOP/s, copy {RESULTS['copy_gbs']:.0f} GB/s",
             f"{'layer':8} {'kernel':22} {'fwd ms':>8} {'TFLOP/s':>8} {'%mm':>5} {'f+b ms':>8} {'bwd ms':>8} "
             f"{'TFLOP/s':>8}"]
    for name, layer in LAYERS.items():
        fl = 4 * B * HQ * pairs(layer["window"]) * D
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
    rooflines()
    shapes = sweep("full", LAYERS["full"])  # the sliding layer reuses the winning tile shapes
    blocks = {}
    for name, layer in LAYERS.items():
        groups = HQ // layer["kv_heads"]
        blocks[name] = tuple(t if s is None else as_blocks(*s, groups)
                             for s, t in zip(shapes, tuning.blocks(groups, D)))
        RESULTS[name] = {"blocks": blocks[name]}
        log(f"[{name}] blocks {blocks[name]}")
        guarded(f"[{name}] ours", lambda: RESULTS[name].__setitem__("ours", ours(layer, blocks[name])))
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
