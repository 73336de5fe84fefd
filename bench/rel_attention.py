"""Relative flash attention on one GPU at Inkling's shapes, against its peers measured in the same run.

Layers: batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16, bf16; full (8 KV heads, E 1024, causal) and
sliding (16 KV heads, window 512 = E). Peers: torch FlexAttention with the same bias as a score_mod (as in
shared/peers/inkling_peers.py) and cuDNN plain attention through jax.nn.dot_product_attention (no bias, same mask).
Ceiling: a measured XLA bf16 matmul (and a copy, for the record). FLOPs: 4 * B * Hq * D per visible (query, key)
pair (causal / windowed pairs only; bias FLOPs not counted); forward + backward counts 3.5x the forward.
Also checks the tuned kernels against the jnp reference on the device (1536 tokens, 16 query heads).

Run: PYTHONPATH=. python bench/rel_attention.py   (writes $OUT/rel_attention.json when $OUT is set)
The functions take a `Layer` so that bench/kernels.py can reuse them (also at tiny shapes on CPU); shapes, inputs
and timing are in rel_attention_setup.py, the peers in rel_attention_peers.py; rel_attention_tiles.py times
each kernel alone under tile variants.
"""

import dataclasses
import os
import time

import jax
import jax.numpy as jnp

from bench.rel_attention_peers import cudnn, flex
# Layer and TIMING are bench/kernels.py's, through this module.
from bench.rel_attention_setup import (LAYERS, RESULTS, START, TIMING, Layer, guarded, inputs, log,  # noqa: F401
                                       prepared, rooflines, save, time_ms)
from pallas_kernels.rel_attention import kernel, rel_attention

FLEX_START_LIMIT_S = float(os.environ.get("FLEX_START_LIMIT_S", 220))  # FlexAttention compiles slowly
CHECK_START_LIMIT_S = float(os.environ.get("CHECK_START_LIMIT_S", 260))
CHECK_TOKENS = 1536  # long enough for tiles beyond E = 1024


def check_on_device(name, layer):
    """Tuned kernels vs the reference (fp32 on the same bf16 inputs) at the layer's group size, extent and
    window, but 1536 tokens and 16 query heads (the reference materialises [H, T, T]): relative L2 errors."""
    small = dataclasses.replace(layer, tokens=CHECK_TOKENS, heads=16, kv_heads=16 // layer.groups)
    (q, k, v, r, p), tau, ct = inputs(small, seed=3)
    pos = jnp.broadcast_to(jnp.arange(small.tokens), (small.batch, small.tokens))
    geos, args, ct = prepared(small, interpret=False, seed=3)
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


def ours(layer, blocks=None, interpret=None):
    """Our kernels' forward and forward+backward times (ms) at the layer's shape."""
    geos, args, ct = prepared(layer, blocks, interpret)
    fwd = jax.jit(lambda *a: kernel.padded_attention(geos, *a))
    fwd_bwd = jax.jit(lambda *a: jax.vjp(lambda *x: kernel.padded_attention(geos, *x, *a[5:]), *a[:5])[1](ct))
    return {"fwd_ms": time_ms(fwd, *args), "fwd_bwd_ms": time_ms(fwd_bwd, *args),
            "blocks": [str(g.blocks) for g in geos if g is not None]}


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


def main():
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    rooflines()
    for name, layer in LAYERS.items():
        RESULTS[name] = {}
        guarded(f"[{name}] ours", lambda: RESULTS[name].__setitem__("ours", ours(layer, interpret=False)))
        guarded(f"[{name}] cudnn", lambda: RESULTS[name].__setitem__("cudnn (no bias)", cudnn(layer)))
        log(f"[{name}]", RESULTS[name])
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
        guarded(f"[{name}] check", lambda: check_on_device(name, layer))
        save()


if __name__ == "__main__":
    main()
