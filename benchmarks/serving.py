"""The serving engine on one GPU (or a mesh: --mesh), without HTTP: output tok/s, time to first token and
inter-token latency (p50/p99) at several concurrencies; the batch-1 decode step's achieved bytes/s against the
copy (y = 2x) and read bandwidths measured in the same run; the decode and prefill programs alone (TPOT minus the
decode program's time per token is what the engine's host work adds); transformers' Inkling at 32 concurrent
requests (one batched `generate`, the best of three timed runs, the first of which is still cold) as the peer.

    python -m benchmarks.serving [--out DIR]                    # an H200: the `bench` preset, random weights
    python -m benchmarks.serving --preset tiny --concurrency 1,4 --prompt-tokens 16 --output-tokens 8 \\
        --no-peer --copy-mib 64                                  # a functional check on CPU

Each concurrency level submits that many prompts at once, as one engine request (random prompt ids, fixed
output length, EOS ignored; see `run_load`), then again as separate requests in a burst (as many clients would),
and times every token as the engine hands it out. The engine decodes up to `--decode-steps` tokens per device
call, so tokens arrive in bursts: ITL p50 is then near zero and ITL p99 is the time of one call; TPOT (time per
output token after the first, per request) is the decode speed. The batch-1 decode bytes are
`benchmarks.model.decode_step_bytes` (every weight but the untouched routed experts and one embedding row, plus
the K/V of the longest context); dividing by the batch-1 median TPOT gives achieved bytes/s, host round-trips
included. The peer runs first, in its own process, before JAX takes the GPU's memory.

The row buckets are the levels, except the highest, which decodes in the all-rows bucket (its level + 1: the
engine's scratch row); prompts prefill in the largest row bucket whose prompts fit one step
(`--max-num-batched-tokens`). So a level's numbers compare across runs only when both ran it with the same
levels above it: `--concurrency 32` alone decodes 33 rows and prefills one prompt a step, where
`--concurrency 32,128` decodes 32 rows and prefills the 32 prompts in one step.
"""

import argparse
import dataclasses
import json
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.model import decode_step_bytes
from benchmarks.programs import decode_program_seconds, prefill_program_seconds
from benchmarks.timing import (copy_bandwidth, matmul_flops, read_bandwidth, save_json,
                               show_progress_logs, stamp, stamp_line)
from inkling_jax import preset
from inkling_jax.backend import add_backend_flag
from inkling_jax.quant import QuantConfig
from inkling_jax.quant.config import DENSE_PRECISIONS, EXPERT_PRECISIONS
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.memory_plan import program_bytes
from serve.engine.sampling_params import SamplingParams
from serve.http.text_stream import Delta
from serve.random_weights import random_weights
from serve.runner.placement import Placement

PEER = r"""
import json, sys, time, torch
from transformers import InklingForCausalLM, InklingTextConfig
batch, prompt, new = (int(x) for x in sys.argv[1:4])
cfg = InklingTextConfig(vocab_size=201024, hidden_size=6144, num_hidden_layers=6, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128, swa_num_attention_heads=64, swa_num_key_value_heads=16, swa_head_dim=128,
    sliding_window_size=512, d_rel=16, rel_extent=1024, intermediate_size=24576, moe_intermediate_size=3072,
    n_routed_experts=32, num_experts_per_tok=6, n_shared_experts=2, dense_mlp_idx=2, log_scaling_n_floor=128000)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = InklingForCausalLM(cfg).eval()
ids = torch.randint(0, 200000, (batch, prompt), device="cuda")
with torch.no_grad():
    model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    # The first full-length run is still cold. Report the best run, not the median (the slower of the two warm
    # ones), so that the peer's spread between runs never favours our ratio.
    rates = []
    for _ in range(3):
        torch.cuda.synchronize(); start = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize(); rates.append(batch * new / (time.perf_counter() - start))
print(json.dumps({"peer_tok_s": max(rates), "peer_runs_tok_s": rates,
                  "transformers": __import__("transformers").__version__, "torch": torch.__version__}))
"""


class Timestamps:
    """An output parser that reports every token (the bench times tokens, not text)."""

    stopped = False

    def feed(self, token_id, entry=None):
        return [Delta("text", "", [])]

    def finish(self):
        return []


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids, the same for the same seed (`run_load`'s, and the RL
    benchmark's rollouts, which its serving reference then loads again)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(count)]


def run_load(engine: Engine, concurrency: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int,
             separate: bool = False, adapters: list[str | None] | None = None):
    """`concurrency` prompts submitted together as one engine request (as /v1/completions takes a list of
    prompts), so that they all arrive before the engine's next step, as the peer's batch does; or, `separate`,
    as one request each, submitted in a loop as a burst of clients would: the engine thread wakes on the first
    and may prefill the rest in a later step. `adapters`: each prompt's LoRA adapter (None: the base), a request's
    own, so given, the prompts are separate requests."""
    separate = separate or adapters is not None
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    times: list[list[float]] = [[] for _ in range(concurrency)]
    done = threading.Event()
    finished = [0]

    def sink(output, row=None):  # called on the engine thread only
        times[output.index if row is None else row].append(time.perf_counter())
        finished[0] += output.finish_reason is not None
        if finished[0] == concurrency:
            done.set()

    prompts = random_prompts(vocab, concurrency, prompt_tokens, seed)
    start = time.perf_counter()
    if separate:
        for i, prompt in enumerate(prompts):
            engine.submit(f"bench-{seed}-{i}", [prompt], params, 1, Timestamps, lambda out, i=i: sink(out, i),
                          adapter=None if adapters is None else adapters[i])
    else:
        engine.submit(f"bench-{seed}", prompts, params, 1, Timestamps, sink)
    if not done.wait(600):
        raise TimeoutError(f"concurrency {concurrency} did not finish")
    end = max(t[-1] for t in times)
    ttft = [t[0] - start for t in times]
    itl = np.concatenate([np.diff(t) for t in times])
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    ms = lambda values, q: 1e3 * float(np.percentile(values, q))  # noqa: E731
    return {"concurrency": concurrency, "separate": separate, "tok_s": concurrency * output_tokens / (end - start),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "tpot_p50_ms": ms(tpot, 50),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench")
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="token budget of a step: 4096 prefills the 32 prompts of the 32 level in one step")
    p.add_argument("--copy-mib", type=int, default=2048, help="buffer of the bandwidth ceilings")
    p.add_argument("--decode-steps", type=int, default=8, help="decode tokens per row per device call")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' Inkling")
    p.add_argument("--no-fuse-projections", action="store_true", help="unfused projections")
    p.add_argument("--no-mixed-steps", action="store_true",
                   help="decodes and a prompt chunk as two programs (EngineConfig.mixed_steps off)")
    p.add_argument("--mesh", help="serve over a device mesh, as serve.app's --mesh (e.g. tensor=2); default: one "
                   "device. Bytes/s are then compared with the ceilings times the device count")
    p.add_argument("--memory-fraction", type=float, default=EngineConfig.memory_fraction,
                   help="share of the free device memory the KV pool may take")
    p.add_argument("--expert-precision", default="bf16", choices=EXPERT_PRECISIONS,
                   help="routed experts' weights, as serve.app's flag")
    p.add_argument("--dense-precision", default="bf16", choices=DENSE_PRECISIONS,
                   help="dense weights (MLPs, LM head; nvfp4 also attention, shared experts), as serve.app's flag")
    p.add_argument("--fp8-twins", action="store_true", help="fp8 copies of the NVFP4 weights for wide steps, as "
                   "serve.app's flag")
    add_backend_flag(p)
    p.add_argument("--out", help="directory for serve.json")
    return p.parse_args(argv)


def run_peer(prompt_tokens: int, output_tokens: int) -> dict:
    """transformers' Inkling at 32 concurrent requests, in its own process; {} when it fails."""
    peer = subprocess.run([sys.executable, "-c", PEER, "32", str(prompt_tokens), str(output_tokens)],
                          capture_output=True, text=True, timeout=600)
    if peer.returncode:
        print(peer.stderr[-2000:], end="")
        return {}
    return json.loads(peer.stdout.strip().splitlines()[-1])


def build_engine(args, levels, placement, results, **changes):
    """The preset's model with random weights in the requested precisions, and a started engine whose buckets
    fit the levels (module doc); `changes`: EngineConfig fields set otherwise (a benchmark's own)."""
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    start = time.perf_counter()
    config = preset(args.preset)
    model = random_weights(config, dtype, backend=args.backend,
                           quant=QuantConfig(args.expert_precision, args.dense_precision, args.fp8_twins))
    results["build_s"] = time.perf_counter() - start
    length = args.prompt_tokens + args.output_tokens + 16
    chunks = (1, min(args.prompt_tokens, args.max_num_batched_tokens))
    rows = tuple(sorted({1, *levels} - {max(levels)})) + (max(levels) + 1,)  # the last bucket: every row
    engine_config = EngineConfig(max_num_seqs=max(levels), max_model_len=length,
                                 max_num_batched_tokens=max(args.max_num_batched_tokens, max(levels) + 16),
                                 chunk_buckets=chunks, row_buckets=rows, prefix_caching=False,
                                 max_queued=max(levels) + 1, decode_steps=args.decode_steps,
                                 fuse_projections=not args.no_fuse_projections,
                                 mixed_steps=not args.no_mixed_steps, memory_fraction=args.memory_fraction)
    engine_config = dataclasses.replace(engine_config, **changes)
    model = placement.model_view(model, engine_config)  # as serve.app: the unfused weights freed
    engine = Engine(model, engine_config, eos_token_id=config.eos_token_id, placement=placement)
    engine.start()
    results["compile_s"] = engine.warm_up_seconds
    # Per device: the KV pool and what each step program allocates beside it (temporaries, unaliased outputs).
    runner = engine.runner
    results["kv_pool_gib"] = runner.num_pages * runner.page_bytes_per_device() / 2**30
    results["step_program_gib"] = {f"{rows}x{tokens}{' full' if full else ''}": program_bytes(p) / 2**30
                                   for (rows, tokens, full), p in runner._steps.items()}
    results["step_program_gib"].update({  # mixed steps: decode rows + prompt chunks
        f"{rows}+{chunks}x{engine_config.max_chunk}{' full' if full else ''}": program_bytes(p) / 2**30
        for (rows, chunks, full), p in runner._mixed.items()})
    return model, engine


def measure(args, levels, engine, vocab, results):
    """The loads at every level (one request, then separate requests), then each program alone."""
    run_load(engine, min(levels), args.prompt_tokens, 4, vocab, seed=99)  # first calls of each executable
    results["levels"] = [run_load(engine, c, args.prompt_tokens, args.output_tokens, vocab, seed=c) for c in levels]
    results["levels"] += [run_load(engine, c, args.prompt_tokens, args.output_tokens, vocab, seed=c, separate=True)
                          for c in levels if c > 1]
    engine.shutdown(drain_seconds=0)
    # The decode program alone: what the engine's host work between calls adds is TPOT minus this.
    gpu = jax.default_backend() == "gpu"
    results["program_ms_per_token"] = {
        n: 1e3 * decode_program_seconds(engine, n) / args.decode_steps for n in levels if n < 128 or gpu}
    prefill_tokens = engine.runner.config.chunk_buckets[-1]
    results["prefill_ms"] = {r: 1e3 * prefill_program_seconds(engine, r, prefill_tokens)
                             for r, t in engine.runner.config.buckets if t > 1}


def report(args, model, engine, placement, results):
    """The tables and lines of the run (and serve.json into --out)."""
    devices = 1 if placement.mesh is None else placement.mesh.size
    engine_config = engine.runner.config
    prefill_tokens = engine_config.chunk_buckets[-1]
    # the longest context of a batch-1 request: an upper bound on the K/V its steps read
    step_bytes = decode_step_bytes(model, 1, args.prompt_tokens + args.output_tokens)
    batch1 = next((r for r in results["levels"] if r["concurrency"] == 1), None)
    print(stamp_line(results["stamp"]) + (f" ({placement.devices})" if devices > 1 else "") +
          f"; preset {args.preset}, prompt {args.prompt_tokens}, output {args.output_tokens}, decode steps "
          f"{args.decode_steps}; build {results['build_s']:.1f}s, compile {results['compile_s']:.1f}s "
          f"({len(engine_config.buckets)} buckets: {engine_config.buckets})")
    print(f"per device: KV pool {results['kv_pool_gib']:.1f} GiB; largest step program "
          f"{max(results['step_program_gib'].values()):.2f} GiB beside it")
    print(f"copy (y = 2x, read + write) {results['copy_bytes_s'] / 1e9:.0f} GB/s; read (sum x) "
          f"{results['read_bytes_s'] / 1e9:.0f} GB/s; bf16 matmul {results['matmul_flop_s'] / 1e12:.0f} TFLOP/s")
    print("| concurrency | submitted as | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms | "
          "ITL p99 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results["levels"]:
        submitted = "separate requests" if r["separate"] else "one request"
        print(f"| {r['concurrency']} | {submitted} | {r['tok_s']:.1f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.2f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} |")
    for r, ms in results["prefill_ms"].items():
        print(f"prefill program alone, {r} rows x {prefill_tokens} tokens: {ms:.2f} ms = "
              f"{r * prefill_tokens / ms:.1f}k tok/s")
    for n, ms in results["program_ms_per_token"].items():
        print(f"decode program alone, {n} rows: {ms:.2f} ms per token (step of {args.decode_steps} tokens)")
    if batch1:
        achieved = step_bytes / (batch1["tpot_p50_ms"] / 1e3)
        of_copy, of_read = (achieved / (devices * results[k]) for k in ("copy_bytes_s", "read_bytes_s"))
        results["decode_batch1"] = {"bytes": step_bytes, "bytes_s": achieved, "of_copy": of_copy,
                                    "of_read": of_read}
        print(f"batch-1 decode step: {step_bytes / 1e9:.2f} GB read in {batch1['tpot_p50_ms']:.2f} ms = "
              f"{achieved / 1e9:.0f} GB/s = {of_copy:.2f} of the copy bandwidth, {of_read:.2f} of the read "
              f"bandwidth" + (f" (x {devices} devices)" if devices > 1 else ""))
    ours32 = next((r["tok_s"] for r in results["levels"] if r["concurrency"] == 32 and not r["separate"]), None)
    if "peer_tok_s" in results and ours32:
        print(f"32 concurrent: {ours32:.1f} tok/s vs transformers {results['transformers']} generate "
              f"{results['peer_tok_s']:.1f} tok/s (best of " + ", ".join(f"{r:.1f}" for r in results[
                  "peer_runs_tok_s"]) + f") = {ours32 / results['peer_tok_s']:.1f}x")
    if args.out:
        save_json(args.out, "serve.json", results)


def main(argv=None):
    args = parse_args(argv)
    show_progress_logs()
    placement = Placement.from_spec(args.mesh)
    placement.check(preset(args.preset).text, dense_precision=args.dense_precision)
    levels = sorted(int(c) for c in args.concurrency.split(","))
    results = {"args": {**vars(args), "backend": dataclasses.asdict(args.backend)}}
    if not args.no_peer:  # first, in its own process: JAX would otherwise hold most of the GPU's memory
        results.update(run_peer(args.prompt_tokens, args.output_tokens))
    results["stamp"] = stamp(transformers=results.get("transformers"), torch=results.get("torch"))
    results["placement"] = placement.devices
    results["copy_bytes_s"] = copy_bandwidth(args.copy_mib * 2**20 // 2, data="ones")
    results["read_bytes_s"] = read_bandwidth(args.copy_mib * 2**20 // 2, data="ones")
    results["matmul_flop_s"] = matmul_flops(8192 if jax.default_backend() == "gpu" else 512, data="ones")
    model, engine = build_engine(args, levels, placement, results)
    measure(args, levels, engine, model.config.text.unpadded_vocab_size, results)
    report(args, model, engine, placement, results)


if __name__ == "__main__":
    main()
