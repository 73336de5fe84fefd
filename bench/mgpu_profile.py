"""Where a Mosaic GPU kernel's warpgroups spend their time: summaries of the in-kernel profiles that
PALLAS_MGPU_PROFILE_DIR makes the MoE kernels write (pallas_kernels/moe/mgpu.py), one line per kernel call.

    PALLAS_MGPU_PROFILE_DIR=/tmp/prof PYTHONPATH=. python SCRIPT   (run the kernels once, on the GPU)
    python bench/mgpu_profile.py /tmp/prof

Per call, over the warpgroups that ran pipeline steps (the compute warpgroups):
- span: a warpgroup's first record to its last, averaged; clocks of different SMs are not compared.
- busy: the share of the span inside each named range ("step": a pipeline step's work, "epilogue").
- step p50: a step's median length; wait p50: the median gap between consecutive steps of a tile (the
  warpgroup waiting for its next buffers), and tile gap p50: from an epilogue's end to the next tile's first step.
A step much longer than its bytes take at the read bandwidth, with the warpgroups busy most of the span, means the
compute warpgroups bound the kernel; short steps with long waits mean the memory stream does.
"""

import argparse
import collections
import glob
import json
import os

import numpy as np


def warpgroup_ranges(path: str) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
    """{(SM, warpgroup trace): [(range name, start us, end us)] in time order} from one trace file."""
    events = collections.defaultdict(list)
    for e in json.load(open(path))["traceEvents"]:
        events[(e["pid"], e["tid"])].append(e)
    out = {}
    for key, evs in events.items():
        open_ranges, ranges = [], []
        for e in sorted(evs, key=lambda e: (e["ts"], e["ph"] == "B")):  # a range ends before the next begins
            if e["ph"] == "B":
                open_ranges.append(e)
            elif e["ph"] == "E" and open_ranges:
                start = open_ranges.pop()
                ranges.append((start["name"], float(start["ts"]), float(e["ts"])))
        out[key] = sorted(ranges, key=lambda r: r[1])
    return out


def summarise(ranges: dict[tuple[int, int], list[tuple[str, float, float]]]) -> dict:
    spans, busy, steps, waits, tile_gaps = [], collections.Counter(), [], [], []
    for rs in ranges.values():
        if not any(name == "step" for name, _, _ in rs):  # the TMA warpgroup: only the profiler's own "Init"
            continue
        span = max(end for _, _, end in rs) - rs[0][1]
        spans.append(span)
        for name, start, end in rs:
            busy[name] += (end - start) / span if span > 0 else 0.0
            if name == "step":
                steps.append(end - start)
        for (prev, _, prev_end), (name, start, _) in zip(rs, rs[1:]):
            if name == "step" and prev in ("step", "epilogue"):
                (waits if prev == "step" else tile_gaps).append(start - prev_end)
    median = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    n = max(len(spans), 1)
    return dict(warpgroups=len(spans), span_us=median(spans) if spans else float("nan"),
                busy={name: share / n for name, share in sorted(busy.items())},
                step_p50_us=median(steps), wait_p50_us=median(waits), tile_gap_p50_us=median(tile_gaps),
                steps_per_warpgroup=len(steps) / n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile_dir")
    args = ap.parse_args()
    paths = sorted(glob.glob(os.path.join(args.profile_dir, "*.json")), key=os.path.getmtime)
    if not paths:
        raise SystemExit(f"no trace files in {args.profile_dir}: set PALLAS_MGPU_PROFILE_DIR before the kernels "
                         "are compiled, and run them on a GPU")
    for path in paths:
        s = summarise(warpgroup_ranges(path))
        busy = ", ".join(f"{name} {share:.2f}" for name, share in s["busy"].items())
        print(f"{os.path.basename(path)}: {s['warpgroups']} warpgroups, span {s['span_us']:.1f} us, busy {busy}; "
              f"{s['steps_per_warpgroup']:.1f} steps each, step p50 {s['step_p50_us']:.2f} us, wait p50 "
              f"{s['wait_p50_us']:.2f} us, tile gap p50 {s['tile_gap_p50_us']:.2f} us")


if __name__ == "__main__":
    main()
