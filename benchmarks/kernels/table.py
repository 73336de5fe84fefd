"""The kernels' targets in one table: each kernel at Inkling's shapes against its peer or ceiling, measured in
the same run, with the target, the measured ratio and whether it is met.

    python -m benchmarks.kernels [--out DIR] [--smoke]

Rows (bf16; batch 1, 8192 tokens, 64 query heads, head_dim 128, d_rel 16 unless said):
- relative attention, full (8 KV heads, E 1024) and sliding (16 KV heads, window 512) layers: forward vs torch
  FlexAttention with the same bias as a score_mod (>= 5x), forward TFLOP/s vs cuDNN plain causal attention
  through `jax.nn.dot_product_attention` (>= 0.75), backward vs Flex's backward (>= 3x);
- decode attention at batch 64: paged (context 8192) KV TB/s (>= 3.5), and the sliding ring, for the record;
- ShortConv prefill GB/s vs a jitted y = 2x over the same bytes (>= 0.85);
- the fused decode prologue at 64 tokens vs the unfused jitted jnp sequence (>= 2x), both layer kinds;
- the multi-LoRA product on the fused q|k|v|r projection, a decode step and a prefill chunk: vs its jitted jnp
  reference (>= 1x), and the share of a bandwidth roofline (the least bytes at the y = 2x ceiling), for the record.
The kernels run with their tuned tiles (the LoRA kernels' are not tuned yet). FlexAttention runs first, in a
child process, so that torch and JAX never share the GPU's memory. --smoke runs tiny shapes (interpret mode on
CPU, eager Flex, whose CPU backward does not exist) to check the plumbing; its numbers mean nothing. Writes
kernels.json and kernels.md into --out (default $OUT) when given, after every section, so that a run cut short
keeps what it measured.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import jax

from benchmarks.kernels import attention, decode, lora, shortconv
from benchmarks.timing import attempt, copy_bandwidth, matmul_flops, stamp, stamp_line
from pallas_kernels.attn_prologue import attn_prologue
from pallas_kernels.attn_prologue import reference as prologue_reference
from pallas_kernels.lora import lora_add
from pallas_kernels.lora import reference as lora_reference
from pallas_kernels.shortconv import shortconv_prefill

TORCH_TIMEOUT_S = 180  # FlexAttention compiles its forward and backward for two layers
START = time.time()


@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: dict  # name -> attention.Layer
    paged: decode.CacheShape
    ring: decode.CacheShape
    decode_batch: int
    prefill: tuple  # [B, T, C] shapes
    prologue: dict  # name -> (tokens, Hq, Hkv, tau)
    lora: tuple  # lora.Case
    head_dim: int
    timing: attention.Timing = attention.Timing()
    matmul_n: int = 8192
    copy_elems: int = 512 * 1024 * 1024
    prologue_slots: tuple = (shortconv.POOL_SLOTS, shortconv.CACHE_SLOTS)
    reps: int = 10  # dependent calls per timed ShortConv / prologue chain
    smoke: bool = False


INKLING = Shapes(layers=attention.LAYERS, paged=decode.PAGED, ring=decode.RING, decode_batch=64,
                 prefill=((1, 8192, 6144), (1, 8192, 2048)),
                 prologue={"global": (64, 64, 8, True), "local": (64, 64, 16, False)}, lora=lora.INKLING,
                 head_dim=128)
_TINY = dict(batch=1, tokens=192, heads=4, dim=16, d_rel=4)  # 3 key tiles of 64
SMOKE = Shapes(layers={"full": attention.Layer(kv_heads=2, extent=96, window=None, **_TINY),
                       "sliding": attention.Layer(kv_heads=2, extent=64, window=64, **_TINY)},
               paged=decode.CacheShape(kv_heads=2, context=64, extent=32, heads=4, dim=16, d_rel=4, page=16),
               ring=decode.CacheShape(kv_heads=2, context=32, extent=32, heads=4, dim=16, d_rel=4), decode_batch=2,
               prefill=((1, 40, 96),), prologue={"global": (3, 4, 2, True), "local": (3, 4, 2, False)}, lora=lora.SMOKE,
               head_dim=16, timing=attention.Timing(trials=1, calls=1), matmul_n=128, copy_elems=1 << 16,
               prologue_slots=(8, 24), reps=2, smoke=True)


def log(*parts):
    print(f"[{time.time() - START:6.1f}s]", *parts, flush=True)


def torch_child(shapes):
    """Child process: FlexAttention fwd and fwd+bwd for each layer, one JSON line per layer as it finishes."""
    import torch
    for name, layer in shapes.layers.items():
        print("FLEX_JSON", json.dumps({name: attention.flex(layer, shapes.timing), "torch": torch.__version__}),
              flush=True)


def run_torch_child(shapes):
    """Flex results by layer name (and torch's version); whatever finished before a timeout or failure is kept."""
    command = [sys.executable, "-m", "benchmarks.kernels", "--torch-child"] + (["--smoke"] if shapes.smoke else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TORCH_TIMEOUT_S)
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        decoded = lambda b: b.decode() if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr = decoded(e.stdout), decoded(e.stderr) + f"\ntimed out after {TORCH_TIMEOUT_S} s"
    found = {}
    for line in stdout.splitlines():
        if line.startswith("FLEX_JSON "):
            found.update(json.loads(line[len("FLEX_JSON "):]))
    if not all(name in found for name in shapes.layers):
        log("torch child:", "\n".join(stderr.strip().splitlines()[-8:]))
    return found


def row(item, shape, ours, peer, target, measured):
    """One table row: `measured` and `target` are ratios (higher is better); None when not measured."""
    met = None if measured is None or target is None else measured >= target
    return dict(item=item, shape=shape, ours=ours, peer=peer, target=target, measured=measured, met=met)


def attention_rows(shapes, flex, results):
    rows = []
    for name, layer in shapes.layers.items():
        ours = attempt(f"[{name}] ours", lambda: attention.ours(layer, shapes.timing))
        cudnn = attempt(f"[{name}] cudnn", lambda: attention.cudnn(layer, shapes.timing,
                                                                    None if shapes.smoke else "cudnn"))
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


def decode_rows(shapes, results):
    batch = shapes.decode_batch
    copies = (lambda nbytes: 1) if shapes.smoke else decode.copies_for
    rows = []
    for name, shape, target in (("paged", shapes.paged, 3.5), ("ring", shapes.ring, None)):
        nbytes = shape.kv_bytes(batch)
        if name == "paged":
            sets, fn = decode.paged_inputs(jax.random.key(batch), batch, copies(nbytes), shape), decode.paged_fn()
        else:
            sets, fn = decode.ring_inputs(batch, copies(nbytes), shape), decode.ring_fn(shape)
        ours = attempt(f"decode {name}", lambda: decode.timed_ms(fn, sets))
        q, k, v = sets[0][:3]
        dense = (batch, shape.context, shape.kv_heads, shape.dim)
        cudnn = attempt(f"decode {name} cudnn", lambda: decode.cudnn_decode_ms(
            q, k.reshape(dense), v.reshape(dense), None if shapes.smoke else "cudnn"))
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
        x, w, moved = shortconv.prefill_inputs(shape)
        name = "x".join(map(str, shape))
        scale = attempt("y = 2x", lambda: shortconv.scale_seconds(x, shapes.reps))
        ours = attempt(f"prefill {name}", lambda: shortconv.prefill_seconds(shortconv_prefill, x, w, shapes.reps))
        copied = 2 * x.size * 2  # y = 2x reads and writes x
        ratio = ours and scale and (moved / ours) / (copied / scale)
        us = f"{ours * 1e6:.1f} us {moved / ours / 1e9:.0f} GB/s" if ours else "-"
        base = f"y=2x {scale * 1e6:.1f} us {copied / scale / 1e9:.0f} GB/s" if scale else "-"
        rows.append(row("ShortConv prefill: GB/s vs y = 2x", name, us, base, 0.85, ratio))
        results[f"shortconv prefill {name}"] = dict(seconds={"y = 2x": scale, "kernel": ours}, moved=moved)
        log(f"shortconv prefill {name}", results[f"shortconv prefill {name}"])
    return rows


def prologue_rows(shapes, results):
    rows = []
    for layer, (tokens, heads, kv_heads, with_tau) in shapes.prologue.items():
        consts, state = shortconv.prologue_inputs(tokens, heads, kv_heads, with_tau, shapes.head_dim,
                                                  *shapes.prologue_slots)
        seconds = lambda fn: shortconv.prologue_seconds(fn, consts, state, tokens, shapes.reps)  # noqa: E731
        ours = attempt(f"prologue {layer}", lambda: seconds(attn_prologue))
        unfused = attempt(f"prologue {layer} jnp", lambda: seconds(prologue_reference.attn_prologue))
        results[f"prologue {layer}"] = dict(seconds=ours, jnp_seconds=unfused)
        us = lambda s: f"{s * 1e6:.1f} us" if s else "-"  # noqa: E731
        rows.append(row(f"fused decode prologue, {layer}: vs unfused jnp", f"N={tokens} Hq={heads} Hkv={kv_heads}",
                        us(ours), us(unfused), 2.0, ours and unfused and unfused / ours))
    return rows


def lora_rows(shapes, results):
    rows = []
    for case in shapes.lora:
        y, args, moved = lora.inputs(case)
        ours = attempt(f"lora {case.name}", lambda: lora.seconds(lora_add, y, args, shapes.reps))
        jnp_ref = attempt(f"lora {case.name} jnp", lambda: lora.seconds(lora_reference.lora_add, y, args, shapes.reps))
        roofline = moved / (results["copy_gbs"] * 1e9) if results["copy_gbs"] else None
        results[f"lora {case.name}"] = dict(seconds=ours, jnp_seconds=jnp_ref, roofline_seconds=roofline, moved=moved)
        log(f"lora {case.name}", results[f"lora {case.name}"])
        us = lambda s: f"{s * 1e6:.1f} us" if s else "-"  # noqa: E731
        rows.append(row(f"multi-LoRA {case.name}: vs jnp reference", case.shape(), us(ours), us(jnp_ref), 1.0,
                        ours and jnp_ref and jnp_ref / ours))
        rows.append(row(f"multi-LoRA {case.name}: share of the bandwidth roofline (for the record)", case.shape(),
                        us(ours), "roofline " + us(roofline), None, ours and roofline and roofline / ours))
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for kernels.md and kernels.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the plumbing on CPU")
    parser.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = SMOKE if args.smoke else INKLING
    if args.torch_child:
        return torch_child(shapes)

    flex = run_torch_child(shapes)  # before JAX touches the GPU
    log("flex", flex)
    # Set before JAX's first device use (the stamp, below): torch has finished, so JAX may take most of the
    # memory, allocated as it goes.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    results = {"stamp": stamp(torch=flex.get("torch")), "smoke": args.smoke}
    results["matmul_tflops"] = attempt("matmul ceiling", lambda: matmul_flops(shapes.matmul_n, data="normal") / 1e12)
    results["copy_gbs"] = attempt("copy ceiling", lambda: copy_bandwidth(shapes.copy_elems, data="normal") / 1e9)
    rows = results["rows"] = []

    def emit():  # after every section, so that a run cut short still leaves the rows it measured
        header = [stamp_line(results["stamp"]) + (" (SMOKE: tiny shapes, numbers meaningless)" if args.smoke else ""),
                  f"ceilings measured in this run: XLA bf16 matmul {results['matmul_tflops'] or 0:.0f} TFLOP/s, "
                  f"y = 2x {results['copy_gbs'] or 0:.0f} GB/s; {time.time() - START:.0f} s so far"]
        text = table(rows, header)
        if args.out:
            with open(os.path.join(args.out, "kernels.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)
            with open(os.path.join(args.out, "kernels.md"), "w") as f:
                f.write(text + "\n")
        return text

    for section in (lambda: attention_rows(shapes, flex, results), lambda: decode_rows(shapes, results),
                    lambda: shortconv_rows(shapes, results), lambda: prologue_rows(shapes, results),
                    lambda: lora_rows(shapes, results)):
        rows += attempt("section", section) or []
        emit()
    print(emit(), flush=True)

