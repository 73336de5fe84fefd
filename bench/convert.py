"""Checkpoint conversion throughput against the raw read speed of the same files, measured in the same run.

Writes a synthetic hub-layout checkpoint with the `bench` preset's tensor shapes (random BF16 weights, written
block by block, never whole), evicts it from the page cache, reads it raw (the roofline: every file front to
back with the converter's number of readers, nothing else), evicts it again and converts it with
`python -m inkling_jax.convert` in a child process (its peak RSS is the child's ru_maxrss), then exports it
back with `--to hf`. Prints one table; deletes everything it wrote unless --keep.

    python bench/convert.py [--layers 3] [--dir /tmp] [--readers 2] [--workers 4] [--keep]

--layers 3 (two dense layers, one MoE layer) gives 11.4 GB; the full 6-layer preset gives 23.7 GB.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inkling_jax.config import preset  # noqa: E402
from inkling_jax.hub_source import read_bytes  # noqa: E402
from inkling_jax.loading import _keeps_fp32, abstract_model, hub_layout, model_variables  # noqa: E402
from inkling_jax.to_hub import group_into_shards, header_bytes, shard_name  # noqa: E402

BLOCK = 64 << 20
SHARD = 4 << 30


def hub_tensors(layers: int):
    """[(name, dtype, shape)] of the bench preset's hub layout, in layout order."""
    config = preset("bench").replace(num_layers=layers, local_layer_ids=tuple(i for i in range(layers) if (i + 1) % 6))
    variables = model_variables(abstract_model(config, np.dtype("bfloat16")))
    out = []
    for name, rule in hub_layout(config).items():
        shape = rule.hub_shape([tuple(variables[t].get_value().shape) for t in rule.targets])
        out.append((name, np.dtype("float32") if _keeps_fp32(name) else np.dtype("bfloat16"), tuple(shape)))
    return config, out


def write_checkpoint(directory: str, layers: int) -> list[str]:
    """Shards of <= 4 GB; data comes from one random block, xor-ed with a per-block constant (distinct bytes
    everywhere, without generating gigabytes of random numbers)."""
    config, tensors = hub_tensors(layers)
    random_block = np.random.default_rng(0).integers(0, 1 << 16, BLOCK // 2, dtype=np.uint16)
    random_block = (random_block & 0x807F) | 0x3C00  # finite BF16 values of magnitude 2**-7 .. 2**-6
    shards = group_into_shards(tensors, lambda entry: math.prod(entry[2]) * entry[1].itemsize, SHARD)
    files, weight_map, counter = [], {}, 0
    for i, entries in enumerate(shards):
        file = os.path.join(directory, shard_name(i, len(shards)))
        with open(file, "wb") as fh:
            fh.write(header_bytes(entries, {"format": "pt"}))
            for name, dtype, shape in entries:
                left = math.prod(shape) * dtype.itemsize
                while left:
                    counter += 1
                    block = (random_block ^ np.uint16(counter & 0x0F7F)).view(np.uint8)[: min(left, BLOCK)]
                    fh.write(block)
                    left -= block.nbytes
                weight_map[name] = os.path.basename(file)
            fh.flush()
            os.fsync(fh.fileno())
        files.append(file)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config.to_dict(), fh)
    return files


def evict(files) -> float:
    """Drop the files from the page cache; returns the fraction still resident (per fincore, when present)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if not shutil.which("fincore"):
        return float("nan")
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *files],
                         capture_output=True, text=True).stdout.split()
    resident, size = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
    return resident / size


def raw_read(files, readers: int) -> tuple[int, float, float]:
    """Read every file front to back in 64 MB blocks, `readers` files at a time; (bytes, seconds, CPU s)."""
    def read(file):
        size = os.path.getsize(file)
        fd = os.open(file, os.O_RDONLY)
        try:
            for offset in range(0, size, BLOCK):
                read_bytes(fd, offset, min(BLOCK, size - offset), file, None)
        finally:
            os.close(fd)
        return size

    start, cpu = time.perf_counter(), time.process_time()
    with cf.ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, files))
    return total, time.perf_counter() - start, time.process_time() - cpu


def run_cli(args) -> tuple[float, float, float]:
    """Run the converter in a child; (wall seconds, peak RSS in GB, CPU seconds) of that child, from wait4."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "inkling_jax.convert", *args, "--quiet"], stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": root})
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode:
            log.seek(0)
            raise SystemExit(f"conversion failed: {log.read()[-2000:]}")
    return wall, usage.ru_maxrss * 1024 / 1e9, usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    _, tensors = hub_tensors(args.layers)
    size = sum(math.prod(s) * d.itemsize for _, d, s in tensors)
    free = shutil.disk_usage(args.dir).free
    print(f"checkpoint: {size / 1e9:.2f} GB ({len(tensors)} tensors, bench preset, {args.layers} layers); "
          f"{free / 1e9:.0f} GB free in {args.dir}")
    if free < 3.2 * size:
        raise SystemExit("not enough free disk for source, orbax output and export")
    root = tempfile.mkdtemp(prefix="inkling-convert-bench-", dir=args.dir)
    src, dst, back = (os.path.join(root, d) for d in ("hub", "orbax", "back"))
    os.makedirs(src)
    try:
        start = time.perf_counter()
        files = write_checkpoint(src, args.layers)
        print(f"generated in {time.perf_counter() - start:.0f} s")
        baseline = run_cli(["--help"])[1]
        resident = evict(files)
        total, read_s, read_cpu = raw_read(files, args.readers)
        resident_after_convert_evict = evict(files)
        flags = ["--workers", str(args.workers), "--readers", str(args.readers)]
        wall, rss, cpu = run_cli(["--src", src, "--dst", dst, *flags])
        manifest = json.load(open(os.path.join(dst, "inkling-convert.json")))
        stream_s = manifest["stream"]["seconds"]
        out_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(dst) for f in fs)
        export_wall, export_rss, export_cpu = run_cli(["--src", dst, "--dst", back, "--to", "hf", *flags])
        identical = all(subprocess.run(["cmp", "-s", f, os.path.join(back, os.path.basename(f))]).returncode == 0
                        for f in files)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    raw = total / read_s / 1e9
    rows = [
        ("raw read (roofline)", total, read_s, f"{read_cpu / total * 1e9:.1f} CPU s/GB"),
        ("hub -> orbax, streaming", total, stream_s, f"peak RSS {rss:.2f} GB"),
        ("hub -> orbax, whole command", total, wall, f"incl. start-up and checks; {cpu / total * 1e9:.1f} CPU s/GB"),
        ("orbax -> hub (--to hf), whole command", out_bytes, export_wall,
         f"peak RSS {export_rss:.2f} GB; {export_cpu / out_bytes * 1e9:.1f} CPU s/GB; files identical: {identical}"),
    ]
    print(f"\nload average (1, 5, 15 min) at the end: {os.getloadavg()}; {os.cpu_count()} CPUs")
    print(f"page cache before raw read: {resident:.1%} resident; before conversion: "
          f"{resident_after_convert_evict:.1%}")
    print(f"memory: budget {manifest['memory']['budget_bytes'] / 1e9:.2f} GB, peak held "
          f"{manifest['memory']['peak_held_bytes'] / 1e9:.2f} GB; interpreter alone (--help) {baseline:.2f} GB; "
          f"largest tensor {max(math.prod(s) * d.itemsize for _, d, s in tensors) / 1e9:.2f} GB")
    print("| phase | GB | s | GB/s | vs raw read | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, nbytes, seconds, note in rows:
        rate = nbytes / seconds / 1e9
        print(f"| {name} | {nbytes / 1e9:.2f} | {seconds:.1f} | {rate:.3f} | {rate / raw:.0%} | {note} |")


if __name__ == "__main__":
    main()
