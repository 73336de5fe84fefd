"""MoE on one GPU at Inkling's expert shapes, against the peers and the ceilings in the same run.

Prefill/training: 16k tokens routed top-6 over 32 local experts + 2 shared experts (131072 rows), hidden 6144,
width 3072, bf16. FLOPs: forward 6*M*H*I (gate, up, down), forward+backward 3x.
- kernel rows: the grouped FFN on rows already sorted by expert, the 2 shared experts as 2 more groups of a
  weight stack that holds all 34 (the linearised layout with the weights stored stacked): ours (`moe_ffn`),
  jax's Mosaic-GPU `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu` in a custom_vjp and `jax.lax.ragged_dot`
  (fused [gate|up] weight, SwiGLU in XLA). ragged_dot pads every group to all rows (a [34, M, 6144] buffer), so
  it runs at a reduced token count, stated in its row.
- layer row: `inkling_jax.nn.moe.experts` with the Pallas MoE backend (routing sort, gathers, combine included)
  on the model's separate routed / shared weights, the shared experts as an XLA einsum.
Decode (1/8/64 tokens): bytes of the touched experts' weights (routed + shared) per second against the copy
bandwidth. Ceilings: jitted `y = 2x` over 2 GiB (bytes read + written) and an XLA bf16 8192^3 matmul.

    PYTHONPATH=. python bench/moe.py   (writes $OUT/moe_bench.json when OUT is set; --dry-run: tiny, on CPU;
                                        --decode-sweep: only a tile sweep of the 32-token decode step, of the
                                        fp8 experts with --fp8; with --nvfp4 a slab sweep of NVFP4 experts at
                                        8, 32 and 128 tokens (--steps=32,128: some) against fp8;
                                        --quantized: only fp8 and
                                        NVFP4 experts against bf16, decode and prefill forward)
"""

import dataclasses
import functools
import json
import os
import signal
import sys
import time

DRY = "--dry-run" in sys.argv  # tiny shapes, to check the script's plumbing on CPU
if DRY:  # Mosaic GPU's interpreter blocks XLA CPU threads in its barriers: on a 2-core machine it needs more
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import copy_bandwidth, matmul_flops, median_seconds, read_bandwidth
from bench.moe_peers import mgpu_peer, unfused_ffn
from inkling_jax.backend import Backend
from inkling_jax.nn.moe import experts
from pallas_kernels.moe import epilogues, matmuls, moe_ffn, moe_ffn_decode
from pallas_kernels.moe.fp8 import moe_ffn_fp8, quantize_experts
from pallas_kernels.moe.kernel_w4 import config_for as config_for_w4
from pallas_kernels.moe.nvfp4 import moe_ffn_nvfp4
from pallas_kernels.moe.nvfp4 import quantize_experts as quantize_nvfp4
from pallas_kernels.moe.tuning import DECODE, GmmConfig, KernelConfigs, WgradConfig

H, I, LOCAL, SHARED, TOP_K, TOKENS, RAGGED_TOKENS = 6144, 3072, 32, 2, 6, 16384, 2048
CEIL_COPY, CEIL_MM = 1 << 30, 8192
if DRY:
    H, I, TOKENS, RAGGED_TOKENS, CEIL_COPY, CEIL_MM = 256, 128, 64, 32, 1 << 20, 256
START = time.perf_counter()
SWEEP_UNTIL_S = float(os.environ.get("MOE_BENCH_SWEEP_UNTIL_S", "240"))  # stop trying tile configs after this
PALLAS = Backend(moe="pallas")
R = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "rows": {}, "decode": {}}


def guarded(name, fn):
    """fn(), or None with the error recorded (an OOM is a result too)."""
    try:
        return fn()
    except Exception as e:  # report and keep measuring the rest
        msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        R.setdefault("errors", {})[name] = msg
        print(f"  {name} FAILED {msg}", flush=True)
        return None


def routing(tokens, seed):
    """Random top-6 picks over the local experts: (ids [T, 6], group sizes of the 34 groups)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, LOCAL)), axis=1)[:, :TOP_K].astype(np.int32)
    return ids, jnp.array(list(np.bincount(ids.ravel(), minlength=LOCAL)) + [tokens] * SHARED, jnp.int32)


def rnd(key, shape, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)


def weights(seed=1):
    ks = jax.random.split(jax.random.key(seed), 3)
    g = LOCAL + SHARED
    return rnd(ks[0], (g, H, I), H ** -0.5), rnd(ks[1], (g, H, I), H ** -0.5), rnd(ks[2], (g, I, H), I ** -0.5)


def rows_inputs(tokens, seed=0):
    """Sorted rows of the linearised layout: x [M, H], group sizes, row weights, output cotangent."""
    ids, gs = routing(tokens, seed)
    m = int(gs.sum())
    ks = jax.random.split(jax.random.key(seed), 3)
    return dict(x=rnd(ks[0], (m, H)), gs=gs, rw=jax.random.uniform(ks[1], (m,), jnp.float32, 0.05, 1.0),
                dy=rnd(ks[2], (m, H)), ids=jnp.asarray(ids))


def ceilings():
    R["copy_GBps"] = copy_bandwidth(CEIL_COPY, data="normal") / 1e9
    R["matmul_TFLOPs"] = matmul_flops(CEIL_MM, data="normal") / 1e12
    print(f"copy {R['copy_GBps']:.0f} GB/s, XLA bf16 matmul {R['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


def train_step(f, num_diff):
    """jit of (out, grads of the first num_diff arguments) for an output cotangent given last."""
    def run(*args):
        *args, dy = args
        out, vjp = jax.vjp(lambda *d: f(*d, *args[num_diff:]), *args[:num_diff])
        return out, vjp(dy)
    return jax.jit(run)


def measure(name, f, args, num_diff, flops, note="", reps=5):
    t = guarded(f"{name} fwd", lambda: median_seconds(jax.jit(f), *args[:-1], trials=reps, warmup=min(2, reps)))
    tb = guarded(f"{name} fwd+bwd",
                 lambda: median_seconds(train_step(f, num_diff), *args, trials=reps, warmup=min(2, reps)))
    R["rows"][name] = dict(note=note, fwd_ms=t and t * 1e3, fwd_TFLOPs=t and flops / t / 1e12,
                           fwdbwd_ms=tb and tb * 1e3, fwdbwd_TFLOPs=tb and 3 * flops / tb / 1e12)
    print(name, json.dumps(R["rows"][name]), flush=True)


def rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def prefill(w):
    d = rows_inputs(TOKENS)
    flops = 6 * d["x"].shape[0] * H * I
    ours = lambda x, wg, wu, wd, rw, gs: moe_ffn(x, wg, wu, wd, gs, rw)  # noqa: E731
    kargs = (d["x"], *w, d["rw"], d["gs"], d["dy"])
    measure("kernel: ours (moe_ffn)", ours, kargs, 5, flops)
    peer_mm = guarded("mgpu peer import", mgpu_peer)
    if peer_mm is not None:
        peer = lambda x, wg, wu, wd, rw, gs: unfused_ffn(peer_mm, x, wg, wu, wd, gs, rw)  # noqa: E731
        measure("kernel: jax Mosaic-GPU ragged_dot", peer, kargs, 5, flops)
        got = guarded("ours outputs", lambda: train_step(ours, 5)(*kargs))
        want = guarded("peer outputs", lambda: train_step(peer, 5)(*kargs))
        if got is not None and want is not None:
            names = ("y", "dx", "dw_gate", "dw_up", "dw_down", "drow_weights")
            R["rel_err_ours_vs_mgpu_peer"] = {n: rel(a, b) for n, a, b in
                                               zip(names, [got[0], *got[1]], [want[0], *want[1]])}
    return d


def layer(w, d):
    """`moe.experts` (what the model runs), the shared experts as an einsum."""
    wg, wu, wd = w
    routed, shared = (wg[:LOCAL], wu[:LOCAL], wd[:LOCAL]), (wg[LOCAL:], wu[LOCAL:], wd[LOCAL:])
    x = d["x"][:TOKENS]
    ks = jax.random.split(jax.random.key(5), 2)
    wts = jax.random.uniform(ks[0], (TOKENS, TOP_K), jnp.float32, 0.1, 1.0)
    shared_wts = jax.random.uniform(ks[1], (TOKENS, SHARED), jnp.float32, 0.1, 1.0)
    flops = 6 * TOKENS * (TOP_K + SHARED) * H * I
    def f(x, routed, shared, wts, shared_wts, ids):
        return experts(x, routed, shared, ids, wts, shared_wts, backend=PALLAS).astype(x.dtype)
    measure("layer: ours, shared as XLA einsum", f, (x, routed, shared, wts, shared_wts, d["ids"], d["dy"][:TOKENS]),
            5, flops, note="incl. routing sort/gather/combine")


def ragged_peer(w):
    d = rows_inputs(RAGGED_TOKENS, seed=2)
    flops = 6 * d["x"].shape[0] * H * I
    f = lambda x, wg, wu, wd, rw, gs: unfused_ffn(jax.lax.ragged_dot, x, wg, wu, wd, gs, rw)  # noqa: E731
    measure("kernel: jax.lax.ragged_dot", f, (d["x"], *w, d["rw"], d["gs"], d["dy"]), 5, flops, reps=2,
            note=f"at {RAGGED_TOKENS} tokens ({d['x'].shape[0]} rows): it pads every group to all rows")
    measure("kernel: ours at the same size", lambda x, wg, wu, wd, rw, gs: moe_ffn(x, wg, wu, wd, gs, rw),
            (d["x"], *w, d["rw"], d["gs"], d["dy"]), 5, flops, note=f"at {RAGGED_TOKENS} tokens")


def decode(w):
    wg, wu, wd = w
    for tokens in (1, 8, 64):
        d = rows_inputs(tokens, seed=tokens)
        touched = int((d["gs"] > 0).sum())
        nbytes = touched * 3 * H * I * 2
        row = R["decode"][tokens] = dict(touched_experts=touched, weight_GB=nbytes / 1e9)
        kernel = jax.jit(functools.partial(moe_ffn_decode, max_group_rows=tokens))
        cases = {"kernel": (kernel, (d["x"], wg, wu, wd, d["gs"], d["rw"]))}
        x, ids = d["x"][:tokens], d["ids"]
        wts, swts = jnp.full((tokens, TOP_K), 0.1), jnp.full((tokens, SHARED), 0.2)
        routed, shared = (wg[:LOCAL], wu[:LOCAL], wd[:LOCAL]), (wg[LOCAL:], wu[LOCAL:], wd[LOCAL:])
        cases["layer_shared_einsum"] = (jax.jit(functools.partial(experts, backend=PALLAS)),
                                        (x, routed, shared, ids, wts, swts))
        cases["ragged_dot"] = (jax.jit(functools.partial(unfused_ffn, jax.lax.ragged_dot)),
                               (d["x"], wg, wu, wd, d["gs"], d["rw"]))
        for name, (f, args) in cases.items():
            iters = 10 if name == "ragged_dot" else 50
            # The mean over one loop of asynchronous calls (decode-sized work), after 2 warm-up calls.
            t = guarded(f"decode {tokens} {name}",
                        lambda: median_seconds(f, *args, trials=1, warmup=2, calls=iters))
            row[f"{name}_us"] = t and t * 1e6
            row[f"{name}_of_copy"] = t and nbytes / t / 1e9 / R["copy_GBps"]
        print(f"decode {tokens}", json.dumps(row), flush=True)


def _expert_bytes(gs, precision):
    """Bytes of the touched experts' weights: bf16 2 per value, fp8 1, NVFP4 a half plus an f16 scale per 16."""
    per_value = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 2 / 16}[precision]
    return int((gs > 0).sum()) * 3 * H * I * per_value


def _time_decode(name, f, args, nbytes, read, into):
    kernel = jax.jit(f)
    reps = dict(trials=1, warmup=1, calls=1) if DRY else dict(trials=5, warmup=2, calls=20)  # DRY: interpreted
    t = guarded(f"decode sweep {name}", lambda: median_seconds(lambda: kernel(**args), **reps))
    if t:
        into[name] = dict(us=t * 1e6, of_read=nbytes / t / 1e9 / read)
        print(f"  {name:45s} {t * 1e6:7.0f} us = {nbytes / t / 1e9:5.0f} GB/s = {nbytes / t / 1e9 / read:.2f} of read "
              "(of its own bytes)", flush=True)
    return t


# NVFP4 decode cases per step size: (tokens per slab, NVFP4 blocks per wgmma call), the defaults first. The
# others are the alternatives measured on the H200 (bench/results/moe.md): each case compiles for ~50 s there.
NVFP4_CASES = {8: ((16, 16),), 32: ((16, 16), (16, 1)), 128: ((32, 16), (32, 1), (128, 16))}


def nvfp4_slab_sweep(w, read, steps=tuple(NVFP4_CASES)):
    """The NVFP4 FFN (`moe_ffn_nvfp4`) at decode steps of `steps` tokens (of NVFP4_CASES), with the slab widths
    (the kernels' N) and wgmma grouping there, against the fp8 FFN on the same rows."""
    q4, q8 = quantize_nvfp4(*w), quantize_experts(*w)
    sweep = R["decode_sweep"] = {}
    for tokens in steps:
        d = rows_inputs(tokens, seed=tokens)
        args = dict(x=d["x"], group_sizes=d["gs"], row_weights=d["rw"])
        print(f"decode {tokens} tokens (largest group {int(d['gs'][:LOCAL].max())}): "
              f"{_expert_bytes(d['gs'], 'nvfp4') / 1e9:.2f} GB of NVFP4 weights", flush=True)
        fp8 = _time_decode(f"{tokens} fp8", functools.partial(moe_ffn_fp8, experts=q8, max_group_rows=tokens), args,
                           _expert_bytes(d["gs"], "fp8"), read, sweep)
        for slab, per_call in NVFP4_CASES[tokens]:
            name = f"{tokens} W4 slab {slab}, {per_call} blocks/wgmma"
            cfg = dataclasses.replace(config_for_w4(slab), blocks_per_wgmma=per_call)
            t = _time_decode(name, functools.partial(
                moe_ffn_nvfp4, experts=q4, max_group_rows=tokens, slab=slab, cfg=cfg), args,
                _expert_bytes(d["gs"], "nvfp4"), read, sweep)
            if t and fp8:
                sweep[name]["of_fp8_time"] = t / fp8
                print(f"  {'':45s} {t / fp8:.2f} of fp8's time", flush=True)


def decode_sweep(w, tokens=32, precision="bf16"):
    """Bytes/s of the MoE FFN at the serving engine's 32-row decode step (`moe_ffn_decode` or `moe_ffn_fp8`) for a
    few tiles per role (the other role at its default), against the read bandwidth (a jitted sum) measured here;
    NVFP4: `nvfp4_slab_sweep`."""
    read = R["read_GBps"] = read_bandwidth(CEIL_COPY, data="normal") / 1e9
    if precision == "nvfp4":
        steps = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--steps=")), None)
        return nvfp4_slab_sweep(w, read, *([tuple(int(t) for t in steps.split(","))] if steps else []))
    d = rows_inputs(tokens, seed=tokens)
    nbytes = _expert_bytes(d["gs"], precision)
    args = dict(x=d["x"], group_sizes=d["gs"], row_weights=d["rw"])
    dtype = jnp.float8_e4m3fn if precision == "fp8" else jnp.bfloat16
    base = {role: DECODE[role][jnp.dtype(dtype)] for role in ("swiglu", "gmm")}
    # (swiglu changes, gmm changes) from the decode defaults
    if precision == "fp8":
        variants = [({}, {}), ({}, dict(block_n=128, stages=8)), ({}, dict(block_n=128, block_k=256, stages=4)),
                    (dict(block_n=64, block_k=256, stages=4), {}), (dict(block_n=64, stages=8), {})]
        q = quantize_experts(*w)
        run = lambda cfgs: functools.partial(moe_ffn_fp8, experts=q, max_group_rows=tokens,  # noqa: E731
                                             configs=cfgs)
    else:
        variants = [({}, {}), (dict(block_n=64, stages=8), dict(block_n=128, stages=8)),  # the earlier defaults
                    (dict(stages=4), {}), (dict(block_k=128, stages=2), {}), ({}, dict(stages=5)),
                    ({}, dict(block_n=128, block_k=128, stages=4))]
        run = lambda cfgs: functools.partial(moe_ffn_decode, max_group_rows=tokens, configs=cfgs,  # noqa: E731
                                             w_gate=w[0], w_up=w[1], w_down=w[2])
    sweep = R["decode_sweep"] = {}
    print(f"read {read:.0f} GB/s; decode {tokens} tokens: {nbytes / 1e9:.2f} GB of expert weights ({precision})",
          flush=True)
    for sw, mm in variants:
        cfgs = KernelConfigs(decode=True, swiglu=dataclasses.replace(base["swiglu"], **sw),
                             gmm=dataclasses.replace(base["gmm"], **mm))
        _time_decode(f"swiglu {sw} gmm {mm}", run(cfgs), args, nbytes, read, sweep)


def quantized_vs_bf16(w):
    """fp8 (pallas_kernels/moe/fp8.py) and NVFP4 (nvfp4.py) routed experts against bf16 on the same rows: decode
    steps (bytes of the touched experts' weights per second against the read bandwidth) and the prefill forward
    (TFLOP/s); the relative L2 difference of the outputs from bf16's is the quantisation's error."""
    read = R["read_GBps"] = read_bandwidth(CEIL_COPY, data="normal") / 1e9
    q8, q4 = quantize_experts(*w), quantize_nvfp4(*w)
    table = R["quantized"] = {}
    for tokens in (1, 8, 32, 64, 128, TOKENS):
        d = rows_inputs(tokens, seed=tokens)
        args = (d["x"], d["gs"], d["rw"])
        bound = tokens if tokens <= 128 else None
        cases = {"bf16": (jax.jit(functools.partial(moe_ffn_decode, max_group_rows=tokens)
                                  if bound and tokens <= 64 else moe_ffn), lambda f: f(args[0], *w, *args[1:])),
                 "fp8": (jax.jit(functools.partial(moe_ffn_fp8, max_group_rows=bound)),
                         lambda f: f(args[0], q8, *args[1:])),
                 "nvfp4": (jax.jit(functools.partial(moe_ffn_nvfp4, max_group_rows=bound)),
                           lambda f: f(args[0], q4, *args[1:]))}
        row = table[tokens] = {}
        outs = {}
        for name, (f, call) in cases.items():
            outs[name] = guarded(f"{name} {tokens}", lambda: call(f))
            t = guarded(f"{name} {tokens} time", lambda: median_seconds(
                lambda: call(f), trials=5, warmup=2, calls=20 if bound else 3))
            if not t:
                continue
            row[name] = dict(us=t * 1e6, of_read=_expert_bytes(d["gs"], name) / t / 1e9 / read,
                             TFLOPs=6 * int(d["gs"].sum()) * H * I / t / 1e12)
        for name in ("fp8", "nvfp4"):
            if outs.get(name) is not None and outs.get("bf16") is not None:
                row[f"{name}_vs_bf16_rel_l2"] = rel(outs[name], outs["bf16"])
        print(f"quantized {tokens} tokens", json.dumps(row), flush=True)


def kernel_sweep(d, w):
    """Per-kernel TFLOP/s of ours at the prefill shape, for a few tile configurations, while time is left."""
    m = d["x"].shape[0]
    hmid = (0.5 * d["dy"][:, :I]).astype(jnp.bfloat16)
    swiglu = functools.partial(epilogues.swiglu, keep_preactivations=False)

    def gmm(transpose_rhs, pairs, epilogue):
        return lambda cfg: lambda lhs, weights, gs, rows: matmuls.gmm(
            lhs, weights, gs, transpose_rhs=transpose_rhs, pairs=pairs, epilogue=epilogue, num_outputs=1, cfg=cfg,
            interpret=False, row_inputs=rows)

    plain = ((0, 0, 0),)
    roles = {
        "swiglu": (2 * m * H * 2 * I, gmm(False, ((0, 0, 0), (0, 1, 1)), swiglu),
                   ([d["x"]], [w[0], w[1]], d["gs"], (d["rw"],)),
                   [GmmConfig(block_n=128), GmmConfig(block_n=128, grid_tile_width=16),
                    GmmConfig(block_n=128, stages=3)]),
        "down": (2 * m * I * H, gmm(False, plain, epilogues.plain), ([hmid], [w[2]], d["gs"], ()),
                 [GmmConfig(), GmmConfig(grid_tile_width=16), GmmConfig(block_n=128)]),
        "dgrad": (2 * m * H * I, gmm(True, plain, epilogues.plain), ([d["dy"]], [w[2]], d["gs"], ()),
                  [GmmConfig(), GmmConfig(grid_tile_width=16)]),
        "dx_pairs": (2 * m * 2 * I * H, gmm(True, ((0, 0, 0), (1, 1, 0)), epilogues.plain),
                     ([hmid, hmid], [w[0], w[1]], d["gs"], ()),
                     [GmmConfig(block_k=32), GmmConfig(block_k=32, grid_tile_width=16)]),
        "wgrad": (2 * m * H * I, lambda cfg: lambda x, dy, gs: matmuls.tgmm(x, dy, gs, cfg=cfg, interpret=False),
                  (d["x"], hmid, d["gs"]), [WgradConfig(), WgradConfig(grid_tile_width=8), WgradConfig(block_n=128)]),
    }
    sweep = R["kernels"] = {}
    for role, (flops, make, args, cfgs) in roles.items():
        for cfg in cfgs:
            if time.perf_counter() - START > SWEEP_UNTIL_S:
                R.setdefault("skipped", []).append(f"{role} {cfg}")
                continue
            t = guarded(f"{role} {cfg}", lambda: median_seconds(jax.jit(make(cfg)), *args, trials=5, warmup=2))
            if t:
                sweep.setdefault(role, []).append((flops / t / 1e12, repr(cfg)))
                print(f"  {role:9s} {flops / t / 1e12:6.1f} TFLOP/s  {cfg}", flush=True)


def summary():
    copy, peak = R.get("copy_GBps", float("nan")), R.get("matmul_TFLOPs", float("nan"))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = ["", f"device {R['device']}, jax {R['jax']}; copy {copy:.0f} GB/s; XLA bf16 matmul {peak:.0f} TFLOP/s; "
             f"prefill {TOKENS} tokens x (top-{TOP_K} + {SHARED} shared), H={H} I={I} bf16; "
             f"{time.perf_counter() - START:.0f} s",
             "| case | fwd ms | fwd TFLOP/s | /matmul | fwd+bwd ms | fwd+bwd TFLOP/s | /matmul | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in R["rows"].items():
        lines.append(f"| {name} | {fmt(r['fwd_ms'], '.2f')} | {fmt(r['fwd_TFLOPs'], '.1f')} | "
                     f"{fmt(r['fwd_TFLOPs'] and r['fwd_TFLOPs'] / peak, '.2f')} | {fmt(r['fwdbwd_ms'], '.2f')} | "
                     f"{fmt(r['fwdbwd_TFLOPs'], '.1f')} | "
                     f"{fmt(r['fwdbwd_TFLOPs'] and r['fwdbwd_TFLOPs'] / peak, '.2f')} "
                     f"| {r['note']} |")
    for tokens, r in R["decode"].items():
        cells = [f"{k[:-3]} {fmt(r.get(k), '.0f')} us = {fmt(r.get(k[:-3] + '_of_copy'), '.2f')} of copy"
                 for k in r if k.endswith("_us")]
        lines.append(f"| decode {tokens} tok: {r['touched_experts']} experts, {r['weight_GB']:.2f} GB | "
                     + " | ".join(cells) + " |")
    for role, v in R.get("kernels", {}).items():
        best = max(v)
        lines.append(f"| sweep {role}: best {best[0]:.1f} TFLOP/s | {best[1]} |")
    for k in ("rel_err_ours_vs_mgpu_peer", "errors", "skipped"):
        if k in R:
            lines.append(f"{k}: {R[k]}")
    print("\n".join(lines), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_bench.json"), "w") as f:
            json.dump(R, f, indent=1, default=str)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a `timeout` still gets the summary below
    try:
        ceilings()
        w = weights()
        if "--decode-sweep" in sys.argv:  # only the decode tiles (with --dry-run: tiny, on CPU)
            decode_sweep(w, precision=next((p for p in ("fp8", "nvfp4") if f"--{p}" in sys.argv), "bf16"))
            return
        if "--quantized" in sys.argv:
            quantized_vs_bf16(w)
            return
        d = prefill(w)
        decode(w)
        layer(w, d)
        ragged_peer(w)
        if not DRY:
            kernel_sweep(d, w)
    finally:
        summary()


if __name__ == "__main__":
    main()
