"""Where a profiled program's kernels come from: the source lines behind instructions of an optimised HLO dump.

    XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_pass_re=NONE python run.py    # any program; then
    python bench/hlo_sources.py DIR/module_*after_optimizations.txt input_reduce_fusion_4 fusion_506 ...

A trace names each XLA kernel after its HLO instruction, with '.' written as '_' (`input_scatter_fusion.29` runs
as `input_scatter_fusion_29`, `sort.28.1` as `sort_28_1`). The dump keeps, per instruction, the Python stack
that built it (its `stack_frame_id` into the module's FileNames / FunctionNames / FileLocations / StackFrames
tables). Frames from installed packages (jax, flax) are left out. Without names, every fusion of the entry
computation is listed.
"""

import argparse
import re

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def source_tables(text: str) -> dict[str, dict[int, str]]:
    """The dump's stack tables: {table name: {id: its line's text}}."""
    tables, current = {}, None
    for line in text.splitlines():
        if line in _TABLES:
            current = tables.setdefault(line, {})
        elif current is not None and re.match(r"\d+ ", line):
            key, value = line.split(" ", 1)
            current[int(key)] = value
        elif current is not None:
            current = None
    return tables


def frames(tables: dict[str, dict[int, str]], frame_id: int) -> list[tuple[str, str, int]]:
    """(file, function, line) from the innermost frame outwards. A frame's printed parent_frame_id is its
    parent's id plus one (0: none), as the dumps of jax 0.10 / 0.11 print them."""
    out, seen = [], set()
    while frame_id in tables.get("StackFrames", {}) and frame_id not in seen:
        seen.add(frame_id)
        location, parent = (int(v) for v in re.findall(r"=(\d+)", tables["StackFrames"][frame_id]))
        file_id, function_id, line = (int(v) for v in re.findall(r"=(\d+)", tables["FileLocations"][location])[:3])
        out.append((tables["FileNames"][file_id].strip('"'), tables["FunctionNames"][function_id].strip('"'), line))
        frame_id = parent - 1
    return out


def instruction_sources(text: str, names: list[str] | None = None, keep_library: bool = False):
    """{name: (shape, op_name, frames)} for trace kernel names (or HLO instruction names); names=None: every
    fusion of the entry computation. A name the dump lacks (a custom call's kernel, cuBLAS) is left out."""
    tables = source_tables(text)
    entry = text[text.index("\nENTRY "):] if "\nENTRY " in text else text
    if names is None:
        names = re.findall(r"^\s+(?:ROOT )?%(\S+) = \S+ fusion\(", entry, re.M)
    found = {}
    for name in names:
        # trace names write some of the instruction's '.' as '_': the last one, or every one before a number
        candidates = dict.fromkeys([name, re.sub(r"_(\d+)$", r".\1", name), re.sub(r"_(\d+)", r".\1", name)])
        for candidate in candidates:
            match = re.search(r"%" + re.escape(candidate) + r" = (\S+) [^\n]*?op_name=\"([^\"]*)\""
                              r"(?:[^\n]*?stack_frame_id=(\d+))?", text)
            if match:
                stack = frames(tables, int(match.group(3))) if match.group(3) else []
                if not keep_library:
                    stack = [f for f in stack if "site-packages" not in f[0]]
                found[name] = (match.group(1), match.group(2), stack)
                break
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hlo", help="an optimised HLO text dump (*after_optimizations.txt)")
    p.add_argument("names", nargs="*", help="kernel or instruction names (default: every entry fusion)")
    p.add_argument("--depth", type=int, default=3, help="frames shown per instruction")
    args = p.parse_args()
    with open(args.hlo) as f:
        found = instruction_sources(f.read(), args.names or None)
    for name, (shape, op_name, stack) in found.items():
        where = " < ".join(f"{file.rsplit('/', 1)[-1]}:{function}:{line}"
                           for file, function, line in stack[:args.depth])
        print(f"{name:40s} {shape[:30]:30s} {where or op_name}")


if __name__ == "__main__":
    main()
