"""MoE grouped-matmul kernels on one GPU, at Inkling's expert shapes, against the peers in the same run.

Prefill/training: 16k tokens routed top-6 over 32 local experts + 2 shared experts as 2 extra groups
(131072 rows), hidden 6144, width 3072, bf16. FLOPs: forward 6*M*H*I (gate, up, down), forward+backward 3x.
Peers: `jax.lax.ragged_dot` (XLA) and jax's Mosaic-GPU `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu` in a
custom_vjp (fused gate/up weight, SwiGLU in XLA). Ceilings measured here: device copy bandwidth and an XLA
bf16 matmul. Decode (1/8/64 tokens): bytes of the touched experts' weights per second vs copy bandwidth.

    PYTHONPATH=. python bench/moe.py [--quick]
"""

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import epilogues, matmuls, moe_ffn, moe_ffn_decode
from pallas_kernels.moe.tuning import GmmConfig, WgradConfig

H, I, LOCAL, SHARED, TOP_K, TOKENS = 6144, 3072, 32, 2, 6, 16384
QUICK = "--quick" in sys.argv
START = time.perf_counter()
SWEEP_UNTIL_S = float(os.environ.get("MOE_BENCH_SWEEP_UNTIL_S", "1e9"))  # stop trying tile configs after this
CEIL_COPY, CEIL_MM = 1 << 30, 8192
if "--dry-run" in sys.argv:  # tiny shapes, to check the script's plumbing on CPU
    H, I, TOKENS, CEIL_COPY, CEIL_MM = 256, 128, 64, 1 << 20, 256
RESULTS = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}


def timed(f, *args, reps=5, warm=2):
    """Median seconds of f(*args) after `warm` warm-up calls (the first compiles)."""
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def timed_loop(f, *args, iters=50):
    """Mean seconds per call over a loop of asynchronous calls (decode-sized work)."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    outs = [f(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / iters


def guarded(name, fn):
    try:
        return fn()
    except Exception as e:  # report and keep measuring the rest
        msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        RESULTS.setdefault("errors", {})[name] = msg
        print(f"  {name} FAILED {msg}", flush=True)
        return None


def group_sizes(tokens, seed):
    """Random top-k routing over the local experts, then the two shared experts (every token)."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, LOCAL)), axis=1)[:, :TOP_K]
    return jnp.array(list(np.bincount(picks.ravel(), minlength=LOCAL)) + [tokens] * SHARED, jnp.int32)


def inputs(tokens, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    gs = group_sizes(tokens, seed)
    m, g = int(gs.sum()), LOCAL + SHARED
    rnd = lambda k, shape, s: (s * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)  # noqa: E731
    return dict(x=rnd(ks[0], (m, H), 1.0), wg=rnd(ks[1], (g, H, I), H ** -0.5), wu=rnd(ks[2], (g, H, I), H ** -0.5),
                wd=rnd(ks[3], (g, I, H), I ** -0.5), gs=gs,
                rw=jax.random.uniform(ks[4], (m,), jnp.float32, 0.05, 1.0), dy=rnd(ks[5], (m, H), 1.0))


def ceilings():
    x = jax.random.normal(jax.random.key(9), (CEIL_COPY,), jnp.bfloat16)  # 2 GiB
    t = timed(jax.jit(lambda x: x * 2), x, reps=10)
    RESULTS["copy_GBps"] = 2 * x.nbytes / t / 1e9
    a = jax.random.normal(jax.random.key(1), (CEIL_MM, CEIL_MM), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (CEIL_MM, CEIL_MM), jnp.bfloat16)
    t = timed(jax.jit(lambda a, b: a @ b), a, b, reps=10)
    RESULTS["matmul_TFLOPs"] = 2 * CEIL_MM ** 3 / t / 1e12
    print(f"copy {RESULTS['copy_GBps']:.0f} GB/s, XLA bf16 matmul {RESULTS['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


# ---- peers ---------------------------------------------------------------------------------------------------
def mgpu_peer():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd
    tiles = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)

    @jax.custom_vjp
    def mm(x, w, gs):
        return rd.ragged_dot(x, w, group_sizes=gs, grid_block_n=8, **tiles)

    def mm_fwd(x, w, gs):
        return mm(x, w, gs), (x, w, gs)

    def mm_bwd(res, dy):
        x, w, gs = res
        dx = rd.ragged_dot(dy, w, group_sizes=gs, grid_block_n=8, transpose_rhs=True, **tiles)
        return dx, trd.transposed_ragged_dot(x, dy, group_sizes=gs, grid_block_n=4, **tiles), None

    mm.defvjp(mm_fwd, mm_bwd)
    return mm


def swiglu_ffn(mm, x, w13, wd, gs, rw):
    """Unfused layout of the peers: one matmul to [gate | up], SwiGLU and row weight in XLA, then down."""
    z = mm(x, w13, gs).astype(jnp.float32)
    h = jax.nn.silu(z[:, :I]) * z[:, I:] * rw[:, None]
    return mm(h.astype(x.dtype), wd, gs)


def fwd_bwd(ffn, gs_index):
    """jit of (out, grads of every float argument) for a given output cotangent (last argument)."""
    def run(*args_and_dy):
        *args, dy = args_and_dy
        gs = args[gs_index]

        def f(*floats):
            return ffn(*floats[:gs_index], gs, *floats[gs_index:])

        out, vjp = jax.vjp(f, *args[:gs_index], *args[gs_index + 1:])
        return out, vjp(dy)
    return jax.jit(run)


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def prefill():
    d = inputs(TOKENS)
    m = d["x"].shape[0]
    flops = 6 * m * H * I
    w13 = jnp.concatenate([d["wg"], d["wu"]], axis=-1)
    ours_args = (d["x"], d["wg"], d["wu"], d["wd"], d["gs"], d["rw"])
    peer_args = (d["x"], w13, d["wd"], d["gs"], d["rw"])
    candidates = [("ours (moe_ffn)", moe_ffn, ours_args, 4)]
    peer_mm = guarded("mgpu_import", mgpu_peer)
    if peer_mm is not None:
        candidates.append(("mgpu ragged_dot peer", functools.partial(swiglu_ffn, peer_mm), peer_args, 3))
    candidates.append(("lax.ragged_dot", functools.partial(swiglu_ffn, jax.lax.ragged_dot), peer_args, 3))
    outs = {}
    rows = {}
    for name, ffn, args, gs_index in candidates:
        slow = name.startswith("lax")  # XLA pads to dense here: seconds per call
        reps = dict(reps=2, warm=1) if slow else dict(reps=5)
        train = fwd_bwd(ffn, gs_index)
        t = guarded(f"{name} fwd", lambda: timed(jax.jit(ffn), *args, **reps))
        tb = guarded(f"{name} fwd+bwd", lambda: timed(train, *args, d["dy"], **reps))
        rows[name] = dict(fwd_ms=t and t * 1e3, fwd_TFLOPs=t and flops / t / 1e12,
                          fwdbwd_ms=tb and tb * 1e3, fwdbwd_TFLOPs=tb and 3 * flops / tb / 1e12)
        print(name, json.dumps(rows[name]), flush=True)
        if not slow:
            outs[name] = guarded(f"{name} outputs", lambda: train(*args, d["dy"]))
        if len(outs) == 2 and all(v is not None for v in outs.values()):  # ours vs the Mosaic peer, full size
            (y1, (dx1, dwg, dwu, dwd1, drw1)), (y2, (dx2, dw13, dwd2, drw2)) = outs.values()
            RESULTS["rel_err_ours_vs_mgpu_peer"] = dict(
                y=rel(y1, y2), dx=rel(dx1, dx2), dw_gate_up=rel(jnp.concatenate([dwg, dwu], -1), dw13),
                dw_down=rel(dwd1, dwd2), drow_weights=rel(drw1, drw2))
            outs.clear()
    RESULTS["prefill"] = rows
    return d


def kernel_sweep(d):
    """Per-kernel TFLOP/s of ours at the bench shape, for a few tile configurations."""
    m = d["x"].shape[0]
    hmid = (0.5 * d["dy"][:, :I]).astype(jnp.bfloat16)
    swiglu = functools.partial(epilogues.swiglu, keep_preactivations=False)

    def gmm(transpose_rhs, pairs, epilogue, rows=()):
        def make(cfg):
            def run(lhs, weights, gs, rows):
                return matmuls.gmm(lhs, weights, gs, transpose_rhs=transpose_rhs, pairs=pairs, epilogue=epilogue,
                                   num_outputs=1, cfg=cfg, interpret=False, row_inputs=rows)
            return run
        return make

    plain = ((0, 0, 0),)
    roles = {
        "swiglu": (2 * m * H * 2 * I, gmm(False, ((0, 0, 0), (0, 1, 1)), swiglu),
                   ([d["x"]], [d["wg"], d["wu"]], d["gs"], (d["rw"],)),
                   [GmmConfig(block_n=128), GmmConfig(block_n=128, grid_tile_width=16),
                    GmmConfig(block_n=128, grid_tile_width=4), GmmConfig(block_n=128, stages=3)]),
        "down": (2 * m * I * H, gmm(False, plain, epilogues.plain), ([hmid], [d["wd"]], d["gs"], ()),
                 [GmmConfig(), GmmConfig(grid_tile_width=16), GmmConfig(block_n=128)]),
        "dgrad": (2 * m * H * I, gmm(True, plain, epilogues.plain), ([d["dy"]], [d["wd"]], d["gs"], ()),
                  [GmmConfig(), GmmConfig(grid_tile_width=16)]),
        "dx_pairs": (2 * m * 2 * I * H, gmm(True, ((0, 0, 0), (1, 1, 0)), epilogues.plain),
                     ([hmid, hmid], [d["wg"], d["wu"]], d["gs"], ()),
                     [GmmConfig(block_k=32), GmmConfig(block_k=32, grid_tile_width=16)]),
        "wgrad": (2 * m * H * I, lambda cfg: lambda x, dy, gs: matmuls.tgmm(x, dy, gs, cfg=cfg, interpret=False),
                  (d["x"], hmid, d["gs"]),
                  [WgradConfig(), WgradConfig(grid_tile_width=8), WgradConfig(block_n=128)]),
    }
    sweep = {}
    for role, (flops, make, args, cfgs) in roles.items():
        for cfg in cfgs[:1] if QUICK else cfgs:
            if time.perf_counter() - START > SWEEP_UNTIL_S:
                RESULTS.setdefault("skipped", []).append(f"{role} {cfg}")
                continue
            t = guarded(f"{role} {cfg}", lambda: timed(jax.jit(make(cfg)), *args, reps=5))
            if t:
                sweep.setdefault(role, []).append((flops / t / 1e12, repr(cfg)))
                print(f"  {role:9s} {flops / t / 1e12:6.1f} TFLOP/s  {cfg}", flush=True)
    RESULTS["kernels"] = {r: sorted(v, reverse=True) for r, v in sweep.items()}


def decode():
    rows = {}
    for tokens in (1, 8, 64):
        d = inputs(tokens, seed=tokens)
        touched = int((d["gs"] > 0).sum())
        weight_bytes = touched * 3 * H * I * 2
        args = (d["x"], d["wg"], d["wu"], d["wd"], d["gs"], d["rw"])
        ours = jax.jit(functools.partial(moe_ffn_decode, max_group_rows=tokens))
        t = guarded(f"decode {tokens}", lambda: timed_loop(ours, *args))
        w13 = jnp.concatenate([d["wg"], d["wu"]], -1)
        tr = guarded(f"decode {tokens} ragged", lambda: timed_loop(
            jax.jit(functools.partial(swiglu_ffn, jax.lax.ragged_dot)), d["x"], w13, d["wd"], d["gs"], d["rw"],
            iters=10))
        rows[tokens] = dict(touched_experts=touched, weight_GB=weight_bytes / 1e9, ours_us=t and t * 1e6,
                            ours_GBps=t and weight_bytes / t / 1e9, ragged_dot_us=tr and tr * 1e6,
                            ours_frac_of_copy=t and weight_bytes / t / 1e9 / RESULTS["copy_GBps"])
        print(f"decode {tokens}", json.dumps(rows[tokens]), flush=True)
    RESULTS["decode"] = rows


def summary():
    copy, peak = RESULTS["copy_GBps"], RESULTS["matmul_TFLOPs"]
    lines = [f"device {RESULTS['device']}, jax {RESULTS['jax']}; copy {copy:.0f} GB/s; XLA bf16 matmul {peak:.0f} TFLOP/s",
             f"prefill M={TOKENS * (TOP_K + SHARED)} rows, 34 groups, H={H} I={I} bf16",
             f"{'impl':24s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'/matmul':>8s} {'f+b ms':>8s} {'f+b TF/s':>9s} {'/matmul':>8s}"]
    fmt = lambda v, f: format("-", f.split(".")[0] + "s") if v is None else format(v, f)  # noqa: E731
    for name, r in RESULTS.get("prefill", {}).items():
        lines.append(f"{name:24s} {fmt(r['fwd_ms'], '8.2f')} {fmt(r['fwd_TFLOPs'], '9.1f')} "
                     f"{fmt(r['fwd_TFLOPs'] and r['fwd_TFLOPs'] / peak, '8.2f')} {fmt(r['fwdbwd_ms'], '8.2f')} "
                     f"{fmt(r['fwdbwd_TFLOPs'], '9.1f')} {fmt(r['fwdbwd_TFLOPs'] and r['fwdbwd_TFLOPs'] / peak, '8.2f')}")
    for role, v in RESULTS.get("kernels", {}).items():
        lines.append(f"kernel {role:9s} best {v[0][0]:6.1f} TFLOP/s  {v[0][1]}")
    lines.append(f"{'decode tokens':14s} {'experts':>7s} {'GB':>6s} {'ours us':>8s} {'GB/s':>7s} {'/copy':>6s} {'ragged us':>9s}")
    for tokens, r in RESULTS.get("decode", {}).items():
        lines.append(f"{tokens:<14d} {r['touched_experts']:7d} {r['weight_GB']:6.2f} {fmt(r['ours_us'], '8.0f')} "
                     f"{fmt(r['ours_GBps'], '7.0f')} {fmt(r['ours_frac_of_copy'], '6.2f')} {fmt(r['ragged_dot_us'], '9.0f')}")
    for k in ("rel_err_ours_vs_mgpu_peer", "errors"):
        if k in RESULTS:
            lines.append(f"{k}: {RESULTS[k]}")
    print("\n".join(lines), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_bench.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    ceilings()
    data = prefill()
    decode()
    kernel_sweep(data)
    summary()
