"""Where a program's device time goes: the device's operations of a few calls, from a profiler trace, summed by
name, for a benchmark to print beside its timings (`--profile`).

`device_op_times` traces `calls` calls of a function (after one untraced warm-up call) with `jax.profiler`,
reads the Perfetto JSON the profiler writes beside its own files, and sums the durations of the complete events
of every device process (`/device:...`; on a CPU, where there is none, the host's XLA threads) by thread and
name. `op_table` prints the largest of them per thread, with each one's share of the thread's total.
"""

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def device_op_times(fn, calls: int = 5) -> dict[str, collections.Counter]:
    """Thread name -> Counter(operation name -> microseconds per call) over `calls` traced calls of fn()."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        path, = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    devices = {pid for pid, name in processes.items() if "/device:" in name}
    times: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in (e for e in events if e.get("ph") == "X"):
        thread = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        device_op = e["pid"] in devices if devices else "XLA" in thread
        if device_op:
            times[f"{processes.get(e['pid'], '')} {thread}"][e["name"]] += e.get("dur", 0.0) / calls
    return dict(times)


def op_table(times: dict[str, collections.Counter], top: int = 15) -> str:
    """The `top` largest operations of each thread: microseconds per call and share of the thread's total."""
    lines = []
    for thread, ops in sorted(times.items(), key=lambda item: -sum(item[1].values())):
        total = sum(ops.values())
        lines.append(f"{thread}: {total:.0f} us per call")
        lines += [f"  {us:10.1f} us  {us / total:6.1%}  {name[:100]}" for name, us in ops.most_common(top)]
    return "\n".join(lines)
