"""The converted checkpoint directory: an orbax PyTree checkpoint of the model's parameters, and its manifest.

    OUT_DIR/
      config.json, tokenizer files ...   copied from the source
      params/                            orbax checkpoint (non-OCDBT: one zarr array per parameter)
      inkling-convert.json               the manifest, written last (source hashes, dtype, tree, mesh)

Orbax itself writes the tree metadata (`params/_METADATA`) from a skeleton of the tree, tensorstore each
parameter's zarr metadata; the converter then writes the chunk files region by region (`chunks.write_region`),
so no whole tree is ever in memory, and records each chunk file's checksum in the manifest.
The result restores with plain orbax (`StandardCheckpointer().restore`) as well as with `restore_params`,
which reads straight into the requested shardings (each process reads only the chunks its devices hold);
`load_converted` checks those chunks' checksums first. The manifest is checked field by field when read.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from inkling_jax.checkpoint.chunks import ParamArray, check_chunks, held_chunks
from inkling_jax.checkpoint.safetensors_io import CheckpointError

MANIFEST = "inkling-convert.json"
PARAMS_DIR = "params"
FORMAT = "inkling-jax/orbax-params/2"  # 2: a checksum per chunk file


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def read_manifest(path: str) -> dict:
    """The manifest of a converted directory, with every field its readers use checked."""
    file = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(file) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise CheckpointError(f"{file}: cannot read the manifest ({' '.join(str(e).split())})") from None
    found = manifest.get("format") if isinstance(manifest, dict) else f"a JSON {type(manifest).__name__}"
    if found != FORMAT:
        raise CheckpointError(f"{file}: format {found!r:.60}, expected {FORMAT!r} (convert the source again)")
    _check_manifest(file, manifest)
    return manifest


def _is_ints(value, least: int) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= least
                                           for v in value)


def _require(file: str, field: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise CheckpointError(f"{file}: field {field} is {value!r:.60}, expected {expected}")


def _check_manifest(file: str, m: dict) -> None:
    for field, kind, expected in (("dtype", str, "text"), ("params", dict, "an object"), ("source", dict, "an object")):
        _require(file, field, m.get(field), isinstance(m.get(field), kind), expected)
    for key, e in m["params"].items():
        at = f"params.{key}"
        _require(file, at, e, isinstance(e, dict), "an object")
        _require(file, f"{at}.shape", e.get("shape"), _is_ints(e.get("shape"), 0), "a list of sizes")
        _require(file, f"{at}.chunks", e.get("chunks"),
                 _is_ints(e.get("chunks"), 1) and len(e["chunks"]) == len(e["shape"]), "a chunk size per axis")
        _require(file, f"{at}.dtype", e.get("dtype"), e.get("dtype") in ("bfloat16", "float32"),
                 "bfloat16 or float32")
        count = math.prod(-(-s // c) for s, c in zip(e["shape"], e["chunks"]))
        crcs = e.get("chunk_crc32")
        _require(file, f"{at}.chunk_crc32", crcs, isinstance(crcs, list) and len(crcs) == count
                 and all(isinstance(c, str) for c in crcs), f"a list of {count} checksums")
    source = m["source"]
    _require(file, "source.quantization", source.get("quantization"), source.get("quantization") in (None, "NVFP4"),
             "null or NVFP4")
    files = source.get("files")
    _require(file, "source.files", files, isinstance(files, dict) and all(
        isinstance(f, dict) and isinstance(f.get("sha256"), str) for f in files.values()), "{file: {sha256}}")
    layout = source.get("layout")
    _require(file, "source.layout", layout, isinstance(layout, dict) and isinstance(layout.get("exact"), bool),
             "an object with exact: true or false")
    if layout["exact"]:
        headers, index = layout.get("headers"), layout.get("index")
        _require(file, "source.layout.headers", headers, isinstance(headers, dict) and all(
            isinstance(h, str) for h in headers.values()), "{file: header text}")
        _require(file, "source.layout.index", index, index is None or isinstance(index, str), "null or text")


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


def create_array(params_dir: str, key: str, shape, dtype, chunks, ctx: ts.Context) -> ParamArray:
    """A new, uncompressed zarr array for one parameter (replacing the skeleton's): tensorstore writes its
    metadata; `write_region` writes its chunks."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(params_dir, key)},
            "metadata": {"compressor": None, "chunks": list(chunks), "shape": list(shape),
                         "dtype": _zarr_dtype(dtype), "dimension_separator": "."}}
    ts.open(spec, create=True, delete_existing=True, context=ctx).result()
    return ParamArray(os.path.join(params_dir, key), tuple(shape), tuple(chunks), np.dtype(dtype))


def open_array(params_dir: str, key: str, ctx: ts.Context) -> ts.TensorStore:
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(params_dir, key)}}
    return ts.open(spec, open=True, read=True, context=ctx).result()


def _zarr_dtype(dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def load_converted(directory: str, variables: dict, shardings: dict | None, batches=None, restored=None,
                   verify: bool = True) -> None:
    """Fill the (abstract) model variables {path: nnx.Variable} from a converted directory, checking first
    that the stored tree is exactly the model's and (verify) that the chunk files this process's devices will
    read have the checksums the converter recorded. shardings: {path: Sharding}; None puts all on one device.
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
    if verify:
        arrays = {p: ParamArray.stored(where, param_key(p), stored[param_key(p)]) for p in specs}
        check_chunks(list(arrays.values()), {a.name: held_chunks(a, shardings[p]) for p, a in arrays.items()})
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
