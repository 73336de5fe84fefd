"""The converted checkpoint directory: an orbax PyTree checkpoint of the model's parameters, and its manifest.

    OUT_DIR/
      config.json, tokenizer files ...   copied from the source
      params/                            orbax checkpoint (non-OCDBT: one zarr array per parameter)
      inkling-convert.json               the manifest, written last (source hashes, dtype, tree, mesh)

Orbax itself writes the tree metadata (`params/_METADATA`) from a skeleton of the tree, tensorstore each
parameter's zarr metadata; the converter then writes the chunk files region by region (`write_region`), so no
whole tree is ever in memory.
The result restores with plain orbax (`StandardCheckpointer().restore`) as well as with `restore_params`,
which reads straight into the requested shardings (each process reads only the chunks its devices hold).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import math
import mmap
import os
import threading

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from inkling_jax.checkpoint.safetensors_io import CheckpointError

MANIFEST = "inkling-convert.json"
PARAMS_DIR = "params"
FORMAT = "inkling-jax/orbax-params/1"
ALIGN = 4096  # O_DIRECT writes whole pages from page-aligned memory


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def read_manifest(path: str) -> dict:
    with open(os.path.join(os.fspath(path), MANIFEST)) as fh:
        manifest = json.load(fh)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{os.path.join(path, MANIFEST)}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def param_key(path: tuple) -> str:
    """("layers", 3, "attn", "wq", "kernel") -> "layers.3.attn.wq.kernel" (orbax's name for the leaf)."""
    return ".".join(str(p) for p in path)


def nested(leaves: dict[tuple, object]) -> dict:
    """{path: value} -> the nested dict of string keys orbax stores."""
    tree: dict = {}
    for path, value in leaves.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        node[str(path[-1])] = value
    return tree


def write_tree_metadata(params_dir: str, specs: dict[tuple, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Let orbax write the tree's metadata from a skeleton of one-element arrays (the arrays are rewritten
    with their real shapes by `create_array`); checks that orbax names each leaf as `param_key` does."""
    skeleton = nested({p: np.zeros((1,) * len(shape), dtype) for p, (shape, dtype) in specs.items()})
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as checkpointer:
        checkpointer.save(params_dir, args=ocp.args.PyTreeSave(skeleton))
    for path in specs:
        if not os.path.isdir(os.path.join(params_dir, param_key(path))):
            raise RuntimeError(f"orbax {ocp.__version__} did not store {path} as {param_key(path)}; the converter "
                               f"needs updating for this orbax version")


def context(io_threads: int = 16) -> ts.Context:
    """Writes are not synced one by one (`sync_tree` syncs everything once, before the output is renamed into
    place): a sync per chunk made tensorstore use about twice the CPU per GB."""
    return ts.Context({"file_io_concurrency": {"limit": io_threads}, "file_io_sync": False})


def sync_tree(directory: str) -> None:
    """fsync every file and directory under `directory` (data first, then the names). A write the disk
    could not take after all (a full disk) fails here, naming the file (whose path names the parameter)."""
    for root, _, files in os.walk(directory, topdown=False):
        for path in [os.path.join(root, name) for name in files] + [root]:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise OSError(e.errno, f"{path}: cannot sync to disk: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class ParamArray:
    """A parameter's zarr array as the converter fills it (`write_region`)."""

    path: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype


def create_array(params_dir: str, key: str, shape, dtype, chunks, ctx: ts.Context) -> ParamArray:
    """A new, uncompressed zarr array for one parameter (replacing the skeleton's): tensorstore writes its
    metadata; `write_region` writes its chunks."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(params_dir, key)},
            "metadata": {"compressor": None, "chunks": list(chunks), "shape": list(shape),
                         "dtype": _zarr_dtype(dtype), "dimension_separator": "."}}
    ts.open(spec, create=True, delete_existing=True, context=ctx).result()
    return ParamArray(os.path.join(params_dir, key), tuple(shape), tuple(chunks), np.dtype(dtype))


def write_region(array: ParamArray, index: tuple, data: np.ndarray) -> None:
    """Write `data` to `index` (slices that start on chunk boundaries and stop on one or at the array's end) as
    whole chunk files: an uncompressed zarr chunk is the chunk's bytes in C order, edge chunks padded. Files are
    written with O_DIRECT where the file system takes it: buffered writes of the converter's output cost about
    2 CPU s/GB on a VM whose page cache was full (copies plus reclaim), direct ones almost nothing. This is the
    one place parameter data is written (tests replace it to simulate a full disk)."""
    bounds = [(s.start or 0, array.shape[a] if s.stop is None else min(s.stop, array.shape[a]))
              for a, s in enumerate(index)]
    grid = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(bounds, array.chunks)]
    for where in itertools.product(*grid):
        part = np.asarray(data[tuple(slice(i * c - lo, min((i + 1) * c, hi) - lo)
                                     for i, c, (lo, hi) in zip(where, array.chunks, bounds))])
        key = ".".join(map(str, where)) or "0"
        _write_chunk(os.path.join(array.path, key), part, array.chunks, array.dtype)


def _write_chunk(path: str, part: np.ndarray, chunks: tuple[int, ...], dtype: np.dtype) -> None:
    nbytes = math.prod(chunks) * dtype.itemsize
    padded = -(-nbytes // ALIGN) * ALIGN
    if part.shape == chunks and part.flags.c_contiguous and part.ctypes.data % ALIGN == 0 and padded == nbytes:
        buffer = part.reshape(-1).view(np.uint8)  # already the chunk's bytes, aligned: no copy
    else:
        buffer = _scratch(padded)
        chunk = buffer[:nbytes].view(dtype).reshape(chunks)
        if part.shape != chunks:
            buffer[:nbytes] = 0
        chunk[tuple(slice(0, n) for n in part.shape)] = part
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o666)
        try:
            _write_all(fd, buffer)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: the file system does not take O_DIRECT
            raise
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _write_all(fd, buffer[:nbytes])
        finally:
            os.close(fd)
    if padded != nbytes:
        os.truncate(path, nbytes)


def _write_all(fd: int, buffer: np.ndarray) -> None:
    view, done = memoryview(buffer), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of this thread's, reused from chunk to chunk."""
    if getattr(_local, "buffer", None) is None or _local.buffer.nbytes < nbytes:
        _local.buffer = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    return _local.buffer[:nbytes]


def open_array(params_dir: str, key: str, ctx: ts.Context) -> ts.TensorStore:
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(params_dir, key)}}
    return ts.open(spec, open=True, read=True, context=ctx).result()


def read_region(array: ts.TensorStore, index: tuple) -> np.ndarray:
    return array[index].read().result()


def _zarr_dtype(dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def load_converted(directory: str, variables: dict, shardings: dict | None, batches=None, restored=None) -> None:
    """Fill the (abstract) model variables {path: nnx.Variable} from a converted directory, checking first
    that the stored tree is exactly the model's. shardings: {path: Sharding}; None puts all on one device.
    batches: lists of paths restored one list at a time (default: all at once), `restored(path)` called for each
    path of a list once it is set (loading.py quantises experts layer by layer so)."""
    import jax

    manifest = read_manifest(directory)
    where = os.path.join(os.fspath(directory), PARAMS_DIR)
    stored = manifest["params"]
    specs = {p: (tuple(v.get_value().shape), np.dtype(v.get_value().dtype)) for p, v in variables.items()}
    wanted = {param_key(p): shape for p, (shape, _) in specs.items()}
    for key in sorted(set(wanted) | set(stored)):
        if key not in stored:
            raise CheckpointError(f"{where}: missing parameter {key}; the config expects it")
        if key not in wanted:
            raise CheckpointError(f"{where}: unexpected parameter {key}; the config does not describe it")
        if tuple(stored[key]["shape"]) != wanted[key]:
            raise CheckpointError(f"{os.path.join(where, key)}: parameter {key} has shape {stored[key]['shape']}, "
                                  f"the config needs {list(wanted[key])}")
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = dict.fromkeys(specs, device)
    for batch in batches or [list(specs)]:
        part = {p: specs[p] for p in batch}
        for path, value in restore_params(directory, part, shardings, partial=len(part) < len(specs)).items():
            variables[path].set_value(value)
            if restored is not None:
                restored(path)


def restore_params(directory: str, specs: dict[tuple, tuple[tuple[int, ...], np.dtype]], shardings,
                   partial: bool = False) -> dict:
    """{path: jax.Array} restored from a converted directory, cast to the requested dtypes and placed with
    `shardings` ({path: Sharding}); partial: `specs` names only some of the stored parameters."""
    import jax

    target = nested({p: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[p])
                     for p, (shape, dtype) in specs.items()})
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                                               dtype=s.dtype), target)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        tree = checkpointer.restore(os.path.join(os.fspath(directory), PARAMS_DIR),
                                    args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                                **({"partial_restore": True} if partial else {})))
    out = {}
    for path in specs:
        node = tree
        for part in path:
            node = node[str(part)]
        out[path] = node
    return out
