"""The HTTP server at its default flags under the load of vLLM's serving benchmark, against the ceiling its own
programs set, in one run (one GPU, about 8 minutes for the `bench` preset):

    python -m benchmarks.serving_sweep --out DIR                       # bf16 weights
    python -m benchmarks.serving_sweep --out DIR --server-args "--expert-precision nvfp4 --fp8-twins"

1. The server that `python -m serve.app --random-weights --preset bench` starts, with the defaults (only
   --max-model-len is set, to hold a prompt and its output), built in this process by serve.app's own
   `build_service` and served by its uvicorn `Server` on a thread, so that its engine is built and compiled
   once for the whole run.
2. `inkling-bench-serving` (a subprocess, so that the load's threads do not share the server's interpreter) loads
   it at each --max-concurrency level (random prompts of --input-len tokens, --output-len output tokens, EOS
   ignored, greedy, all sent at once; --prompts-per-level x the level prompts), then at each --request-rates
   rate; each result is printed and saved (DIR/load-*.json) as it comes, with what /metrics counts of
   compilations after warm-up, preemptions, and the device's waits for the host between steps.
3. With the HTTP server stopped and the engine thread ended, the same engine's programs are timed alone: the
   decode program at each level's rows (at the load's mean context), the prefill of one prompt of --input-len
   tokens (its chunks of the largest size, one after the other), the largest prefill bucket (the most prompt
   tokens one step prefills), and the mixed programs (each level's decode rows with one chunk of the largest
   size, and with the most such chunks a mixed program takes) beside a decode step plus those chunks apart.
4. A table: served output tok/s against the decode program's tok/s at the same rows and against the ceiling of
   the timed programs (`schedule_ceiling`: output tokens come with their prompts' prefill, which no schedule
   skips), TTFT p50 against one prompt's prefill, TPOT p50 against the decode program's time per token;
   DIR/sweep.json holds everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
import urllib.request

from benchmarks.load.datasets import DEFAULT_TOKEN_RANGE
from benchmarks.timing import save_json, show_progress_logs
from inkling_jax import preset
from inkling_jax.config.schema import ConfigError

HOST = "127.0.0.1"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="serving-sweep", help="directory for the results")
    p.add_argument("--preset", default="bench", help="the random-weights model the server builds")
    p.add_argument("--levels", default="1,8,32,128", help="--max-concurrency levels of the load")
    p.add_argument("--request-rates", default="", help="request rates (req/s, Poisson) to load at after the "
                   "levels, with no concurrency limit (default: none)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prompts-per-level", type=int, default=4, help="prompts sent at a level: this x the level")
    p.add_argument("--max-prompts", type=int, default=512, help="prompts sent at a level or rate at most")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--server-args", default="", help="more serve.app flags, e.g. \"--expert-precision fp8\"")
    args = p.parse_args(argv)
    try:
        args.level_list = sorted(int(c) for c in args.levels.split(","))
        args.rate_list = [float(r) for r in args.request_rates.split(",") if r]
    except ValueError:
        p.error("--levels takes integers, --request-rates numbers, comma-separated")
    if min(args.level_list) < 1 or any(not r > 0 for r in args.rate_list):
        p.error("levels must be >= 1 and request rates > 0")
    try:  # prompts of ids the model has (the load generator's default range where the vocabulary holds it)
        vocab = preset(args.preset).text.unpadded_vocab_size
    except ConfigError as exc:
        p.error(f"--preset: {exc}")
    args.token_range = DEFAULT_TOKEN_RANGE if vocab >= DEFAULT_TOKEN_RANGE[1] else (0, vocab)
    for flag in ("input_len", "output_len", "prompts_per_level", "max_prompts"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def server_flags(args) -> list[str]:
    """serve.app's flags: its defaults, but the preset's random weights and room for a prompt and its output."""
    return ["--random-weights", "--preset", args.preset, "--host", HOST, "--port", str(args.port),
            "--max-model-len", str(args.input_len + args.output_len), *shlex.split(args.server_args)]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def save(args, results: dict) -> None:
    save_json(args.out, "sweep.json", results)


def build_server(args):
    """serve.app's service built with the run's flags: (the HTTP server to run on a thread, its engine). Stopping
    the server leaves the engine running (an app without a drain)."""
    import jax

    from serve.app import build_service, parse_args as server_args
    from serve.http.routes import create_app
    from serve.http.server import ServerThread

    flags = server_args(server_flags(args))
    log("serving as: python -m serve.app " + shlex.join(server_flags(args)))
    if flags.compilation_cache:  # as serve.app does
        jax.config.update("jax_compilation_cache_dir", flags.compilation_cache)
    service = build_service(flags)
    return ServerThread(create_app(service), HOST, args.port, flags.drain_seconds), service.engine


def server_counter(args, name: str) -> float:
    with urllib.request.urlopen(f"http://{HOST}:{args.port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def load(args, label: str, concurrency: int | None, rate: float, prompts: int) -> dict:
    """One run of the load generator; its result, saved to DIR/load-<label>.json."""
    flags = ["--base-url", f"http://{HOST}:{args.port}", "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--num-prompts", str(prompts), "--request-rate",
             str(rate), "--seed", str(prompts), "--disable-tqdm", "--random-token-range",
             ",".join(map(str, args.token_range)),
             *(["--max-concurrency", str(concurrency)] if concurrency else [])]
    path = os.path.join(args.out, f"load-{label}.json")
    waits = [server_counter(args, f"inkling_device_wait_seconds_{k}") for k in ("count", "sum")]
    done = subprocess.run([sys.executable, "-m", "benchmarks.load.cli", *flags, "--save-result", "--result-filename",
                           path], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the load generator failed ({label}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(path) as f:
        found = json.load(f)
    found["compilations_after_warmup"] = server_counter(args, "inkling_compilations_after_warmup_total")
    found["preemptions"] = server_counter(args, "inkling_preemptions_total")
    found["mixed_steps"] = server_counter(args, "inkling_mixed_steps_total")  # so far: decodes + a chunk as one
    found["device_waits"], found["device_wait_s"] = (server_counter(args, f"inkling_device_wait_seconds_{k}") - was
                                                     for k, was in zip(("count", "sum"), waits))
    save_json(args.out, f"load-{label}.json", found)  # with the server's counts
    log(f"{label}: {found['completed']} done, {found['failed']} failed in {found['duration']:.1f}s; output "
        f"{found['output_throughput']:.0f} tok/s; TTFT p50 {found['median_ttft_ms']:.1f} ms, p99 "
        f"{found['p99_ttft_ms']:.1f} ms; TPOT p50 {found['median_tpot_ms']:.2f} ms; ITL p99 "
        f"{found['p99_itl_ms']:.2f} ms; compilations after warm-up {found['compilations_after_warmup']:.0f}, "
        f"preemptions {found['preemptions']:.0f}, mixed steps so far {found['mixed_steps']:.0f}; the device "
        f"waited for the host {found['device_waits']:.0f} times, {found['device_wait_s']:.3f} s in all "
        f"({found['device_wait_s'] / found['duration']:.1%} of the load's time)")
    return {k: v for k, v in found.items() if k not in ("input_lens", "output_lens", "ttfts", "itls", "errors")}


def measure_programs(args, results: dict, engine) -> None:
    """The server's engine, its thread ended, its programs timed alone."""
    from benchmarks.programs import decode_program_seconds, mixed_program_seconds, prefill_program_seconds
    from benchmarks.timing import attempt, stamp

    results["stamp"] = stamp()
    config = engine.runner.config
    results["engine"] = {"build_and_warm_up_s": results["server_startup_s"], "max_num_seqs": config.max_num_seqs,
                         "max_num_batched_tokens": config.max_num_batched_tokens, "buckets": config.buckets,
                         "num_pages": engine.runner.num_pages, "decode_steps": config.decode_steps,
                         "max_chunk": config.max_chunk}
    log(f"engine: {config.max_num_seqs} slots, budget {config.max_num_batched_tokens}, {engine.runner.num_pages} "
        f"pages, buckets {config.buckets}")
    context = args.input_len + args.output_len // 2  # a decoding row's mean context during the load
    decode = results.setdefault("decode_ms_per_token", {})
    # a level of more requests than slots runs (and is compared with) the programs of every slot
    levels = {level: program_rows(results, level) for level in args.level_list}
    for level, rows in levels.items():
        seconds = attempt(f"decode program, {rows} rows", lambda: decode_program_seconds(engine, rows, context))
        if seconds is not None:
            decode[level] = 1e3 * seconds / config.decode_steps
            log(f"decode program alone, {rows} rows at {context} tokens: {decode[level]:.2f} ms per token = "
                f"{rows / decode[level] * 1e3:.0f} tok/s")
        save(args, results)
    chunks = math.ceil(args.input_len / config.max_chunk)
    seconds = attempt("prefill program", lambda: prefill_program_seconds(engine, 1, config.max_chunk))
    if seconds is not None:
        results["prefill_ms"] = 1e3 * seconds * chunks
        log(f"one {args.input_len}-token prompt's prefill: {chunks} x {config.max_chunk}-token chunk "
            f"{1e3 * seconds:.2f} ms = {results['prefill_ms']:.1f} ms")
    largest_rows = max(r for r, tokens in config.buckets if tokens == config.max_chunk)
    largest_s = attempt("largest prefill program",
                        lambda: prefill_program_seconds(engine, largest_rows, config.max_chunk))
    if largest_s is not None:
        results["largest_prefill_us_per_token"] = 1e6 * largest_s / (largest_rows * config.max_chunk)
        log(f"largest prefill program, {largest_rows} x {config.max_chunk} tokens: {1e3 * largest_s:.2f} ms = "
            f"{results['largest_prefill_us_per_token']:.1f} us per prompt token")
    mixed = results.setdefault("mixed_ms", {})
    for level, rows in levels.items() if config.mixed_buckets else ():
        seconds = attempt(f"mixed program, {rows} rows", lambda: mixed_program_seconds(engine, rows, context))
        if seconds is not None:
            mixed[level] = 1e3 * seconds
            apart = decode.get(level, math.nan) + results.get("prefill_ms", math.nan) / chunks
            log(f"mixed program alone, {rows} decode rows + one {config.max_chunk}-token chunk: {mixed[level]:.2f} "
                f"ms (a decode step and the chunk's prefill apart: {apart:.2f} ms)")
        save(args, results)
    widest = max(config.mixed_prefills, default=1)
    if widest > 1:  # the mixed programs a burst of prompts rides in, beside a decode step and their prefill apart
        seconds = largest_s if widest == largest_rows else attempt(
            f"prefill program, {widest} rows", lambda: prefill_program_seconds(engine, widest, config.max_chunk))
        results["widest_mixed"] = {"chunk_rows": widest, "prefill_ms": seconds and 1e3 * seconds, "ms": {}}
        for level, rows in levels.items():
            mixed_s = attempt(f"mixed program, {rows} rows + {widest} chunks",
                              lambda: mixed_program_seconds(engine, rows, context, widest))
            if mixed_s is not None:
                results["widest_mixed"]["ms"][level] = 1e3 * mixed_s
                log(f"mixed program alone, {rows} decode rows + {widest} {config.max_chunk}-token chunks: "
                    f"{1e3 * mixed_s:.2f} ms (apart: {decode.get(level, math.nan):.2f} + "
                    f"{1e3 * (seconds or math.nan):.2f} ms)")
        save(args, results)


def program_rows(results: dict, level: int) -> int:
    """The rows of the programs a level runs: its requests, or every slot where they are more."""
    return min(level, results["engine"]["max_num_seqs"])


def schedule_ceiling(results: dict, level: int) -> float | None:
    """Output tok/s at `level` concurrent requests of the best schedule of the timed programs: every output token
    in a decode step of `level` rows, every prompt token prefilled at the lowest cost a token measured (in the
    largest prefill bucket, or in chunks riding that level's mixed steps beside its decodes: one chunk, or the
    most a mixed program takes). None where a part was not timed."""
    step_ms = results.get("decode_ms_per_token", {}).get(level)
    costs = [results["largest_prefill_us_per_token"] / 1e3] if "largest_prefill_us_per_token" in results else []
    if step_ms is not None and level in results.get("mixed_ms", {}):
        costs.append((results["mixed_ms"][level] - step_ms) / results["engine"]["max_chunk"])
    widest = results.get("widest_mixed", {})
    if step_ms is not None and level in widest.get("ms", {}):
        costs.append((widest["ms"][level] - step_ms) / (widest["chunk_rows"] * results["engine"]["max_chunk"]))
    if step_ms is None or not costs:
        return None
    output, prompt = results["args"]["output_len"], results["args"]["input_len"]
    return 1e3 * output / (output * step_ms / program_rows(results, level) + prompt * min(costs))


def table(results: dict) -> str:
    """Served against the programs: the ratios issue 48 asks of the default flags, and the served throughput over
    the ceiling of the timed programs."""
    decode, prefill = results.get("decode_ms_per_token", {}), results.get("prefill_ms")
    lines = ["| concurrency | prompts | output tok/s | decode program tok/s | ratio | ceiling tok/s | of ceiling | "
             "TTFT p50 ms | / one prefill | TPOT p50 ms | / decode ms per token | ITL p99 ms | failed |",
             "|---:" * 13 + "|"]
    for level, found in results["levels"].items():
        ms = decode.get(level)
        program = program_rows(results, level) / ms * 1e3 if ms else None  # the decode program's tok/s
        ceiling = schedule_ceiling(results, level)
        served = found["output_throughput"]
        cells = [level, found["completed"] + found["failed"], f"{served:.0f}",
                 f"{program:.0f}" if program else "-", f"{served / program:.2f}" if program else "-",
                 f"{ceiling:.0f}" if ceiling else "-", f"{served / ceiling:.2f}" if ceiling else "-",
                 f"{found['median_ttft_ms']:.1f}", f"{found['median_ttft_ms'] / prefill:.2f}" if prefill else "-",
                 f"{found['median_tpot_ms']:.2f}", f"{found['median_tpot_ms'] / ms:.2f}" if ms else "-",
                 f"{found['p99_itl_ms']:.2f}", found["failed"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines + targets(results))


def targets(results: dict) -> list[str]:
    """Issue 48's bars, where this run measured both sides: output tok/s at 32 and 128 concurrent requests at
    least 0.85 of the decode program's at those rows, TTFT p50 at 32 at most 3 prefills, TPOT at 1 within 1.1x of
    the one-row decode program's time per token."""
    decode, prefill, levels, lines = results.get("decode_ms_per_token", {}), results.get("prefill_ms"), \
        results["levels"], []
    for level in (32, 128):
        if level in levels and level in decode:
            per_token = decode[level] / program_rows(results, level) / 1e3  # the decode program's seconds a token
            ratio = levels[level]["output_throughput"] * per_token
            best = schedule_ceiling(results, level)
            reach = f"; the timed programs' ceiling is {best * per_token:.2f} of it" if best else ""
            lines.append(f"output tok/s at {level}: {ratio:.2f} of the decode program's (bar 0.85){reach}")
    if 32 in levels and prefill:
        lines.append(f"TTFT p50 at 32: {levels[32]['median_ttft_ms'] / prefill:.2f} prefills (bar 3)")
    if 1 in levels and 1 in decode:
        lines.append(f"TPOT p50 at 1: {levels[1]['median_tpot_ms'] / decode[1]:.2f}x the decode program's (bar 1.1)")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    show_progress_logs()
    results = {"args": vars(args), "server_flags": server_flags(args), "levels": {}, "rates": {}}
    start = time.monotonic()
    server, engine = build_server(args)
    results["server_startup_s"] = time.monotonic() - start
    log(f"server built in {results['server_startup_s']:.0f}s")
    try:
        with server:
            for level in args.level_list:
                prompts = min(args.prompts_per_level * level, args.max_prompts)
                results["levels"][level] = load(args, f"c{level}", level, math.inf, prompts)
                save(args, results)
            for rate in args.rate_list:
                prompts = min(args.max_prompts, max(args.prompts_per_level, math.ceil(30 * rate)))  # ~30 s of load
                results["rates"][rate] = load(args, f"r{rate:g}", None, rate, prompts)
                save(args, results)
    finally:
        engine.shutdown(drain_seconds=0)
    log("server stopped")
    measure_programs(args, results, engine)
    save(args, results)
    print(table(results), flush=True)
    log(f"results in {os.path.join(args.out, 'sweep.json')}")


if __name__ == "__main__":
    main()
