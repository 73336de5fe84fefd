"""Where a profiled program's device time went: the kernels of a `jax.profiler.trace(..., create_perfetto_trace=True)`
directory, summed by name per device, largest first.

    python bench/trace_summary.py TRACE_DIR [--top 25]

Only the GPU's stream lanes count (the trace's "XLA Ops" / "XLA Modules" lanes repeat the same time per op and
per program); on CPU traces nothing matches and the summary says so. "busy" is the share of the span from the first
to the last kernel in which some kernel ran: the rest is the device waiting, split into gaps shorter than
--gap-us (between the kernels of a program) and longer ones (typically the host's work between program calls).
Busy alone misled us once: a 32-row decode trace at busy 0.87 looked like ~0.43 ms a step of gaps between
kernels, but inside its steps the gaps came to 39 us; the rest lay between the calls (bench/results/serve.md,
2026-12-02).
"""

import argparse
import collections
import glob
import gzip
import json
import os


def kernel_events(trace_dir: str) -> dict[str, list[tuple[float, float, str]]]:
    """{device process name: [(start us, duration us, kernel name)]} over every perfetto file in trace_dir."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    for path in glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True):
        with gzip.open(path, "rt") as f:
            events = json.load(f)["traceEvents"]
        process, thread = {}, {}
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                process[e["pid"]] = e["args"]["name"]
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                thread[(e["pid"], e["tid"])] = e["args"]["name"]
        for e in events:
            if e.get("ph") != "X" or "GPU" not in process.get(e["pid"], ""):
                continue
            if thread.get((e["pid"], e["tid"]), "").startswith("Stream"):
                out.setdefault(process[e["pid"]], []).append((float(e["ts"]), float(e.get("dur", 0)), e["name"]))
    return out


def idle_us(events: list[tuple[float, float, str]], gap_us: float) -> tuple[float, float, int]:
    """Time no kernel ran between the first and the last (kernels on several streams overlap): (in gaps shorter
    than gap_us, in longer ones, how many longer ones). The rest of the span is busy."""
    short = long = 0.0
    count, end = 0, None
    for start, dur, _ in sorted(events):
        if end is not None and start > end:
            if start - end < gap_us:
                short += start - end
            else:
                long, count = long + start - end, count + 1
        end = start + dur if end is None else max(end, start + dur)
    return short, long, count


def summarize(trace_dir: str, top: int = 25, gap_us: float = 20.0) -> str:
    """A text table per device: kernel time, busy share of the traced span, idle time in short and long gaps, then
    the `top` kernels by time."""
    lines = []
    for device, events in sorted(kernel_events(trace_dir).items()):
        times, launches = collections.Counter(), collections.Counter()
        for _, dur, name in events:
            times[name] += dur
            launches[name] += 1
        total = sum(times.values())
        span = max(t + d for t, d, _ in events) - min(t for t, _, _ in events)
        short, long, count = idle_us(events, gap_us)
        lines.append(f"{trace_dir} {device}: {total / 1e3:.3f} ms of kernels, {len(times)} distinct; busy "
                     f"{(span - short - long) / span:.2f} of the {span / 1e3:.3f} ms from first to last kernel")
        lines.append(f"  idle: {short / 1e3:.3f} ms in gaps under {gap_us:g} us, {long / 1e3:.3f} ms in {count} longer "
                     f"ones")
        for name, us in times.most_common(top):
            lines.append(f"  {us / 1e3:9.3f} ms {100 * us / total:5.1f}% x{launches[name]:<5} {name[:140]}")
    return "\n".join(lines) or f"{trace_dir}: no GPU kernels in the trace"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--gap-us", type=float, default=20.0, help="idle gaps at least this long count as between calls")
    args = p.parse_args()
    print(summarize(args.trace_dir, args.top, args.gap_us))
