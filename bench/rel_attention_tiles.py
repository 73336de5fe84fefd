"""Tile variants of the relative flash attention's three kernels side by side on one GPU, with the peers.

For each layer (sliding first: its backward is the far-off target) and kernel (forward; dK/dV; dQ with its dP
reduction), times the kernel alone on the padded operands under each candidate tile shape (rows = tokens x group
heads, keys, warps, stages; the first candidate is the tuned one, pallas_kernels/rel_attention/tuning.py) and
compares every output with the first candidate's on the same inputs (relative L2, the largest over the kernel's
outputs). The Mosaic GPU (wgmma) forward, mgpu_forward.py, runs as forward candidate "mosaic" next to them (where
it covers the layer), checked against the tuned Triton forward. Then cuDNN (no bias) and FlexAttention + bias,
forward and backward, at the same shapes. A candidate that fails to compile, or whose tokens per tile exceed its
keys, is reported and skipped.

Run: PYTHONPATH=. python bench/rel_attention_tiles.py [--smoke] [--forward-only] [--bias-cost]
     ($OUT/rel_attention_tiles.json if $OUT is set; --forward-only: the tuned Triton forward, Mosaic, the peers;
     --bias-cost: the tuned backward kernels with and without the relative bias)
"""

import argparse
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.rel_attention_peers import cudnn, flex
from bench.rel_attention_setup import (LAYERS, RESULTS, START, TIMING, Layer, guarded, log, prepared, rooflines,
                                       save, time_ms)
from pallas_kernels.rel_attention import backward, forward, mgpu_dkdv, mgpu_dq, mgpu_forward, tiles, tuning

KERNELS = ("forward", "dkdv", "dq")
# Other tiles (rows, keys, warps, stages) of the Triton dQ's bias part in the split dQ (full layer): multiples of
# the Mosaic dQ's 16 tokens and 64 keys, so that the two parts still meet at a tile boundary. On the H200
# (2026-11-30) they took 3.09 and 6.35 ms against the tuned 128/64/8/2's 3.16 ms; 128/128/8/2 needs 276 KB of
# shared memory (227 KB available).
DQ_BIAS_CANDIDATES = ((128, 64, 8, 3), (128, 64, 4, 2))
# FLOPs of each kernel in units of the layer's forward FLOPs (the backward kernels recompute q k^T): dK/dV runs
# four matmuls of the forward's size, dQ three.
FLOP_FACTOR = {"forward": 1.0, "dkdv": 2.0, "dq": 1.5}
# (forward, dK/dV, dQ) candidates as (rows, keys, warps, stages), the tuned shape first, then its neighbours and
# the shapes tuning.py used before this sweep chose the current ones (the sliding layer's programs meet ~9 key
# tiles each, so smaller rows win there).
CANDIDATES = {
    "sliding": ((tuning.SLIDING[0], (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 3)),
                (tuning.SLIDING[1], (64, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)),
                (tuning.SLIDING[2], (64, 64, 4, 2), (32, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2))),
    "full": ((tuning.FULL[0],),
             (tuning.FULL[1], (64, 64, 4, 2), (128, 64, 8, 2)),
             (tuning.FULL[2], (64, 64, 4, 2))),
}
OUTPUTS = {"forward": ("out", "lse"), "dkdv": ("dk", "dv"), "dq": ("dq", "dr", "dP")}
FLEX_START_LIMIT_S = float(os.environ.get("FLEX_START_LIMIT_S", 95))  # Flex compiles fwd + bwd for tens of s
SMOKE_LAYERS = {"sliding": Layer(kv_heads=2, extent=64, window=64, tokens=192, heads=8, dim=16, d_rel=4),
                "full": Layer(kv_heads=1, extent=96, window=None, tokens=192, heads=8, dim=16, d_rel=4)}


def _errors(kernel, outputs, want):
    """Per output of `kernel`: relative L2 error and max error over max |want| of outputs against want."""
    pairs = [(o, x.astype(jnp.float32), y.astype(jnp.float32)) for o, x, y in zip(OUTPUTS[kernel], outputs, want)]
    return {"rel_err_vs_first": {o: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y)) for o, x, y in pairs},
            "max_err_over_max": {o: float(jnp.abs(x - y).max() / jnp.abs(y).max()) for o, x, y in pairs}}


def sweep(name, layer, candidates, interpret=None):
    """Times each kernel alone under its candidates ((forward, dK/dV, dQ) tuples of shapes, the first of each the
    reference of the checks), in RESULTS['sweep'][name][kernel]; returns the fastest shape per kernel (None where
    none ran)."""
    shapes = {kernel: [s for s in shapes if _fits(name, kernel, s, layer.groups)]
              for kernel, shapes in zip(KERNELS, candidates)}
    tuned = tuning.blocks(layer.groups, layer.dim, layer.window)
    extra = [tuning.as_blocks(s, layer.groups) for kernel in KERNELS for s in shapes[kernel]]
    geos, args, ct = prepared(layer, tuned + tuple(extra), interpret)  # one padding, fitting every candidate
    geo_of = {g.blocks: g for g in geos}
    out, lse = jax.jit(lambda *a: forward.forward(geos[0], *a))(*args)
    residuals = backward.residual_args(*args, out, lse, ct)
    operands = {"forward": args, "dkdv": residuals, "dq": residuals}
    calls = {"forward": forward.forward, "dkdv": backward.dkdv, "dq": backward.dq}
    best = []
    for kernel in KERNELS:
        found = RESULTS.setdefault("sweep", {}).setdefault(name, {}).setdefault(kernel, {})
        first = None
        for shape in shapes[kernel]:
            geo = geo_of[tuning.as_blocks(shape, layer.groups)]
            fn = jax.jit(lambda *x, geo=geo, call=calls[kernel]: call(geo, *x))
            try:
                outputs = fn(*operands[kernel])
                ms = time_ms(fn, *operands[kernel])
            except Exception as e:  # a shape the compiler refuses: report it and go on
                log(f"[{name}] {kernel} {shape}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            first = first or outputs
            entry = {"ms": ms, "tflops": FLOP_FACTOR[kernel] * layer.flops() / ms / 1e9,
                     **_errors(kernel, outputs, first)}
            found[str(shape)] = entry
            log(f"[{name}] {kernel} {shape}: {entry}")
            save("rel_attention_tiles.json")
        best.append(min(found, key=lambda s: found[s]["ms"]) if found else None)
    return best


def mosaic(name, layer, interpret=None):
    """The Mosaic GPU forward alone, as forward candidate "mosaic", checked against the tuned Triton forward on the
    same inputs (relative L2 of out and lse)."""
    tuned = tuning.blocks(layer.groups, layer.dim, layer.window)
    geos, args, _ = prepared(layer, (tuning.mosaic_forward(layer.groups),) + tuned, interpret)
    if not mgpu_forward.supports(geos[0], args[0].dtype):
        log(f"[{name}] forward mosaic: not covered ({geos[0].blocks}, head_dim {layer.dim}; see mgpu_forward.py)")
        return
    fn = jax.jit(lambda *a: mgpu_forward.forward(geos[0], *a))
    want = jax.jit(lambda *a: forward.forward(geos[1], *a))(*args)
    outputs = fn(*args)
    ms = time_ms(fn, *args)
    entry = {"ms": ms, "tflops": layer.flops() / ms / 1e9, **_errors("forward", outputs, want)}
    RESULTS.setdefault("sweep", {}).setdefault(name, {}).setdefault("forward", {})["mosaic"] = entry
    log(f"[{name}] forward mosaic: {entry}")
    save("rel_attention_tiles.json")


def mosaic_dkdv(name, layer):
    """The Mosaic GPU dK/dV kernel (mgpu_dkdv.py, its operand preparation included) and the tuned Triton dK/dV, each
    alone on the same residuals, as dkdv candidates "mosaic" and "triton (tuned)"; errors against the Triton one."""
    tuned = tuning.blocks(layer.groups, layer.dim, layer.window)
    geos, args, ct = prepared(layer, (mgpu_dkdv.tile(layer.groups),) + tuned)
    log(f"[{name}] dkdv mosaic: {geos[0].blocks}, buffers {mgpu_dkdv.buffers(geos[0])}, operands "
        f"{[(tuple(a.shape), str(a.dtype)) for a in args]}")
    out, lse = jax.jit(lambda *a: forward.forward(geos[1], *a))(*args)
    residuals = backward.residual_args(*args, out, lse, ct)
    found = RESULTS.setdefault("sweep", {}).setdefault(name, {}).setdefault("dkdv", {})
    want = None
    for label, fn in (("triton (tuned)", lambda *a: backward.dkdv(geos[2], *a)),
                      ("mosaic", lambda *a: mgpu_dkdv.dkdv(geos[0], *a))):
        fn = jax.jit(fn)
        outputs = fn(*residuals)
        want = want or outputs
        ms = time_ms(fn, *residuals)
        found[label] = {"ms": ms, "tflops": FLOP_FACTOR["dkdv"] * layer.flops() / ms / 1e9,
                        **_errors("dkdv", outputs, want)}
        log(f"[{name}] dkdv {label}: {found[label]}")
        save("rel_attention_tiles.json")


def mosaic_dq(name, layer):
    """The split dQ (mgpu_dq.dq_split: the Mosaic GPU dQ of the key tiles without bias, then the Triton dQ of the
    tiles with bias, dr and dP, adding it) and the tuned Triton dQ, each alone on the same residuals, as dq
    candidates "mosaic split" and "triton (tuned)"; errors against the Triton one. Its two parts alone go to
    RESULTS['sweep'][name]['dq parts'], their TFLOP/s over their own share of the (query, key) pairs, and so do
    the Triton bias part's other candidate tiles (DQ_BIAS_CANDIDATES)."""
    tuned = tuning.blocks(layer.groups, layer.dim, layer.window)
    others = tuple(tuning.as_blocks(c, layer.groups) for c in DQ_BIAS_CANDIDATES)
    geos, args, ct = prepared(layer, (tuned[0], tuned[2], tuning.mosaic_forward(layer.groups)) + others)
    geo_triton, geo_mosaic = geos[1], geos[2]
    if not mgpu_dq.supports(geo_mosaic, args[0].dtype):
        log(f"[{name}] dq mosaic: not covered ({geo_mosaic.blocks}, window {layer.window}): the Triton dQ alone")
        return
    tq, bk = geo_triton.blocks.block_q, geo_triton.blocks.block_k
    near = np.asarray(tiles.key_block_ranges(geo_triton, (np.arange(layer.tokens) // tq) * tq)[1])
    plain_share = float(near.sum()) * bk * 4 * layer.batch * layer.heads * layer.dim / layer.flops()
    log(f"[{name}] dq mosaic: {geo_mosaic.blocks}, {mgpu_dq.slots(geo_mosaic)} slots; bias tiles of "
        f"{geo_triton.blocks}; {100 * plain_share:.1f}% of the pairs in tiles without bias; operands "
        f"{[(tuple(a.shape), str(a.dtype)) for a in args]}")
    out, lse = jax.jit(lambda *a: forward.forward(geos[0], *a))(*args)
    residuals = backward.residual_args(*args, out, lse, ct)
    plain = jax.jit(lambda *a: mgpu_dq.dq_plain(geo_mosaic, *a, split=geo_triton))
    found = RESULTS.setdefault("sweep", {}).setdefault(name, {})
    bias_parts = [("triton bias part", geo_triton)] + [
        (f"triton bias part {shape}", geo) for shape, geo in zip(DQ_BIAS_CANDIDATES, geos[3:])]
    want = None
    for label, fn, operands, share in (
            ("triton (tuned)", lambda *a: backward.dq(geo_triton, *a), residuals, 1.0),
            ("mosaic split", lambda *a: mgpu_dq.dq_split(geo_triton, geo_mosaic, *a), residuals, 1.0),
            ("mosaic plain part", plain, residuals, plain_share),
            *((label, functools.partial(_bias_part, geo),
               (*residuals, mgpu_dq.dq_plain(geo_mosaic, *residuals, split=geo)), 1 - plain_share)
              for label, geo in bias_parts)):
        fn = jax.jit(fn)
        outputs = fn(*operands)
        want = want or outputs
        ms = time_ms(fn, *operands)
        entry = {"ms": ms, "tflops": share * FLOP_FACTOR["dq"] * layer.flops() / ms / 1e9}
        if isinstance(outputs, tuple):  # all but the plain part: (dq, dr, dP) as the Triton dQ's
            entry.update(_errors("dq", outputs, want))
        found.setdefault("dq" if share == 1.0 else "dq parts", {})[label] = entry
        log(f"[{name}] dq {label}: {entry}")
        save("rel_attention_tiles.json")


def bias_cost(name, layer, interpret=None):
    """The tuned Triton dK/dV and dQ, each alone, at the layer's extent and again with no relative bias (extent 0:
    every tile plain, no shear, dr or dP), the inputs otherwise the same: what the bias costs each backward
    kernel. In RESULTS['bias cost'][name][kernel] as {"bias": ms, "no bias": ms}; returns the summary lines."""
    found = RESULTS.setdefault("bias cost", {}).setdefault(name, {})
    for label, variant in (("bias", layer), ("no bias", dataclasses.replace(layer, extent=0))):
        tuned = tuning.blocks(variant.groups, variant.dim, variant.window)
        geos, args, ct = prepared(variant, tuned, interpret)
        out, lse = jax.jit(lambda *a: forward.forward(geos[0], *a))(*args)
        residuals = backward.residual_args(*args, out, lse, ct)
        for kernel, call, geo in (("dkdv", backward.dkdv, geos[1]), ("dq", backward.dq, geos[2])):
            fn = jax.jit(lambda *x, call=call, geo=geo: call(geo, *x))
            found.setdefault(kernel, {})[label] = time_ms(fn, *residuals)
            log(f"[{name}] {kernel} {label}: {found[kernel][label]:.3f} ms")
            save("rel_attention_tiles.json")
    return [f"{name:8} {kernel:5} {x['bias']:.3f} ms with bias, {x['no bias']:.3f} ms without: the bias is "
            f"{100 * (1 - x['no bias'] / x['bias']):.0f}% of the kernel" for kernel, x in found.items()]


def _bias_part(geo_triton, *operands):
    """The Triton dQ of geo_triton's tiles with bias, adding the Mosaic dQ of the other tiles (the last operand,
    split at geo_triton's tiles)."""
    return backward.dq(geo_triton, *operands[:-1], dq_plain=operands[-1])


def _fits(name, kernel, shape, groups):
    blocks = tuning.as_blocks(shape, groups)
    if blocks.block_q > blocks.block_k:
        log(f"[{name}] {kernel} {shape}: skipped, {blocks.block_q} tokens per tile exceed {blocks.block_k} keys")
    return blocks.block_q <= blocks.block_k


def table(layers):
    mm = RESULTS.get("matmul_tflops") or float("nan")
    lines = [f"device {RESULTS.get('device')}, jax {RESULTS['jax']}, torch {RESULTS.get('torch')}; "
             f"matmul {mm:.0f} TFLOP/s, copy {RESULTS.get('copy_gbs') or 0:.0f} GB/s; TFLOP/s count the backward's "
             f"recomputation (dK/dV 2x, dQ 1.5x the forward's FLOPs)",
             f"{'layer':8} {'kernel':8} {'rows/keys/warps/stages':24} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5} "
             f"{'max rel err vs first':>20}"]
    for name, layer in layers.items():
        found = RESULTS.get("sweep", {}).get(name, {})
        for kernel in KERNELS:
            for shape, x in found.get(kernel, {}).items():
                err = max(x["rel_err_vs_first"].values())
                lines.append(f"{name:8} {kernel:8} {shape:24} {x['ms']:8.3f} {x['tflops']:8.1f} "
                             f"{100 * x['tflops'] / mm:5.1f} {err:20.1e}")
        lines += [f"{name:8} {line}" for line in _versus_peers(name, found)]
    return "\n".join(lines)


def _versus_peers(name, found):
    """Tuned and best forward / backward (dK/dV + dQ, delta's row sums not counted) against the peers; the
    forward alone when the backward was not run (--forward-only)."""
    kernels = [k for k in KERNELS if found.get(k)]
    if "forward" not in kernels:
        return []
    tuned = {k: next(iter(found[k].values()))["ms"] for k in kernels}
    best = {k: min(x["ms"] for x in found[k].values()) for k in kernels}
    ours = {"fwd": (tuned["forward"], best["forward"])}
    if "dkdv" in kernels and "dq" in kernels:
        ours["bwd"] = (tuned["dkdv"] + tuned["dq"], best["dkdv"] + best["dq"])
    lines = [f"ours {part}: tuned {t:.3f} ms, best {b:.3f} ms" for part, (t, b) in ours.items()]
    for peer in ("flex + bias", "cudnn (no bias)"):
        x = RESULTS.get(name, {}).get(peer)
        if not x:
            continue
        times = {"fwd": x["fwd_ms"], "bwd": x["fwd_bwd_ms"] and x["fwd_bwd_ms"] - x["fwd_ms"]}
        lines += [f"{peer} {part} {times[part]:.3f} ms: tuned {times[part] / t:.2f}x, best {times[part] / b:.2f}x "
                  f"(speed ratio, >1 = ours faster)" for part, (t, b) in ours.items() if times[part]]
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny layers, two candidates per kernel, on CPU")
    parser.add_argument("--forward-only", action="store_true", help="tuned Triton forward, Mosaic forward, peers")
    parser.add_argument("--mosaic-dkdv", action="store_true", help="the Mosaic and tuned Triton dK/dV only")
    parser.add_argument("--mosaic-dq", action="store_true", help="the split (Mosaic + Triton) and tuned Triton dQ only")
    parser.add_argument("--bias-cost", action="store_true", help="the tuned Triton dK/dV and dQ with and without bias")
    flags = parser.parse_args()
    smoke = flags.smoke
    layers = SMOKE_LAYERS if smoke else {name: LAYERS[name] for name in CANDIDATES}
    if smoke:
        TIMING.update(reps=1, rounds=1)
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    rooflines(*((128, 1 << 16) if smoke else ()))
    if flags.bias_cost:
        for name, layer in layers.items():
            guarded(f"[{name}] bias cost", lambda: print("\n".join(bias_cost(name, layer)), flush=True))
        return
    if flags.mosaic_dq:
        for name, layer in LAYERS.items():
            guarded(f"[{name}] dq mosaic", lambda: mosaic_dq(name, layer))
        print(table(LAYERS), flush=True)
        return
    if flags.mosaic_dkdv:
        for name, layer in LAYERS.items():
            guarded(f"[{name}] dkdv mosaic", lambda: mosaic_dkdv(name, layer))
        print(table(LAYERS), flush=True)
        return
    for name, layer in layers.items():
        candidates = tuple(c[:2] for c in CANDIDATES[name]) if smoke else CANDIDATES[name]
        if flags.forward_only:
            candidates = (candidates[0][:1], (), ())
        guarded(f"[{name}] sweep", lambda: sweep(name, layer, candidates))
        if not smoke:  # on CPU the Mosaic kernel needs its interpreter (minutes)
            guarded(f"[{name}] mosaic", lambda: mosaic(name, layer))
        print(table(layers), flush=True)
    for name, layer in layers.items():
        guarded(f"[{name}] cudnn", lambda: RESULTS.setdefault(name, {}).__setitem__(
            "cudnn (no bias)", cudnn(layer, None if smoke else "cudnn", backward=not flags.forward_only)))
        save("rel_attention_tiles.json")
    print(table(layers), flush=True)
    for name, layer in layers.items():
        if not smoke and time.time() - START > FLEX_START_LIMIT_S:
            log(f"[{name}] flex skipped: out of time")
            continue
        guarded(f"[{name}] flex", lambda: RESULTS.setdefault(name, {}).__setitem__(
            "flex + bias", flex(layer, backward=not flags.forward_only)))
        log(f"[{name}] flex", RESULTS[name].get("flex + bias"))
        save("rel_attention_tiles.json")
        print(table(layers), flush=True)


if __name__ == "__main__":
    main()
