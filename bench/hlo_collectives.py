"""The collectives of compiled programs, read from an XLA dump: which ones each program runs, their shapes and the
JAX source line that made them.

    XLA_FLAGS=--xla_dump_to=DUMP python bench/serve.py ...   # any run that compiles the programs
    python bench/hlo_collectives.py DUMP [--match decode]

A collective the sharding did not intend (an all-gather of a weight or of the whole cache) shows up here with
the shape it moves, where a trace only shows its time.
"""

import argparse
import collections
import glob
import os
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(\S+)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_SOURCE = re.compile(r'op_name="([^"]*)"(?:.*?source_file="([^"]*)".*?source_line=(\d+))?')


def collectives(path: str):
    """[(kind, result shape, op_name, source)] of one after-optimizations HLO text file."""
    found = []
    for line in open(path):
        m = _OP.search(line)
        if m is None:
            continue
        src = _SOURCE.search(line)
        op_name, source = (src.group(1), f"{os.path.basename(src.group(2))}:{src.group(3)}" if src.group(2) else "") \
            if src else ("", "")
        found.append((m.group(2), m.group(1), op_name, source))
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump_dir")
    p.add_argument("--match", default="", help="only modules whose file name contains this")
    p.add_argument("--kinds", default="all-gather,all-to-all,ragged-all-to-all,collective-permute",
                   help="kinds listed one by one (the others are only counted)")
    args = p.parse_args()
    listed = set(args.kinds.split(","))
    for path in sorted(glob.glob(os.path.join(args.dump_dir, "*after_optimizations.txt"))):
        if args.match not in os.path.basename(path):
            continue
        ops = collectives(path)
        if not ops:
            continue
        counts = collections.Counter(kind for kind, *_ in ops)
        print(f"{os.path.basename(path)}: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())))
        for (kind, shape, op_name, source), n in collections.Counter(op for op in ops if op[0] in listed).items():
            print(f"  {kind} {shape} x{n}  {source}  {op_name[-160:]}")


if __name__ == "__main__":
    main()
