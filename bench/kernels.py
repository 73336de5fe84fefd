"""Issue 5's kernel targets in one table: each kernel at Inkling's shapes against its peer or ceiling, measured in
the same run, with the target, the measured ratio and whether it is met.

    PYTHONPATH=. python bench/kernels.py [--out DIR] [--smoke]

Rows (bf16; batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16 unless said):
- relative attention, full (8 KV heads, E 1024) and sliding (16 KV heads, window 512) layers: forward vs torch
  FlexAttention with the same bias as a score_mod (>= 5x), forward TFLOP/s vs cuDNN plain causal attention
  through `jax.nn.dot_product_attention` (>= 0.75), backward vs Flex's backward (>= 3x);
- decode attention at batch 64: paged (context 8192) KV TB/s (>= 3.5), and the sliding ring, for the record;
- ShortConv prefill GB/s vs a jitted y = 2x over the same bytes (>= 0.85);
- the fused decode prologue at 64 tokens vs the unfused jitted jnp sequence (>= 2x), both layer kinds.
The table uses the tuned tiles; the tile sweeps are the kernels' own scripts (`bench/shortconv.py
--prefill-sweep`, `bench/rel_attention_tiles.py`).
The timing of each kind is that of its own benchmark (bench/rel_attention.py, decode_attention_cases.py,
shortconv.py), whose functions this script calls; the ceilings are bench/ceilings.py's. FlexAttention runs
first, in a child process, so torch and JAX never share the GPU's memory. --smoke runs tiny shapes (interpret
mode on CPU, eager Flex, whose CPU backward does not exist) to check the plumbing; its numbers mean nothing.
Writes kernels.json and kernels.md into --out (default $OUT) when given.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")  # torch has finished before JAX starts

import jax  # noqa: E402

from bench import decode_attention_cases as dec  # noqa: E402
from bench import rel_attention as rel  # noqa: E402
from bench import shortconv as sc  # noqa: E402
from bench.ceilings import copy_bandwidth, matmul_flops  # noqa: E402
from pallas_kernels.attn_prologue import attn_prologue  # noqa: E402
from pallas_kernels.attn_prologue import reference as prologue_reference  # noqa: E402
from pallas_kernels.shortconv import shortconv_prefill  # noqa: E402

TORCH_TIMEOUT_S = 180  # FlexAttention compiles its forward and backward for two layers
START = time.time()


@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: dict  # name -> rel.Layer
    paged: dec.CacheShape
    ring: dec.CacheShape
    decode_batch: int
    prefill: tuple  # [B, T, C] shapes
    prologue: dict  # name -> (tokens, Hq, Hkv, tau)
    head_dim: int
    matmul_n: int = 8192
    copy_elems: int = 512 * 1024 * 1024
    prologue_slots: tuple = (sc.POOL_SLOTS, sc.CACHE_SLOTS)
    reps: int = 10  # dependent calls per timed ShortConv / prologue chain


INKLING = Shapes(layers=rel.LAYERS, paged=dec.PAGED, ring=dec.RING, decode_batch=64,
                 prefill=((1, 8192, 6144), (1, 8192, 2048)),
                 prologue={"global": (64, 64, 8, True), "local": (64, 64, 16, False)}, head_dim=128)
_TINY = dict(batch=1, tokens=192, heads=4, dim=16, d_rel=4)  # 3 key tiles of 64
SMOKE = Shapes(layers={"full": rel.Layer(kv_heads=2, extent=96, window=None, **_TINY),
                       "sliding": rel.Layer(kv_heads=2, extent=64, window=64, **_TINY)},
               paged=dec.CacheShape(kv_heads=2, context=64, extent=32, heads=4, dim=16, d_rel=4, page=16),
               ring=dec.CacheShape(kv_heads=2, context=32, extent=32, heads=4, dim=16, d_rel=4), decode_batch=2,
               prefill=((1, 40, 96),), prologue={"global": (3, 4, 2, True), "local": (3, 4, 2, False)},
               head_dim=16, matmul_n=128, copy_elems=1 << 16, prologue_slots=(8, 24), reps=2)


def log(*parts):
    print(f"[{time.time() - START:6.1f}s]", *parts, flush=True)


def torch_child(shapes):
    """Child process: FlexAttention fwd and fwd+bwd for each layer, one JSON line per layer as it finishes."""
    for name, layer in shapes.layers.items():
        print("FLEX_JSON", json.dumps({name: rel.flex(layer), "torch": rel.RESULTS.get("torch")}), flush=True)


def run_torch_child(smoke):
    """Flex results by layer name; whatever finished before a timeout or failure is kept."""
    command = [sys.executable, os.path.abspath(__file__), "--torch-child"] + (["--smoke"] if smoke else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TORCH_TIMEOUT_S)
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        decode = lambda b: b.decode() if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr = decode(e.stdout), decode(e.stderr) + f"\ntimed out after {TORCH_TIMEOUT_S} s"
    found = {}
    for line in stdout.splitlines():
        if line.startswith("FLEX_JSON "):
            found.update(json.loads(line[len("FLEX_JSON "):]))
    if not all(name in found for name in shapes_of(smoke).layers):
        log("torch child:", "\n".join(stderr.strip().splitlines()[-8:]))
    return found


def shapes_of(smoke):
    return SMOKE if smoke else INKLING


def attempt(label, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one failure must not cost the rest of the run
        log(f"{label} FAILED {type(e).__name__}: {str(e).strip()[:500]}")
        traceback.print_exc(file=sys.stderr)
        return None
    finally:
        gc.collect()


def row(item, shape, ours, peer, target, measured):
    """One table row: `measured` and `target` are ratios (higher is better); None when not measured."""
    met = None if measured is None or target is None else measured >= target
    return dict(item=item, shape=shape, ours=ours, peer=peer, target=target, measured=measured, met=met)


def attention_rows(shapes, flex, results, smoke):
    rows = []
    for name, layer in shapes.layers.items():
        ours = attempt(f"[{name}] ours", lambda: rel.ours(layer))
        cudnn = attempt(f"[{name}] cudnn", lambda: rel.cudnn(layer, None if smoke else "cudnn"))
        peer = flex.get(name)
        results[f"attention {name}"] = dict(ours=ours, cudnn=cudnn, flex=peer, tflop=layer.flops() / 1e12)
        log(f"[{name}]", results[f"attention {name}"])
        shape = f"T={layer.tokens} Hkv={layer.kv_heads} E={layer.extent} W={layer.window}"
        ratio = lambda a, b, key: b[key] / a[key] if a and b else None  # noqa: E731
        bwd = lambda x: x and x["fwd_bwd_ms"] and {"ms": x["fwd_bwd_ms"] - x["fwd_ms"]}  # noqa: E731
        ms = lambda x, key="fwd_ms": f"{x[key]:.3f} ms" if x else "-"  # noqa: E731
        rows.append(row(f"rel. attention fwd, {name}: vs Flex + bias", shape, ms(ours), ms(peer), 5.0,
                        ratio(ours, peer, "fwd_ms")))
        rows.append(row(f"rel. attention fwd, {name}: TFLOP/s vs cuDNN, no bias", shape, ms(ours), ms(cudnn),
                        0.75, ratio(ours, cudnn, "fwd_ms")))
        rows.append(row(f"rel. attention bwd, {name}: vs Flex + bias bwd", shape, ms(bwd(ours), "ms"),
                        ms(bwd(peer), "ms"), 3.0, ratio(bwd(ours), bwd(peer), "ms")))
        rows.append(row(f"rel. attention bwd, {name}: vs cuDNN no-bias bwd (for the record)", shape,
                        ms(bwd(ours), "ms"), ms(bwd(cudnn), "ms"), None, ratio(bwd(ours), bwd(cudnn), "ms")))
    return rows


def decode_rows(shapes, results, smoke):
    batch, copies = shapes.decode_batch, (lambda n: 1) if smoke else dec.copies_for
    rows = []
    for name, shape, target in (("paged", shapes.paged, 3.5), ("ring", shapes.ring, None)):
        nbytes = shape.kv_bytes(batch)
        if name == "paged":
            sets = dec.paged_inputs(jax.random.key(batch), batch, shuffle=True, copies=copies(nbytes), shape=shape)
            fn = dec.paged_fn()
        else:
            sets = dec.ring_inputs(batch, copies(nbytes), shape)
            fn = dec.ring_fn(shape=shape)
        ours = attempt(f"decode {name}", lambda: dec.timed_ms(fn, sets))
        q, k, v = sets[0][:3]
        dense = (batch, shape.context, shape.kv_heads, shape.dim)
        cudnn = attempt(f"decode {name} cudnn", lambda: dec.cudnn_decode_ms(
            q, k.reshape(dense), v.reshape(dense), None if smoke else "cudnn"))
        results[f"decode {name}"] = dict(ms=ours, cudnn_ms=cudnn, kv_bytes=nbytes)
        log(f"decode {name}", results[f"decode {name}"])
        tbs = lambda ms: nbytes / ms / 1e9 if ms else None  # noqa: E731
        shown = lambda ms: f"{ms:.3f} ms, {tbs(ms):.2f} TB/s" if ms else "-"  # noqa: E731
        rows.append(row(f"decode attention, {name}: KV TB/s" + (" (for the record)" if target is None else ""),
                        f"B={batch} keys={shape.context} Hkv={shape.kv_heads}", shown(ours),
                        "cuDNN no bias " + shown(cudnn), target, tbs(ours)))
    return rows


def shortconv_rows(shapes, results):
    rows = []
    for shape in shapes.prefill:
        x, w, moved = sc.prefill_inputs(shape)
        measure = sc.prefill_measure(x, w, shapes.reps)
        scale = attempt("y = 2x", lambda: sc.scale_seconds(x, shapes.reps))
        name = "x".join(map(str, shape))
        found = {"y = 2x": scale}
        best = attempt("prefill", lambda: sc.best_of(
            [None], lambda b: measure(lambda x, w: shortconv_prefill(x, w, blocks=b)), log, f"prefill {name}"))
        found["kernel"] = best and best[0]
        ratio = best and scale and (moved / best[0]) / (2 * x.size * 2 / scale)
        us = f"{best[0] * 1e6:.1f} us {moved / best[0] / 1e9:.0f} GB/s" if best else "-"
        base = f"y=2x {scale * 1e6:.1f} us {2 * x.size * 2 / scale / 1e9:.0f} GB/s" if scale else "-"
        rows.append(row("ShortConv prefill: GB/s vs y = 2x", name, us, base, 0.85, ratio))
        results[f"shortconv prefill {name}"] = dict(seconds=found, moved=moved)
        log(f"shortconv prefill {name}", found)
    return rows


def prologue_rows(shapes, results):
    rows = []
    for layer, (tokens, heads, kv_heads, with_tau) in shapes.prologue.items():
        consts, state, _ = sc.prologue_inputs(tokens, heads, kv_heads, with_tau, shapes.head_dim,
                                              *shapes.prologue_slots)
        measure = sc.prologue_measure(consts, state, tokens, shapes.reps)
        ours = attempt(f"prologue {layer}", lambda: measure(attn_prologue))
        unfused = attempt(f"prologue {layer} jnp", lambda: measure(prologue_reference.attn_prologue))
        results[f"prologue {layer}"] = dict(seconds=ours, jnp_seconds=unfused)
        us = lambda s: f"{s * 1e6:.1f} us" if s else "-"  # noqa: E731
        rows.append(row(f"fused decode prologue, {layer}: vs unfused jnp", f"N={tokens} Hq={heads} Hkv={kv_heads}",
                        us(ours), us(unfused), 2.0, ours and unfused and unfused / ours))
    return rows


def table(rows, header):
    lines = header + ["", "| item | shape | ours | peer / ceiling | target | measured | met |",
                      "|---|---|---|---|---:|---:|---|"]
    for r in rows:
        target = "-" if r["target"] is None else f"{r['target']:g}"
        measured = "-" if r["measured"] is None else f"{r['measured']:.2f}"
        met = {True: "met", False: "**missed**", None: "-"}[r["met"]]
        lines.append(f"| {r['item']} | {r['shape']} | {r['ours']} | {r['peer']} | {target} | {measured} | {met} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the plumbing on CPU")
    parser.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = shapes_of(args.smoke)
    if args.smoke:
        rel.TIMING.update(reps=1, rounds=1)
    if args.torch_child:
        return torch_child(shapes)

    flex = run_torch_child(args.smoke)  # before JAX touches the GPU
    log("flex", flex)
    results = {"date": str(datetime.date.today()), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "torch": flex.get("torch"), "smoke": args.smoke}
    results["matmul_tflops"] = attempt("matmul ceiling", lambda: matmul_flops(shapes.matmul_n, data="normal") / 1e12)
    results["copy_gbs"] = attempt("copy ceiling", lambda: copy_bandwidth(shapes.copy_elems, data="normal") / 1e9)
    rows = results["rows"] = []

    def emit():  # after every section, so that a run cut short still leaves the rows it measured
        header = [f"{results['date']} {results['device']}, jax {results['jax']}, torch {results['torch']}"
                  f"{' (SMOKE: tiny shapes, numbers meaningless)' if args.smoke else ''}",
                  f"ceilings measured in this run: XLA bf16 matmul {results['matmul_tflops'] or 0:.0f} TFLOP/s, "
                  f"y = 2x {results['copy_gbs'] or 0:.0f} GB/s; {time.time() - START:.0f} s so far"]
        text = table(rows, header)
        if args.out:
            with open(os.path.join(args.out, "kernels.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)
            with open(os.path.join(args.out, "kernels.md"), "w") as f:
                f.write(text + "\n")
        return text

    for section in (lambda: attention_rows(shapes, flex, results, args.smoke),
                    lambda: decode_rows(shapes, results, args.smoke),
                    lambda: shortconv_rows(shapes, results), lambda: prologue_rows(shapes, results)):
        rows += attempt("section", section) or []
        emit()
    print(emit(), flush=True)


if __name__ == "__main__":
    main()
