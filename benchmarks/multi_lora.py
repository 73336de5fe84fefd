"""Multi-LoRA serving: output tok/s of one engine serving the base and many LoRA adapters in the same batch, against
the base alone measured in the same run, and the time to load one adapter.

    python -m benchmarks.multi_lora [--out DIR]           # an H200: the `bench` preset, random weights
    python -m benchmarks.multi_lora --preset tiny --adapters 0,1,2 --concurrency 2 --prompt-tokens 16 \\
        --output-tokens 4 --passes 1 --experts             # a functional check on CPU
    python -m benchmarks.multi_lora --mesh tensor=2       # over 2 GPUs (the adapters whole on each)

One engine (`benchmarks.serving.build_engine`: random weights, bf16, fused projections; one row bucket, every row,
and a token budget that prefills every prompt in one step) with an adapter slot for each of the most distinct
adapters asked for. Random adapters of `--rank` on every weight the server adapts (attention q, k, v, r, o and the
dense MLPs; with `--experts` also the routed and shared experts), written as `train.run --lora-rank` writes them
and loaded as `/v1/load_lora_adapter` loads them. For each adapter count N (0 always among them: the base every
ratio divides by), `--concurrency` random prompts (greedy, fixed output length, EOS ignored) are submitted at once
as separate requests, row i taking adapter i mod N (N = 0: all the base). A first, shorter pass with the same
adapters puts them in their slots, so the timed passes (`--passes`) load none (the engine compiled every step
at its start). Each row reports the median pass's output tok/s, its ratio to the base's and its TPOT (time per
output token after the first, per request, p50). The JSON also counts the tokens each adapter generated (the
engine's metrics): every row ran with its adapter. The load of one adapter (median of a few, each under a new
name) is timed from its file to ready in a device slot: read and checked, then its factors written into the slot
and the step's parameters taken anew, on the device.

Adapter slots hold `--rank` factors (fp32) for every adaptable weight, the experts' only with `--experts` (the
server's `--lora-experts`); the run prints their bytes (the `bench` preset at rank 16: 50.5 MiB for attention and
the dense MLPs and 229.5 MiB for the experts per slot).
"""

import argparse
import dataclasses
import functools
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks.serving import build_engine, run_load
from benchmarks.timing import attempt, save_json, show_progress_logs, stamp, stamp_line
from inkling_jax.backend import add_backend_flag
from inkling_jax.generate import flat_params
from serve.engine.config import EngineConfig
from serve.lora.config import LoRAConfig
from serve.lora.random_adapters import random_factors
from serve.lora.view import adapted_modules, expert_projections
from serve.runner.placement import Placement
from train import lora

LOAD_TRIALS = 5
KINDS = {"dense": "attention + dense MLP", "experts": "attention + dense MLP + experts"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.multi_lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench")
    p.add_argument("--adapters", default="0,1,8,32", help="distinct adapters per run, each at most --concurrency "
                   "(0, the base, is always run)")
    p.add_argument("--concurrency", type=int, default=32, help="requests submitted at once")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (and the slots')")
    p.add_argument("--experts", action=argparse.BooleanOptionalAction, default=False,
                   help="also run adapters that add the routed and shared experts, as separate rows: a step with "
                   "any such row runs its MoE layers on the adapted path (jnp ragged products, no MoE kernels), "
                   "slower than the base's; on a GPU XLA pads those products to every row per group, which at the "
                   "`bench` preset's prefill needs more memory than an H200 has")
    p.add_argument("--passes", type=int, default=3, help="timed passes per row; the row reports the median one")
    p.add_argument("--decode-steps", type=int, default=8, help="decode tokens per row per device call")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget of a step (default: every prompt prefills in one step)")
    p.add_argument("--memory-fraction", type=float, default=EngineConfig.memory_fraction,
                   help="share of the free device memory the KV pool may take")
    p.add_argument("--mesh", help="serve over a device mesh, as serve.app's --mesh (e.g. tensor=2; --experts not "
                   "with an expert axis); default: one device. The slots' bytes are then per device")
    add_backend_flag(p)
    p.add_argument("--out", help="directory for multi_lora.json")
    # what `build_engine` reads beyond these: bf16 weights (expert adapters need bf16 routed experts), fused
    # projections (the adapters of fused projections stay fused)
    p.set_defaults(expert_precision="bf16", dense_precision="bf16", fp8_twins=False, no_fuse_projections=False,
                   no_mixed_steps=False)
    args = p.parse_args(argv)
    counts = sorted({0, *(int(n) for n in args.adapters.split(","))})
    if args.passes < 1 or args.concurrency < 1:
        p.error("--passes and --concurrency must be at least 1")
    if counts[0] < 0 or counts[-1] > args.concurrency:
        p.error(f"--adapters must lie in 0..--concurrency ({args.concurrency}), got {args.adapters}")
    args.counts = counts
    args.max_num_batched_tokens = args.max_num_batched_tokens or (args.concurrency + 1) * args.prompt_tokens
    return args


def slot_bytes(view, slots: int) -> dict[str, int]:
    """Device bytes of one adapter slot (fp32 factors and scales): of the attention and dense MLP projections, and
    of the experts."""
    pools = lambda modules: sum(m.a[...].nbytes + m.b[...].nbytes + m.scale[...].nbytes for m in modules)  # noqa: E731
    return {"dense": pools(adapted_modules(view)) // slots, "experts": pools(expert_projections(view)) // slots}


def write_adapters(directory: str, shapes: dict[str, tuple[int, ...]], kind: str, count: int,
                   rank: int) -> list[str]:
    """`count` random adapter files of `rank` (alpha = rank: scale 1) on the weights of `shapes` (base weight ->
    shape) that `kind` adapts: "dense" the [in, out] ones, "experts" also the experts' [experts, in, out]."""
    targets = {name: shape for name, shape in shapes.items() if kind == "experts" or len(shape) == 2}
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"{kind}-{i + 1}.safetensors")
        lora.save_adapters(path, random_factors(targets, rank, seed=i), float(rank))
        paths.append(path)
    return paths


def load_ms(engine, path: str, label: str) -> dict[str, float]:
    """Milliseconds to load the adapter at `path` as the server loads one at run time (read from disk and checked,
    as `/v1/load_lora_adapter`), then to put it in a device slot ready for a step (the slots' factors written and
    the step's parameters taken anew, as the engine does before a step with a new adapter), waiting for the device:
    the medians over `LOAD_TRIALS` loads, each under a new name (so a new adapter to the slots, evicting the least
    recently used). The engine thread must have stopped: this writes its slots."""
    runner = engine.runner
    reads, slots = [], []
    for trial in range(LOAD_TRIALS):
        start = time.perf_counter()
        adapter = runner.lora.register(f"{label}-load-{trial}", path)
        read = time.perf_counter()
        runner.lora.place(runner.model, {adapter})
        jax.block_until_ready(flat_params(runner.model)[0])
        reads.append(read - start)
        slots.append(time.perf_counter() - read)
    return {"read_ms": 1e3 * statistics.median(reads), "slot_ms": 1e3 * statistics.median(slots),
            "total_ms": 1e3 * statistics.median(np.add(reads, slots))}


def measure_row(args, engine, adapters: list[str | None], vocab: int, seed: int) -> dict:
    """The warm-up pass, then `args.passes` timed ones, of the rows' `adapters`; the median timed pass."""
    run_load(engine, args.concurrency, args.prompt_tokens, 4, vocab, seed=1000 + seed, adapters=adapters)
    passes = sorted((run_load(engine, args.concurrency, args.prompt_tokens, args.output_tokens, vocab, seed=seed,
                              adapters=adapters) for _ in range(args.passes)), key=lambda r: r["tok_s"])
    return {**passes[len(passes) // 2], "passes_tok_s": [r["tok_s"] for r in passes]}


def measure(args, engine, names: dict[str, list[str]], vocab: int, errors: dict) -> list[dict]:
    """A row for every adapter count of every kind of adapter (a failed one recorded in `errors`, the rest go
    on), each with its ratio to the base's."""
    runs = [("dense", n) for n in args.counts] + [("experts", n) for n in args.counts if n and "experts" in names]
    found = []
    for seed, (kind, count) in enumerate(runs):
        adapters = [names[kind][i % count] if count else None for i in range(args.concurrency)]
        targets = "base" if count == 0 else kind
        row = attempt(f"{count} {targets}", functools.partial(measure_row, args, engine, adapters, vocab, seed), errors)
        found += [] if row is None else [{"adapters": count, "targets": targets, **row}]
    base = next((row["tok_s"] for row in found if row["targets"] == "base"), None)
    for row in found:
        row["x_base"] = None if base is None else row["tok_s"] / base
    return found


def report(args, results) -> None:
    """The lines of the run, then its table (and multi_lora.json into --out)."""
    slots, per_slot = results["slots"], results["slot_bytes"]
    print(stamp_line(results["stamp"]) + f"; preset {args.preset}, {args.concurrency} concurrent requests, prompt "
          f"{args.prompt_tokens}, output {args.output_tokens}, rank {args.rank}, decode steps {args.decode_steps}; "
          f"build {results['build_s']:.1f}s, compile {results['compile_s']:.1f}s")
    print(f"adapter slots: {slots} (the base's included) x ({per_slot['dense'] / 2**20:.1f} MiB attention + dense MLP "
          f"+ {per_slot['experts'] / 2**20:.1f} MiB experts) = {slots * sum(per_slot.values()) / 2**30:.2f} GiB on "
          f"the device; KV pool {results['kv_pool_gib']:.1f} GiB")
    for kind, found in results["load"].items():
        print(f"load one adapter ({KINDS[kind]}, {results['file_bytes'][kind] / 2**20:.1f} MiB file), median of "
              f"{LOAD_TRIALS}: read {found['read_ms']:.1f} ms + into its slot {found['slot_ms']:.1f} ms = "
              f"{found['total_ms']:.1f} ms")
    print("| distinct adapters | adapted weights | output tok/s | x base | TPOT p50 ms | TTFT p50 ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in results["runs"]:
        ratio = "-" if r["x_base"] is None else f"{r['x_base']:.3f}"
        print(f"| {r['adapters']} | {KINDS.get(r['targets'], 'base')} | {r['tok_s']:.1f} | {ratio} | "
              f"{r['tpot_p50_ms']:.2f} | {r['ttft_p50_ms']:.1f} |")
    if args.out:
        save_json(args.out, "multi_lora.json", results)


def main(argv=None):
    args = parse_args(argv)
    show_progress_logs()
    kinds = ["dense"] + (["experts"] if args.experts else [])
    largest = max(args.counts[-1], 1)
    results = {"args": {**vars(args), "backend": dataclasses.asdict(args.backend)}, "stamp": stamp()}
    with tempfile.TemporaryDirectory(prefix="multi-lora-") as directory:
        # Adapters are loaded at run time from under `directory`; host memory keeps every one of them.
        config = LoRAConfig((), max_loras=largest, max_rank=args.rank, root=directory,
                            max_cpu_loras=largest * len(kinds), experts=args.experts)
        # One row bucket, every row: every step of the benchmark runs all of them.
        model, engine = build_engine(args, [args.concurrency], Placement.from_spec(args.mesh), results, lora=config,
                                     row_buckets=(args.concurrency + 1,))
        runner = engine.runner
        results["slots"] = largest + 1
        results["slot_bytes"] = slot_bytes(runner.model, largest + 1)
        names, results["file_bytes"] = {}, {}
        for kind in kinds:
            paths = write_adapters(directory, runner.lora.shapes, kind, largest, args.rank)
            names[kind] = [runner.lora.register(f"{kind}-{i + 1}", p).name for i, p in enumerate(paths)]
            results["file_bytes"][kind] = os.path.getsize(paths[0])
        results["errors"] = {}
        results["runs"] = measure(args, engine, names, model.config.text.unpadded_vocab_size, results["errors"])
        sample = engine.metrics.registry.get_sample_value
        results["tokens_per_adapter"] = {name: sample("inkling_lora_generation_tokens_total", {"adapter": name}) or 0
                                         for kind in kinds for name in names[kind]}
        engine.shutdown(drain_seconds=0)
        loads = {kind: attempt(f"load {kind}", functools.partial(load_ms, engine, os.path.join(
            directory, f"{kind}-1.safetensors"), kind), results["errors"]) for kind in kinds}
        results["load"] = {kind: found for kind, found in loads.items() if found is not None}
    report(args, results)


if __name__ == "__main__":
    main()
