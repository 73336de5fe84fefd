"""The MoE layer on one GPU at Inkling's expert shapes, against its peers and the ceilings measured in the same run.

    python -m benchmarks.moe [--quantized] [--dry-run] [--out DIR]

Prefill/training: 16k tokens routed top-6 over 32 local experts + 2 shared experts (131072 rows), hidden 6144,
width 3072, bf16. FLOPs: forward 6*M*H*I (gate, up, down), forward+backward 3x.
- kernel rows: the grouped FFN on rows already sorted by expert, the 2 shared experts as 2 more groups of a
  weight stack that holds all 34 (the linearised layout with the weights stored stacked): ours (`moe_ffn`), ours
  with jax's kernels for the backward (`MatmulKernels(backward="jax_mgpu")`: our forward, SwiGLU backward and
  residuals), the peer: jax's Mosaic-GPU `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu` in a custom_vjp, and
  `jax.lax.ragged_dot` (both with a fused [gate|up] weight, SwiGLU in XLA). ragged_dot pads every group to all
  rows (a [34, M, 6144] buffer), so it runs at a reduced token count, stated in its row.
- layer rows: `inkling_jax.nn.moe.experts` with the Pallas MoE backend (routing sort, gathers, combine included)
  on the model's separate routed / shared weights, the shared experts as an XLA einsum; with our matmuls and with
  jax's in the backward (`Backend.moe_backward`).
Our rows are the default backend's (`moe_backward="auto"` is ours). Every row names what ran (its `backend`) and
its speed against the peer measured in the same run (the peer's time over the row's: above 1 is faster than the
peer).
Decode (1/8/64 tokens): bytes of the touched experts' weights (routed + shared) per second against the copy
bandwidth. Ceilings: jitted `y = 2x` over 2 GiB (bytes read + written) and an XLA bf16 8192^3 matmul.

--quantized measures instead fp8 (`pallas_kernels/moe/fp8.py`) and NVFP4 (`nvfp4.py`) routed experts against
bf16 on the same rows: decode steps of 1 to 128 tokens (bytes of the touched experts per second against the read
bandwidth) and the prefill forward (TFLOP/s), with each format's relative L2 distance from bf16's output.
--dry-run runs tiny shapes on CPU (the kernels interpreted) to check the plumbing; its numbers mean nothing.
Prints one summary table last, also when stopped by SIGTERM, and writes moe_bench.json into --out.
"""

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe_peers import ffn_rows, mgpu_peer, unfused_ffn
from benchmarks.moe_report import OURS_KERNEL, OURS_LAYER, PEER, summary
from benchmarks.timing import attempt, copy_bandwidth, matmul_flops, median_seconds, read_bandwidth, stamp
from inkling_jax.backend import Backend
from inkling_jax.nn.moe import experts
from pallas_kernels.moe import DECODE_MAX_ROWS, MatmulKernels, block_tiles, jax_mgpu, moe_ffn, moe_ffn_decode
from pallas_kernels.moe.decode import MAX_SLAB_TOKENS
from pallas_kernels.moe.fp8 import moe_ffn_fp8, quantize_experts
from pallas_kernels.moe.nvfp4 import moe_ffn_nvfp4
from pallas_kernels.moe.nvfp4 import quantize_experts as quantize_nvfp4

START = time.perf_counter()
PALLAS = Backend(moe="pallas")  # the model's MoE on our grouped-matmul kernels, forward and backward
JAX_BACKWARD = MatmulKernels(backward=jax_mgpu.JAX_MGPU)
PALLAS_JAX_BACKWARD = Backend(moe="pallas", moe_backward=jax_mgpu.JAX_MGPU)


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int = 6144
    width: int = 3072
    local: int = 32  # routed experts
    shared: int = 2
    top_k: int = 6
    tokens: int = 16384  # the prefill's
    ragged_tokens: int = 2048  # lax.ragged_dot's (it pads every group to all rows)
    copy_elements: int = 1 << 30
    matmul_n: int = 8192
    dry: bool = False


INKLING = Shapes()
DRY = Shapes(hidden=256, width=128, tokens=64, ragged_tokens=32, copy_elements=1 << 20, matmul_n=256, dry=True)


class Run:
    """The shapes of this run and what it measured (written out as JSON)."""

    def __init__(self, shapes: Shapes):
        self.s = shapes
        self.results = {"stamp": stamp(), "rows": {}, "decode": {}, "errors": {}, "rel_err_vs_mgpu_peer": {}}

    def guarded(self, name, fn):
        return attempt(name, fn, self.results["errors"])


def routing(s, tokens, seed):
    """Random top-k picks over the local experts: (ids [T, k], group sizes of the local + shared groups)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, s.local)), axis=1)[:, :s.top_k].astype(np.int32)
    return ids, jnp.array(list(np.bincount(ids.ravel(), minlength=s.local)) + [tokens] * s.shared, jnp.int32)


def rnd(key, shape, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)


def weights(s, seed=1):
    """Gate, up and down stacks of every expert, routed first, then shared."""
    ks = jax.random.split(jax.random.key(seed), 3)
    g, h, i = s.local + s.shared, s.hidden, s.width
    return rnd(ks[0], (g, h, i), h ** -0.5), rnd(ks[1], (g, h, i), h ** -0.5), rnd(ks[2], (g, i, h), i ** -0.5)


def rows_inputs(s, tokens, seed=0):
    """Sorted rows of the linearised layout: x [M, H], group sizes, row weights, output cotangent, expert ids."""
    ids, gs = routing(s, tokens, seed)
    m = int(gs.sum())
    ks = jax.random.split(jax.random.key(seed), 3)
    return dict(x=rnd(ks[0], (m, s.hidden)), gs=gs, rw=jax.random.uniform(ks[1], (m,), jnp.float32, 0.05, 1.0),
                dy=rnd(ks[2], (m, s.hidden)), ids=jnp.asarray(ids))


def ceilings(run):
    r = run.results
    r["copy_GBps"] = copy_bandwidth(run.s.copy_elements, data="normal") / 1e9
    r["matmul_TFLOPs"] = matmul_flops(run.s.matmul_n, data="normal") / 1e12
    print(f"copy {r['copy_GBps']:.0f} GB/s, XLA bf16 matmul {r['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


def train_step(f, num_diff):
    """jit of (out, grads of the first num_diff arguments) for an output cotangent given last."""
    def step(*args):
        *args, dy = args
        out, vjp = jax.vjp(lambda *d: f(*d, *args[num_diff:]), *args[:num_diff])
        return out, vjp(dy)
    return jax.jit(step)


def kernels_name(kernels: MatmulKernels, s, rows: int) -> str:
    groups = s.local + s.shared
    tiles = "large" if block_tiles(rows, groups, jnp.bfloat16)[0].large else "default"
    return (f"moe_ffn: forward {kernels.forward} ({tiles} tiles; in slabs of whole blocks), "
            f"backward {kernels.backward}")


def backend_name(backend: Backend, num_tokens: int) -> str:
    use = backend.resolve()
    if use.moe == "pallas" and num_tokens <= MAX_SLAB_TOKENS:
        return "moe=pallas: the decode layout, our matmuls"
    layout = ", in slabs of whole blocks" if use.moe == "pallas" else ""
    return f"moe={use.moe}, moe_forward={use.moe_forward}, moe_backward={use.moe_backward}{layout}"


def measure(run, name, f, args, num_diff, flops, *, backend, note="", trials=5):
    """Times f's forward and forward + backward; `backend` names what runs."""
    warmup = min(2, trials)
    t = run.guarded(f"{name} fwd", lambda: median_seconds(jax.jit(f), *args[:-1], trials=trials, warmup=warmup))
    tb = run.guarded(f"{name} fwd+bwd",
                     lambda: median_seconds(train_step(f, num_diff), *args, trials=trials, warmup=warmup))
    run.results["rows"][name] = dict(backend=backend, note=note, fwd_ms=t and t * 1e3,
                                     fwd_TFLOPs=t and flops / t / 1e12, fwdbwd_ms=tb and tb * 1e3,
                                     fwdbwd_TFLOPs=tb and 3 * flops / tb / 1e12)
    print(name, json.dumps(run.results["rows"][name]), flush=True)


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def prefill(run, w):
    """The grouped FFN alone, ours and the Mosaic-GPU peer, and how far apart their outputs and gradients are."""
    s = run.s
    d = rows_inputs(s, s.tokens)
    flops = 6 * d["x"].shape[0] * s.hidden * s.width
    kargs = (d["x"], *w, d["rw"], d["gs"], d["dy"])
    ours = {}
    for name, kernels in ((OURS_KERNEL, MatmulKernels()), ("kernel: ours forward + jax backward", JAX_BACKWARD)):
        ours[name] = functools.partial(ffn_rows, functools.partial(moe_ffn, kernels=kernels))
        measure(run, name, ours[name], kargs, 5, flops, backend=kernels_name(kernels, s, d["x"].shape[0]))
    peer_mm = run.guarded("mgpu peer import", mgpu_peer)
    if peer_mm is not None:
        peer = functools.partial(ffn_rows, functools.partial(unfused_ffn, peer_mm))
        measure(run, PEER, peer, kargs, 5, flops,
                backend="jax ragged_dot_mgpu + transposed_ragged_dot_mgpu, [gate|up] in one, SwiGLU in XLA")
        want = run.guarded("peer outputs", lambda: train_step(peer, 5)(*kargs))
        names = ("y", "dx", "dw_gate", "dw_up", "dw_down", "drow_weights")
        for name, f in ours.items():
            got = run.guarded(f"{name} outputs", lambda f=f: train_step(f, 5)(*kargs))
            if got is not None and want is not None:
                run.results["rel_err_vs_mgpu_peer"][name] = {
                    n: rel(a, b) for n, a, b in zip(names, [got[0], *got[1]], [want[0], *want[1]])}
    return d


def split(s, w):
    """The stacked weights as the model holds them: (routed gate, up, down), (shared gate, up, down)."""
    return tuple(m[:s.local] for m in w), tuple(m[s.local:] for m in w)


def layer(run, w, d):
    """`moe.experts` (what the model runs), the shared experts as an einsum."""
    s = run.s
    routed, shared = split(s, w)
    x = d["x"][:s.tokens]
    ks = jax.random.split(jax.random.key(5), 2)
    wts = jax.random.uniform(ks[0], (s.tokens, s.top_k), jnp.float32, 0.1, 1.0)
    shared_wts = jax.random.uniform(ks[1], (s.tokens, s.shared), jnp.float32, 0.1, 1.0)
    flops = 6 * s.tokens * (s.top_k + s.shared) * s.hidden * s.width
    args = (x, routed, shared, wts, shared_wts, d["ids"], d["dy"][:s.tokens])
    for name, backend in ((OURS_LAYER, PALLAS),
                          ("layer: ours forward + jax backward, shared as XLA einsum", PALLAS_JAX_BACKWARD)):
        def f(x, routed, shared, wts, shared_wts, ids, backend=backend):
            return experts(x, routed, shared, ids, wts, shared_wts, backend=backend).astype(x.dtype)
        measure(run, name, f, args, 5, flops, backend=backend_name(backend, s.tokens),
                note="incl. routing sort/gather/combine")


def ragged_peer(run, w):
    """`jax.lax.ragged_dot` at the reduced token count it fits at, with ours and ours with jax's backward at the
    same size."""
    s = run.s
    d = rows_inputs(s, s.ragged_tokens, seed=2)
    flops = 6 * d["x"].shape[0] * s.hidden * s.width
    args = (d["x"], *w, d["rw"], d["gs"], d["dy"])
    f = functools.partial(ffn_rows, functools.partial(unfused_ffn, jax.lax.ragged_dot))
    measure(run, "kernel: jax.lax.ragged_dot", f, args, 5, flops, trials=2, backend="jax.lax.ragged_dot (XLA)",
            note=f"at {s.ragged_tokens} tokens ({d['x'].shape[0]} rows): it pads every group to all rows")
    rows = d["x"].shape[0]
    for name, kernels in (("kernel: ours at the same size", MatmulKernels()),
                          ("kernel: ours forward + jax backward at the same size", JAX_BACKWARD)):
        measure(run, name, functools.partial(ffn_rows, functools.partial(moe_ffn, kernels=kernels)), args, 5,
                flops, backend=kernels_name(kernels, s, rows), note=f"at {s.ragged_tokens} tokens ({rows} rows)")


def decode(run, w):
    """Decode-sized steps: the kernel, the model's layer both ways and ragged_dot, in bytes of the touched
    experts' weights per second against the copy bandwidth."""
    s = run.s
    wg, wu, wd = w
    routed, shared = split(s, w)
    for tokens in (1, 8, 64):
        d = rows_inputs(s, tokens, seed=tokens)
        touched = int((d["gs"] > 0).sum())
        nbytes = touched * 3 * s.hidden * s.width * 2
        row = run.results["decode"][tokens] = dict(touched_experts=touched, weight_GB=nbytes / 1e9)
        kernel = jax.jit(functools.partial(moe_ffn_decode, max_group_rows=tokens))
        cases = {"kernel": (kernel, (d["x"], wg, wu, wd, d["gs"], d["rw"]))}
        x, ids = d["x"][:tokens], d["ids"]
        wts, swts = jnp.full((tokens, s.top_k), 0.1), jnp.full((tokens, s.shared), 0.2)
        cases["layer_shared_einsum"] = (jax.jit(functools.partial(experts, backend=PALLAS)),
                                        (x, routed, shared, ids, wts, swts))
        cases["ragged_dot"] = (jax.jit(functools.partial(unfused_ffn, jax.lax.ragged_dot)),
                               (d["x"], wg, wu, wd, d["gs"], d["rw"]))
        for name, (f, args) in cases.items():
            calls = 10 if name == "ragged_dot" else 50
            # The mean over one loop of asynchronous calls (decode-sized work), after 2 warm-up calls.
            t = run.guarded(f"decode {tokens} {name}",
                            lambda: median_seconds(f, *args, trials=1, warmup=2, calls=calls))
            row[f"{name}_us"] = t and t * 1e6
            row[f"{name}_of_copy"] = t and nbytes / t / 1e9 / run.results["copy_GBps"]
        print(f"decode {tokens}", json.dumps(row), flush=True)


def expert_bytes(s, gs, precision):
    """Bytes of the touched experts' weights: bf16 2 per value, fp8 1, NVFP4 a half plus an f16 scale per 16."""
    per_value = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 2 / 16}[precision]
    return int((gs > 0).sum()) * 3 * s.hidden * s.width * per_value


def quantized_vs_bf16(run, w):
    """fp8 and NVFP4 routed experts against bf16 on the same rows: decode steps (bytes of the touched experts'
    weights per second against the read bandwidth) and the prefill forward (TFLOP/s); the relative L2 distance
    of the outputs from bf16's is the quantisation's error."""
    s = run.s
    read = run.results["read_GBps"] = read_bandwidth(s.copy_elements, data="normal") / 1e9
    q8, q4 = quantize_experts(*w), quantize_nvfp4(*w)
    table = run.results["quantized"] = {}
    for tokens in (1, 8, 32, 64, 128, s.tokens):
        d = rows_inputs(s, tokens, seed=tokens)
        args = (d["x"], d["gs"], d["rw"])
        bound = tokens if tokens <= 128 else None
        layout = dict(max_group_rows=tokens if tokens <= DECODE_MAX_ROWS else None)  # as the layer picks it
        cases = {"bf16": (jax.jit(functools.partial(moe_ffn_decode, **layout) if tokens <= MAX_SLAB_TOKENS
                                  else moe_ffn), lambda f: f(args[0], *w, *args[1:])),
                 "fp8": (jax.jit(functools.partial(moe_ffn_fp8, max_group_rows=bound)),
                         lambda f: f(args[0], q8, *args[1:])),
                 "nvfp4": (jax.jit(functools.partial(moe_ffn_nvfp4, max_group_rows=bound)),
                           lambda f: f(args[0], q4, *args[1:]))}
        row = table[tokens] = {}
        outs = {}
        for name, (f, call) in cases.items():
            outs[name] = run.guarded(f"{name} {tokens}", lambda: call(f))
            t = run.guarded(f"{name} {tokens} time", lambda: median_seconds(
                lambda: call(f), trials=5, warmup=2, calls=20 if bound else 3))
            if not t:
                continue
            row[name] = dict(us=t * 1e6, of_read=expert_bytes(s, d["gs"], name) / t / 1e9 / read,
                             TFLOPs=6 * int(d["gs"].sum()) * s.hidden * s.width / t / 1e12)
        for name in ("fp8", "nvfp4"):
            if outs.get(name) is not None and outs.get("bf16") is not None:
                row[f"{name}_vs_bf16_rel_l2"] = rel(outs[name], outs["bf16"])
        print(f"quantized {tokens} tokens", json.dumps(row), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantized", action="store_true", help="fp8 and NVFP4 experts against bf16 only")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, to check the plumbing on CPU")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for moe_bench.json")
    args = parser.parse_args(argv)
    if args.dry_run:  # before the backend starts: Mosaic GPU's interpreter blocks XLA CPU threads in its barriers
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    run = Run(DRY if args.dry_run else INKLING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a `timeout` still gets the summary below
    try:
        ceilings(run)
        w = weights(run.s)
        if args.quantized:
            quantized_vs_bf16(run, w)
            return
        d = prefill(run, w)
        decode(run, w)
        layer(run, w, d)
        ragged_peer(run, w)
    finally:
        summary(run, args.out, time.perf_counter() - START)


if __name__ == "__main__":
    main()
