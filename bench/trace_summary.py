"""Where a profiled program's device time went: the kernels of a `jax.profiler.trace(..., create_perfetto_trace=True)`
directory, summed by name per device, largest first.

    python bench/trace_summary.py TRACE_DIR [--top 25]

Only the GPU's stream lanes count (the trace's "XLA Ops" / "XLA Modules" lanes repeat the same time per op and
per program); on CPU traces nothing matches and the summary says so.
"""

import argparse
import collections
import glob
import gzip
import json
import os


def kernel_times(trace_dir: str) -> tuple[dict[str, collections.Counter], collections.Counter]:
    """({device process name: Counter(kernel name -> total microseconds)}, Counter(kernel name -> launches)) over
    every perfetto file in trace_dir."""
    totals: dict[str, collections.Counter] = {}
    launches: collections.Counter = collections.Counter()
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
            if not thread.get((e["pid"], e["tid"]), "").startswith("Stream"):
                continue
            totals.setdefault(process[e["pid"]], collections.Counter())[e["name"]] += float(e.get("dur", 0))
            launches[e["name"]] += 1
    return totals, launches


def summarize(trace_dir: str, top: int = 25) -> str:
    """A text table per device: total kernel time, then the `top` kernels by time."""
    lines = []
    totals, launches = kernel_times(trace_dir)
    for device, counts in sorted(totals.items()):
        total = sum(counts.values())
        lines.append(f"{trace_dir} {device}: {total / 1e3:.3f} ms of kernels, {len(counts)} distinct")
        for name, us in counts.most_common(top):
            lines.append(f"  {us / 1e3:9.3f} ms {100 * us / total:5.1f}% x{launches[name]:<5} {name[:140]}")
    return "\n".join(lines) or f"{trace_dir}: no GPU kernels in the trace"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summarize(args.trace_dir, args.top))
