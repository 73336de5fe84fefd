"""Checkpoint conversion throughput against the raw read speed of the same files, measured in the same run.

Writes a synthetic hub-layout checkpoint with the `bench` preset's tensor shapes (random BF16 weights, written
block by block, never whole), evicts it from the page cache, reads it raw (the roofline: every file front to
back with the converter's number of readers, nothing else), evicts it again and converts it with
`python -m inkling_jax.checkpoint.convert` in a child process (its peak RSS is the child's ru_maxrss), then exports it
back with `--to hf`. The raw read is done twice, buffered and with O_DIRECT (which the converter uses where the
file system takes it); the faster is the roofline (100%). Prints one table (and writes it, with the numbers as
JSON, to --out); deletes everything it wrote unless --keep.

    python -m benchmarks.conversion [--layers auto|2..6] [--dir /tmp] [--readers 2] [--workers N] [--out DIR]
        [--keep]

--layers 2 (two dense layers) gives 7.3 GB, 3 (plus one MoE layer) 11.4 GB, 4 15.5 GB and the full 6-layer
preset 23.7 GB. The source, the orbax output and the export are on disk together: --layers auto takes the most
layers (3 at least) whose three copies fit in 90% of the free space.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.timing import versions
from inkling_jax.config import preset
from inkling_jax.checkpoint.hub_source import open_for_reading, read_bytes
from inkling_jax.checkpoint.loading import abstract_model, hub_layout, keeps_fp32, model_variables
from inkling_jax.checkpoint.safetensors_io import group_into_shards, header_bytes, shard_name
from inkling_jax.checkpoint.to_orbax import Tuning

BLOCK = 64 << 20
SHARD = 4 << 30


def hub_tensors(layers: int):
    """[(name, dtype, shape)] of the bench preset's hub layout, in layout order."""
    config = preset("bench").replace(num_layers=layers, local_layer_ids=tuple(i for i in range(layers) if (i + 1) % 6))
    variables = model_variables(abstract_model(config, np.dtype("bfloat16")))
    out = []
    for name, rule in hub_layout(config).items():
        shape = rule.hub_shape([tuple(variables[t].get_value().shape) for t in rule.targets])
        out.append((name, np.dtype("float32") if keeps_fp32(name) else np.dtype("bfloat16"), tuple(shape)))
    return config, out


def checkpoint_bytes(layers: int) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in hub_tensors(layers)[1])


def write_checkpoint(directory: str, layers: int) -> list[str]:
    """Shards of <= 4 GB, written in parallel; data comes from one random block, xor-ed with a per-block
    constant (distinct bytes everywhere, without generating gigabytes of random numbers)."""
    config, tensors = hub_tensors(layers)
    random_block = np.random.default_rng(0).integers(0, 1 << 16, BLOCK // 2, dtype=np.uint16)
    random_block = (random_block & 0x807F) | 0x3C00  # finite BF16 values of magnitude 2**-7 .. 2**-6
    shards = group_into_shards(tensors, lambda entry: math.prod(entry[2]) * entry[1].itemsize, SHARD)
    files = [os.path.join(directory, shard_name(i, len(shards))) for i in range(len(shards))]

    def write(i: int) -> None:
        counter = 1009 * i  # blocks of different shards differ
        with open(files[i], "wb") as fh:
            fh.write(header_bytes(shards[i], {"format": "pt"}))
            for _, dtype, shape in shards[i]:
                left = math.prod(shape) * dtype.itemsize
                while left:
                    counter += 1
                    block = (random_block ^ np.uint16(counter & 0x0F7F)).view(np.uint8)[: min(left, BLOCK)]
                    fh.write(block)
                    left -= block.nbytes
            fh.flush()
            os.fsync(fh.fileno())

    with cf.ThreadPoolExecutor(min(len(files), os.cpu_count() or 1)) as pool:
        list(pool.map(write, range(len(files))))
    weight_map = {name: os.path.basename(files[i]) for i, entries in enumerate(shards) for name, _, _ in entries}
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


def raw_read(files, readers: int, direct: bool) -> tuple[int, float, float]:
    """Read every file front to back in 64 MB blocks into one reused buffer per file, `readers` files at a
    time, buffered or with O_DIRECT (as the converter reads); (bytes, seconds, CPU s)."""
    def read(file):
        size, buffer = os.path.getsize(file), np.frombuffer(mmap.mmap(-1, BLOCK + 4096), np.uint8)
        fd, is_direct = open_for_reading(file) if direct else (os.open(file, os.O_RDONLY), False)
        try:
            for offset in range(0, size, BLOCK):
                read_bytes(fd, offset, min(BLOCK, size - offset), file, None, out=buffer, direct=is_direct)
        finally:
            os.close(fd)
        return size

    start, cpu = time.perf_counter(), time.process_time()
    with cf.ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, files))
    return total, time.perf_counter() - start, time.process_time() - cpu


def run_cli(args) -> tuple[float, float, float]:
    """Run the converter in a child (which finds inkling_jax as this process did: installed, or from the same
    working directory); (wall seconds, peak RSS in GB, CPU seconds) of that child, from wait4."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "inkling_jax.checkpoint.convert", *args, "--quiet"], stdout=log,
                                 stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode:
            log.seek(0)
            raise SystemExit(f"conversion failed: {log.read()[-2000:]}")
    return wall, usage.ru_maxrss * 1024 / 1e9, usage.ru_utime + usage.ru_stime


def choose_layers(choice: str, free: int) -> int:
    if choice != "auto":
        return int(choice)
    fitting = [n for n in range(3, 7) if 3 * checkpoint_bytes(n) <= 0.9 * free]
    if not fitting:
        raise SystemExit(f"{free / 1e9:.0f} GB free: not enough for three copies of the 3-layer checkpoint")
    return fitting[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.conversion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="auto", help="layers of the bench preset's checkpoint, or auto")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--readers", type=int, default=2, help="files read at once, raw and by the converter")
    parser.add_argument("--workers", type=int, default=Tuning.workers, help="the converter's threads")
    parser.add_argument("--out", default=None, help="directory for convert.md (the table) and convert.json")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints it wrote")
    parser.add_argument("--reads", default="auto", help="passed on to the converter")
    args = parser.parse_args(argv)
    free = shutil.disk_usage(args.dir).free
    layers = choose_layers(args.layers, free)
    _, tensors = hub_tensors(layers)
    size = checkpoint_bytes(layers)
    print(f"checkpoint: {size / 1e9:.2f} GB ({len(tensors)} tensors, bench preset, {layers} layers); "
          f"{free / 1e9:.0f} GB free in {args.dir}; {os.cpu_count()} CPUs, {args.workers} workers, "
          f"{args.readers} readers", flush=True)
    if free < 3.05 * size:
        raise SystemExit("not enough free disk for source, orbax output and export")
    root = tempfile.mkdtemp(prefix="inkling-convert-bench-", dir=args.dir)
    src, dst, back = (os.path.join(root, d) for d in ("hub", "orbax", "back"))
    os.makedirs(src)
    try:
        start = time.perf_counter()
        files = write_checkpoint(src, layers)
        print(f"generated in {time.perf_counter() - start:.0f} s", flush=True)
        baseline = run_cli(["--help"])[1]
        reads = {}
        for direct in (False, True):
            resident = evict(files)
            reads[direct] = raw_read(files, args.readers, direct)
            print(f"raw read{' (O_DIRECT)' if direct else ''}: {reads[direct][0] / reads[direct][1] / 1e9:.3f} GB/s",
                  flush=True)
        resident_after_convert_evict = evict(files)
        flags = ["--workers", str(args.workers), "--readers", str(args.readers)]
        flags += ["--reads", args.reads]
        wall, rss, cpu = run_cli(["--src", src, "--dst", dst, *flags])
        print(f"converted in {wall:.1f} s", flush=True)
        manifest = json.load(open(os.path.join(dst, "inkling-convert.json")))
        stream_s = manifest["stream"]["seconds"]
        out_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(dst) for f in fs)
        export_wall, export_rss, export_cpu = run_cli(["--src", dst, "--dst", back, "--to", "hf", *flags])
        identical = all(subprocess.run(["cmp", "-s", f, os.path.join(back, os.path.basename(f))]).returncode == 0
                        for f in files)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    total = reads[False][0]
    raw = max(nbytes / seconds for nbytes, seconds, _ in reads.values()) / 1e9  # the roofline: the faster read
    rows = [
        *((f"raw read{', O_DIRECT' if direct else ', buffered'}", total, seconds, cpu_s,
           f"{cpu_s / total * 1e9:.1f} CPU s/GB") for direct, (_, seconds, cpu_s) in reads.items()),
        ("hub -> orbax, streaming", total, stream_s, None, f"peak RSS {rss:.2f} GB"),
        ("hub -> orbax, whole command", total, wall, cpu,
         f"incl. start-up and checks; {cpu / total * 1e9:.1f} CPU s/GB"),
        ("orbax -> hub (--to hf), whole command", out_bytes, export_wall, export_cpu,
         f"peak RSS {export_rss:.2f} GB; {export_cpu / out_bytes * 1e9:.1f} CPU s/GB; files identical: {identical}"),
    ]
    installed = ", ".join(f"{k} {v}" for k, v in versions("jax", "orbax-checkpoint", "numpy").items())
    lines = [f"{time.strftime('%Y-%m-%d')}, python {sys.version.split()[0]}, {installed}",
             f"load average (1, 5, 15 min) at the end: {os.getloadavg()}; {os.cpu_count()} CPUs",
             f"page cache before raw read: {resident:.1%} resident; before conversion: "
             f"{resident_after_convert_evict:.1%}",
             f"memory: budget {manifest['memory']['budget_bytes'] / 1e9:.2f} GB, peak held "
             f"{manifest['memory']['peak_held_bytes'] / 1e9:.2f} GB; interpreter alone (--help) {baseline:.2f} GB; "
             f"largest tensor {max(math.prod(s) * d.itemsize for _, d, s in tensors) / 1e9:.2f} GB",
             "| phase | GB | s | GB/s | vs raw read | note |", "| --- | --- | --- | --- | --- | --- |"]
    for name, nbytes, seconds, _, note in rows:
        rate = nbytes / seconds / 1e9
        lines.append(f"| {name} | {nbytes / 1e9:.2f} | {seconds:.1f} | {rate:.3f} | {rate / raw:.0%} | {note} |")
    print("\n" + "\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "convert.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "convert.json"), "w") as fh:
            json.dump({"layers": layers, "source_bytes": total, "cpus": os.cpu_count(), "workers": args.workers,
                       "readers": args.readers, "files_identical": identical, "peak_rss_gb": rss,
                       "export_peak_rss_gb": export_rss, "memory": manifest["memory"],
                       "versions": manifest["versions"],
                       "phases": [{"phase": name, "bytes": nbytes, "seconds": seconds, "cpu_seconds": cpu_s,
                                   "vs_raw_read": nbytes / seconds / 1e9 / raw}
                                  for name, nbytes, seconds, cpu_s, _ in rows]}, fh, indent=1)


if __name__ == "__main__":
    main()
