"""The engine thread's host work per decode step against the device time of the step it dispatches.

    python -m benchmarks.engine_host [--preset bench] [--rows 1,32,128] [--steps 64] [--out DIR]

A step's host work (scheduling, the step's inputs, reading its samples, applying them to their sequences, turning
each token into text and handing the outputs to their requests) runs while the device runs the step queued
behind it (`serve.engine.steps_ahead`). Where the host work takes longer than the device's step, the server is
bound by its host at that load. The server's engine (serve.app's, random weights, one token per device call:
`--decode-steps 1`, the steps of a server that keeps admitting requests) decodes `rows` requests at a time; the
engine thread's CPU time per step and its parts are set against the decode program alone at those rows, timed on
the same engine afterwards (`benchmarks.programs`). `--preset tiny --server-args ...` runs on a CPU, where
the device is the CPU too. Writes engine_host.json into --out.
"""

import argparse
import collections
import json
import os
import shlex
import sys
import threading
import time

import numpy as np

# The engine's methods whose engine-thread CPU time is counted: the step, and the parts of it
PARTS = (("step", "engine"), ("schedule", "scheduler"), ("dispatch", "runner"), ("collect", "runner"),
         ("_apply", "engine"), ("_apply_ahead", "engine"), ("_fill", "engine"), ("_report", "engine"),
         ("_update_gauges", "engine"))
APPLY = ("_apply", "_apply_ahead", "_fill")  # a step's samples applied once read, or ahead and filled in


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench", help="the random-weights model (tiny: the plumbing, on a CPU)")
    p.add_argument("--rows", default="1,32,128", help="requests decoding at once, one level after another")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed at each level")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--server-args", default="", help="more serve.app flags (e.g. the tiny preset's row buckets)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for engine_host.json")
    args = p.parse_args(argv)
    args.row_list = [int(r) for r in args.rows.split(",")]
    if min(args.row_list) < 1 or args.steps < 1 or args.prompt_len < 1:
        p.error("--rows, --steps and --prompt-len must be positive")
    return args


class ThreadClock:
    """Engine-thread CPU seconds and calls per counted method, wrapped on the live engine's objects. A part's
    seconds exclude those of the counted parts it calls (dispatch reports the step before while the device runs),
    so that the parts add up to the step's."""

    def __init__(self, engine):
        self.seconds, self.calls = collections.Counter(), collections.Counter()
        self._inner = [0.0]  # per open call: CPU seconds of the counted calls inside it
        owners = {"engine": engine, "scheduler": engine.scheduler, "runner": engine.runner}
        for name, owner in PARTS:
            setattr(owners[owner], name, self._timed(name, getattr(owners[owner], name)))

    def _timed(self, name, method):
        def timed(*args, **kwargs):
            start = time.thread_time()
            self._inner.append(0.0)
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self.seconds[name] += spent - self._inner.pop()
                self._inner[-1] += spent
                self.calls[name] += 1
        return timed

    def snapshot(self) -> tuple[collections.Counter, collections.Counter, float]:
        return collections.Counter(self.seconds), collections.Counter(self.calls), time.perf_counter()


def decode_level(service, clock: ThreadClock, rows: int, steps: int, prompt_len: int) -> dict:
    """`rows` requests decoded together, their tokens turned into text as the server's completions do: the engine
    thread's CPU ms per step (and per part), and the wall ms per step, over `steps` steps once every request
    decodes."""
    from serve.engine.sampling_params import SamplingParams
    from serve.http.text_stream import TextOutput

    warm = 4  # steps after the last prefill before the clock starts
    reached = {target: threading.Event() for target in (warm, warm + steps, warm + steps + 1)}
    counts = collections.Counter()  # target -> requests whose output reached it (one token an output)
    snapshots = {}  # target -> the clock when the last request reached it, taken on the engine thread

    def on_output(output):  # on the engine thread, inside the time it measures: O(1)
        target = output.num_output
        if target in reached:
            counts[target] += 1
            if counts[target] == rows:
                snapshots[target] = clock.snapshot()
                reached[target].set()

    params = SamplingParams(max_tokens=warm + steps + 1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(rows)
    for i in range(rows):
        service.engine.submit(f"host-{rows}-{i}", [rng.integers(0, service.vocab_size, prompt_len).tolist()], params,
                              1, lambda: TextOutput(service.tokenizer), on_output)
    for target in reached:  # the last: every request done before the next level
        if not reached[target].wait(timeout=600):
            raise SystemExit(f"{rows} rows: the requests did not reach {target} tokens in 600 s")
    (seconds0, calls0, wall0), (seconds1, calls1, wall1) = snapshots[warm], snapshots[warm + steps]
    host = {name: 1e3 * (seconds1[name] - seconds0[name]) / steps for name, _ in PARTS}
    return {"rows": rows, "steps": steps, "step_calls": calls1["step"] - calls0["step"],
            "wall_ms_per_step": 1e3 * (wall1 - wall0) / steps,
            "host_ms_per_step": {"total": sum(host.values()), **host}}


def table(results: dict) -> str:
    lines = ["| rows | engine thread CPU ms a step | schedule | dispatch | collect | apply | report | gauges | "
             "the rest | wall ms a step | decode program ms | host / program |", "|---:" * 12 + "|"]
    for level in results["levels"]:
        host = level["host_ms_per_step"]
        program = level.get("decode_program_ms")
        apply = sum(host[k] for k in APPLY)
        lines.append("| " + " | ".join([
            str(level["rows"]), f"{host['total']:.2f}",
            *(f"{host[k]:.2f}" for k in ("schedule", "dispatch", "collect")), f"{apply:.2f}",
            *(f"{host[k]:.2f}" for k in ("_report", "_update_gauges", "step")),
            f"{level['wall_ms_per_step']:.2f}", f"{program:.2f}" if program else "-",
            f"{host['total'] / program:.2f}" if program else "-"]) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import jax

    from benchmarks.programs import decode_program_seconds
    from benchmarks.timing import attempt, stamp, stamp_line
    from serve.app import build_service
    from serve.app import parse_args as server_args

    max_len = args.prompt_len + args.steps + 16
    flags = ["--random-weights", "--preset", args.preset, "--decode-steps", "1", "--max-num-seqs",
             str(max(args.row_list)), "--max-model-len", str(max_len), *shlex.split(args.server_args)]
    print("serving as: python -m serve.app " + shlex.join(flags), flush=True)
    service = build_service(server_args(flags))
    engine = service.engine
    clock = ThreadClock(engine)
    results = {"stamp": stamp(), "args": vars(args), "server_flags": flags, "levels": []}
    try:
        for rows in args.row_list:
            level = decode_level(service, clock, rows, args.steps, args.prompt_len)
            results["levels"].append(level)
            print(f"{rows} rows: engine thread {level['host_ms_per_step']['total']:.2f} ms CPU a step, wall "
                  f"{level['wall_ms_per_step']:.2f} ms", flush=True)
    finally:
        engine.shutdown(drain_seconds=0)
    context = args.prompt_len + args.steps // 2
    for level in results["levels"]:
        seconds = attempt(f"decode program, {level['rows']} rows",
                          lambda: decode_program_seconds(engine, level["rows"], context, steps=1))
        level["decode_program_ms"] = None if seconds is None else 1e3 * seconds
    print(stamp_line(results["stamp"]) + f"; preset {args.preset}, one token per call, {jax.default_backend()}")
    print(table(results))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_host.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
