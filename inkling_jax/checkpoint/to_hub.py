"""The converted orbax directory -> hub safetensors (`--to hf`), streaming, with the original names, the
interleaved gate/up rows and an index.

When the manifest kept the source's shard headers (a BF16/FP32 source whose every tensor the model uses), the
same files are written: the same headers byte for byte, the same data, so each file's sha256 is the one the
source had. Otherwise (an NVFP4 source, or another dtype) fresh shards of at most `max_shard_bytes` are written.
Every file is allocated at its final size and filled by position, so slabs are written in any order. The
parameters are read from their chunk files with each file's recorded checksum checked (`chunks.read_region`).
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import zlib

import numpy as np

from inkling_jax.checkpoint import orbax_io, slabs
from inkling_jax.checkpoint.chunks import ParamArray, read_region
from inkling_jax.checkpoint.destination import MARKER
from inkling_jax.checkpoint.loading import hub_layout, keeps_fp32
from inkling_jax.checkpoint.safetensors_io import (DTYPES, INDEX, CheckpointError, group_into_shards, header_bytes,
                                                   index_text, parse_header, shard_name)
from inkling_jax.checkpoint.slabs import TensorPlan, plan_tensor
from inkling_jax.checkpoint.streaming import Stream
from inkling_jax.checkpoint.to_orbax import ConversionError, Tuning, one_line
from inkling_jax.config import load_config


def _layout(manifest: dict, rules, hub_shapes, dtype: str | None, max_shard_bytes: int):
    """{file: header bytes}, {tensor: (file, data offset, dtype)} and the index text."""
    layout = manifest["source"]["layout"]
    headers, where = {}, {}
    if layout["exact"] and dtype is None:
        for file, text in layout["headers"].items():
            raw = text.encode("utf-8")
            headers[file] = struct.pack("<Q", len(raw)) + raw
            entries, _ = parse_header(raw, f"{orbax_io.MANIFEST}: the recorded header of {file}")
            for name, entry in entries.items():
                if name not in rules or tuple(entry["shape"]) != hub_shapes[name] or name in where:
                    raise CheckpointError(f"{orbax_io.MANIFEST}: the recorded header of {file} has tensor {name} "
                                          f"{entry['shape']}, which does not match the model")
                where[name] = (file, len(headers[file]) + entry["data_offsets"][0], np.dtype(DTYPES[entry["dtype"]]))
        missing = sorted(set(rules) - set(where))
        if missing:
            raise CheckpointError(f"{orbax_io.MANIFEST}: the recorded source headers lack tensor {missing[0]}")
        return headers, where, layout["index"]
    stored = dtype or manifest["dtype"]
    dtypes = {n: np.dtype("float32" if keeps_fp32(n) else stored) for n in rules}
    shards = group_into_shards(list(rules), lambda n: math.prod(hub_shapes[n]) * dtypes[n].itemsize,
                               max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        file = shard_name(i, len(shards))
        headers[file] = header_bytes([(n, dtypes[n], hub_shapes[n]) for n in names], {"format": "pt"})
        offset = len(headers[file])
        for name in names:
            where[name] = (file, offset, dtypes[name])
            offset += math.prod(hub_shapes[name]) * dtypes[name].itemsize
        weight_map.update(dict.fromkeys(names, file))
    total = sum(math.prod(hub_shapes[n]) * dtypes[n].itemsize for n in rules)
    return headers, where, index_text(weight_map, total)


def export(src: str, out: str, *, dtype: str | None = None, max_shard_bytes: int = 5 << 30,
           tuning: Tuning = Tuning(), progress: bool = True) -> dict:
    """Fill the empty directory `out` with the hub layout of converted directory `src`. Returns {"files": {file:
    size}, "exact": whether the source layout was kept, "crc32": {tensor: checksum of its slabs as written},
    "slab_rows": {tensor: rows per slab}}."""
    manifest = orbax_io.read_manifest(src)
    config = load_config(src)
    rules = hub_layout(config)
    params = manifest["params"]
    params_dir = os.path.join(src, orbax_io.PARAMS_DIR)
    missing = sorted({orbax_io.param_key(t) for r in rules.values() for t in r.targets} - set(params))
    if missing:
        raise CheckpointError(f"{os.path.join(src, orbax_io.MANIFEST)}: no parameter {missing[0]}; the config "
                              f"expects it")
    hub_shapes = {name: tuple(rule.hub_shape([tuple(params[orbax_io.param_key(t)]["shape"]) for t in rule.targets]))
                  for name, rule in rules.items()}
    headers, where, index = _layout(manifest, rules, hub_shapes, dtype, max_shard_bytes)
    arrays = {t: ParamArray.stored(params_dir, orbax_io.param_key(t), params[orbax_io.param_key(t)])
              for r in rules.values() for t in r.targets}
    sizes = {}
    for file, header in headers.items():
        sizes[file] = len(header) + sum(math.prod(hub_shapes[n]) * where[n][2].itemsize
                                        for n in where if where[n][0] == file)
        with open(os.path.join(out, file), "wb") as fh:
            fh.write(header)
            fh.truncate(sizes[file])
    crcs: dict[str, dict[int, int]] = {name: {} for name in rules}
    slab_rows: dict[str, int] = {}

    def write_slab(plan: TensorPlan, index: int, start: int, stop: int) -> None:
        file, offset, hub_dtype = where[plan.name]
        values = [read_region(arrays[t], plan.region(start, stop)) for t in plan.rule.targets]
        hub = np.ascontiguousarray(slabs.to_hub(plan.rule, values), dtype=hub_dtype)
        crcs[plan.name][index] = zlib.crc32(hub)
        row = hub.nbytes // max(stop - start, 1)
        path = os.path.join(out, file)
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                view, done = memoryview(hub.reshape(-1).view(np.uint8)), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + start * row + done)
            finally:
                os.close(fd)
        except OSError as e:
            raise ConversionError(f"{path}: cannot write tensor {plan.name}: {one_line(e)}") from None
        stream.advance(hub.nbytes)

    def produce(stream: Stream) -> None:
        for name, rule in rules.items():
            key = orbax_io.param_key(rule.targets[0])
            hub_itemsize = where[name][2].itemsize
            row_elems = math.prod(hub_shapes[name][1:])
            cost = row_elems * (hub_itemsize + 2 * len(rule.targets) * np.dtype(params[key]["dtype"]).itemsize)
            plan = plan_tensor(name, rule, hub_shapes[name], params[key]["shape"], chunks=params[key]["chunks"],
                               row_cost=cost, slab_bytes=tuning.slab_bytes)
            slab_rows[name] = plan.slab_rows
            for index, (start, stop) in enumerate(plan.slabs()):
                stream.submit((stop - start) * cost, lambda p=plan, i=index, a=start, b=stop: write_slab(p, i, a, b))

    total = sum(math.prod(hub_shapes[n]) * where[n][2].itemsize for n in rules)
    stream = Stream(workers=tuning.workers, budget=tuning.budget_bytes, total=total, desc="exporting",
                    progress=progress)
    stream.run([produce], parallel=1)
    if index is not None:  # None: a single-file source, which had no index
        with open(os.path.join(out, INDEX), "w") as fh:
            fh.write(index)
    for file in sorted(os.listdir(src)):
        if file not in (orbax_io.MANIFEST, orbax_io.PARAMS_DIR, MARKER) and os.path.isfile(os.path.join(src, file)):
            shutil.copyfile(os.path.join(src, file), os.path.join(out, file))
    orbax_io.sync_tree(out)
    return {"files": sizes, "exact": manifest["source"]["layout"]["exact"] and dtype is None,
            "crc32": {n: combine_crcs([c[i] for i in sorted(c)]) for n, c in crcs.items()}, "slab_rows": slab_rows}


def combine_crcs(values: list[int]) -> str:
    """One checksum of a hub tensor as written: the crc32 of its slabs' crc32s, in slab order."""
    return f"{zlib.crc32(np.asarray(values, '>u4').tobytes()):08x}"
