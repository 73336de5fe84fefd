"""Hub safetensors (BF16 or NVFP4) -> the converted orbax directory, streaming tensor by tensor.

One reader per source file (several files at once) reads the file front to back in slabs (O_DIRECT where the
file system takes it), hashing every byte (the sha256 the hub lists for the file); each slab of a model tensor
goes to a worker that decodes it (NVFP4: dequantises), applies the hub layout rule (transposes in cache-sized
tiles, `slabs.transpose_into`), casts it and writes its region of the orbax arrays. The bytes held at once stay
under a budget (`streaming.Stream`), and slabs reuse freed buffers (`streaming.BufferPool`, which keeps at most
the budget), so peak host memory is about `2 * budget + readers * slab_bytes` above the interpreter's own,
whatever the checkpoint's size. Reused buffers, tiled transposes and direct chunk writes keep the CPU per GB
low (see docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import time

import numpy as np
from jax.sharding import AbstractMesh

from inkling_jax.checkpoint import chunks, orbax_io
from inkling_jax.checkpoint.destination import MARKER
from inkling_jax.checkpoint.hub_source import HubSource, direct_span, open_for_reading, read_bytes
from inkling_jax.checkpoint.loading import abstract_model, check_shapes, check_tensor_names, hub_layout, model_variables
from inkling_jax.checkpoint.safetensors_io import INDEX
from inkling_jax.checkpoint.slabs import TensorPlan, contiguous, plan_tensor
from inkling_jax.checkpoint.streaming import BufferPool, Stream
from inkling_jax.config import load_config
from inkling_jax.parallel.mesh import MESH_AXES, parse_mesh_spec
from inkling_jax.parallel.rules import axes_of, logical_axes, spec_for


@dataclasses.dataclass(frozen=True)
class Tuning:
    workers: int = max(4, min(16, os.cpu_count() or 1))  # numpy, hashing, reads and tensorstore release the GIL
    readers: int = 2
    slab_bytes: int = 128 << 20
    chunk_bytes: int = 32 << 20
    budget_bytes: int = 2 * workers * slab_bytes  # slabs queued or converting; readers hold one more slab each
    # O_DIRECT reads skip the page-cache copy: less CPU on small hosts, slower reads on some large hosts' disks
    direct_reads: bool = (os.cpu_count() or 1) <= 4

    @classmethod
    def sized(cls, *, workers: int, readers: int, slab_bytes: int, chunk_bytes: int,
              direct_reads: bool = direct_reads) -> "Tuning":
        """A budget of two slabs per worker: one converting, one queued."""
        return cls(workers, readers, slab_bytes, chunk_bytes, 2 * workers * slab_bytes, direct_reads)


class ConversionError(OSError):
    """Writing the output failed (no space left, permissions ...); names the output file and the tensor."""


def source_dtype(source: HubSource) -> str:
    """The dtype to store when none is asked for: the embedding's (NVFP4 checkpoints keep it in BF16)."""
    dtype = np.dtype(source.checkpoint.file_of("model.llm.embed.weight").dtype("model.llm.embed.weight"))
    return dtype.name if dtype.name in ("bfloat16", "float32") else "float32"


def prepare(src: str, dtype: str | None, mesh: str | None, tuning: Tuning):
    """Open and check the source; the plan of every hub tensor. Raises before anything is written."""
    source = HubSource(src)
    config = load_config(src)
    rules = hub_layout(config)
    check_tensor_names(source, rules, config)
    dtype = dtype or source_dtype(source)
    variables = model_variables(abstract_model(config, np.dtype(dtype)))
    check_shapes(source, rules, variables)
    sizes = parse_mesh_spec(mesh)
    abstract_mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    plans = {}
    for name, rule in rules.items():
        var = variables[rule.targets[0]].get_value()
        shape, out = tuple(var.shape), np.dtype(var.dtype).itemsize
        spec = spec_for(logical_axes(rule.targets[0], len(shape)), shape, abstract_mesh)
        shard = [s // math.prod(sizes[a] for a in axes_of(p)) for s, p in zip(shape, spec)]
        hub_shape = source.shape(name)
        row_elems = math.prod(hub_shape[1:])
        cost = source.row_bytes(name) + row_elems * (source.dtype(name).itemsize + len(rule.targets) * out)
        plans[name] = plan_tensor(name, rule, hub_shape, shape, itemsize=out, shard_shape=shard, row_cost=cost,
                                  chunk_bytes=tuning.chunk_bytes, slab_bytes=tuning.slab_bytes)
    return source, config, dtype, sizes, variables, plans


def check_free_space(directory: str, plans: dict[str, TensorPlan], variables) -> None:
    """Refuse to start a conversion that cannot fit, naming the tensor it would run out at."""
    free = shutil.disk_usage(directory).free
    written = 0
    for name, plan in plans.items():
        for target in plan.rule.targets:
            var = variables[target].get_value()
            written += math.prod(var.shape) * np.dtype(var.dtype).itemsize
        if written > free:
            raise ConversionError(f"{directory}: not enough free space: {free / 1e9:.2f} GB free, the output "
                                  f"would run out at tensor {name} ({written / 1e9:.2f} GB written by then)")


def convert(src: str, out: str, *, dtype: str | None = None, mesh: str | None = None, tuning: Tuning = Tuning(),
            progress: bool = True) -> dict:
    """Fill the empty directory `out` with the conversion of hub directory `src`; returns the manifest. The
    caller makes the result atomic (`destination.taken`)."""
    source, config, dtype, sizes, variables, plans = prepare(src, dtype, mesh, tuning)
    check_free_space(os.path.dirname(os.path.abspath(out)), plans, variables)
    params_dir = os.path.join(out, orbax_io.PARAMS_DIR)
    specs = {path: (tuple(var.get_value().shape), np.dtype(var.get_value().dtype)) for path, var in variables.items()}
    orbax_io.write_tree_metadata(params_dir, specs)
    ctx = orbax_io.context()
    arrays, param_plan = {}, {}
    for plan in plans.values():
        for target in plan.rule.targets:
            key = orbax_io.param_key(target)
            arrays[target] = orbax_io.create_array(params_dir, key, *specs[target], plan.chunks, ctx)
            param_plan[target] = plan
    crcs: dict[tuple, dict[tuple, str]] = {t: {} for t in arrays}  # {target: {chunk position: crc32}}
    hashes: dict[str, dict] = {}

    pool = BufferPool(keep_bytes=tuning.budget_bytes)

    def convert_slab(plan: TensorPlan, start: int, stop: int, raw: np.ndarray, held: np.ndarray):
        """Convert and write one slab; `raw` (its bytes) is a view of the pool buffer `held`."""
        for target, value in zip(plan.rule.targets, plan.rule.to_model(source.decode(plan.name, start, stop, raw))):
            dtype, buffer = specs[target][1], None
            if not (value.flags.c_contiguous and value.dtype == dtype):
                buffer = pool.take(value.size * dtype.itemsize)
                value = contiguous(value, dtype, pool.array(buffer, value.shape, dtype))
            try:
                crcs[target].update(chunks.write_region(arrays[target], plan.region(start, stop), value))
            except Exception as e:  # tensorstore reports OS errors as ValueError
                raise ConversionError(f"{os.path.join(params_dir, orbax_io.param_key(target))}: cannot write "
                                      f"parameter {orbax_io.param_key(target)} (hub tensor {plan.name}): "
                                      f"{one_line(e)}") from None
            if buffer is not None:  # written and committed: tensorstore holds no reference to it any more
                pool.give(buffer)
        pool.give(held)

    def read_file(file: str):
        def produce(stream: Stream) -> None:
            path, digest = os.path.join(source.directory, file), hashlib.sha256()
            fd, direct = open_for_reading(path, direct=tuning.direct_reads)
            try:
                for seg in source.segments(file):
                    plan = plans.get(seg.tensor)
                    row = source.row_bytes(seg.tensor) if seg.tensor else 1
                    slabs = plan.slabs() if plan else _pieces(seg.end - seg.start, row, tuning.slab_bytes)
                    for start, stop in slabs:
                        stream.check()
                        offset, size = seg.start + start * row, (stop - start) * row
                        held = pool.take(direct_span(offset, size) if direct else size)
                        raw = read_bytes(fd, offset, size, path, seg.tensor, out=held, digest=digest, direct=direct)
                        stream.advance(size)
                        if not plan:
                            pool.give(held)
                            continue
                        stream.submit((stop - start) * plan.row_cost,
                                      functools.partial(convert_slab, plan, start, stop, raw, held))
            finally:
                os.close(fd)
            hashes[file] = {"sha256": digest.hexdigest(), "bytes": os.path.getsize(path)}
        return produce

    files = sorted(source.checkpoint.files)
    total = sum(os.path.getsize(os.path.join(source.directory, f)) for f in files)
    stream = Stream(workers=tuning.workers, budget=tuning.budget_bytes, total=total, desc="converting",
                    progress=progress)
    started = time.perf_counter()
    stream.run([read_file(f) for f in files], parallel=tuning.readers)
    seconds = time.perf_counter() - started
    checksums = {t: [crcs[t][where] for where in array.grid()] for t, array in arrays.items()}
    manifest = _manifest(source, plans, param_plan, specs, checksums, dtype, mesh, sizes)
    manifest["source"].update(files=hashes, side_files=_copy_side_files(source, out))
    manifest.update(memory={"budget_bytes": tuning.budget_bytes, "peak_held_bytes": stream.peak,
                            "largest_slab_bytes": max(p.slab_rows * p.row_cost for p in plans.values())},
                    stream={"source_bytes": total, "seconds": round(seconds, 3)})
    with open(os.path.join(out, orbax_io.MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1)
    orbax_io.sync_tree(out)
    return manifest


def _manifest(source: HubSource, plans, param_plan, specs, checksums, dtype: str, mesh, sizes) -> dict:
    params = {}
    for target, plan in param_plan.items():
        shape, dt = specs[target]
        params[orbax_io.param_key(target)] = {
            "shape": list(shape), "dtype": dt.name, "chunks": list(plan.chunks), "chunk_crc32": checksums[target]}
    return {"format": orbax_io.FORMAT, "dtype": dtype, "mesh": {"spec": mesh or "", "axes": sizes},
            "params": params, "num_params": len(params), "versions": _versions(),
            "source": {"directory": source.directory, "quantization": source.quantization,
                       "skipped_tensors": sorted(set(source.names) - set(plans)), **_layout(source, plans)}}


def _pieces(size: int, row: int, limit: int) -> list[tuple[int, int]]:
    rows, step = size // row, max(1, limit // row)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _copy_side_files(source: HubSource, out: str) -> dict[str, str]:
    """Copy config.json and every other non-weight file (tokenizer, generation config ...); returns the
    sha256 of every top-level file that is not a shard. An NVFP4 source's quantisation settings are dropped:
    the output holds dequantised weights."""
    copied = {}
    for file in sorted(os.listdir(source.directory)):
        path = os.path.join(source.directory, file)
        if not os.path.isfile(path) or file.endswith(".safetensors") or file == MARKER:
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        copied[file] = hashlib.sha256(data).hexdigest()
        if file == INDEX or (source.quantization and file == "hf_quant_config.json"):
            continue  # the index describes the source shards; the manifest keeps it for `--to hf`
        if source.quantization and file == "config.json":
            config = json.loads(data)
            config.pop("quantization_config", None)
            data = json.dumps(config, indent=2).encode()
        with open(os.path.join(out, file), "wb") as fh:
            fh.write(data)
    return copied


def _layout(source: HubSource, plans) -> dict:
    """What `--to hf` needs to write the original files back byte for byte: each shard's header and the index,
    when every tensor of the source is a model tensor stored as it was (not NVFP4, none skipped)."""
    exact = not source.quantization and set(source.checkpoint.names) == set(plans)
    headers = {}
    for file, st in source.checkpoint.files.items():
        with open(st.path, "rb") as fh:
            headers[file] = fh.read(st.data_start)[8:].decode("utf-8")
    index = None
    if os.path.exists(os.path.join(source.directory, INDEX)):
        with open(os.path.join(source.directory, INDEX)) as fh:
            index = fh.read()
    return {"layout": {"exact": exact, "headers": headers if exact else None, "index": index if exact else None}}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("inkling-jax", "jax", "orbax-checkpoint", "tensorstore"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
