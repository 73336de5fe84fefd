"""`--verify`: what was written reads back as written (tensor counts, shapes, dtypes and the checksum of every
chunk file, always), and for models that fit in host memory the source and the converted checkpoint give
identical logits. Exporting back to the hub layout additionally checks each file's sha256 against the source's
when the original layout was kept. Every check raises `VerificationError` naming the file and the tensor."""

from __future__ import annotations

import hashlib
import math
import os
import zlib

import jax.numpy as jnp
import numpy as np

from inkling_jax.checkpoint import orbax_io
from inkling_jax.checkpoint.chunks import ParamArray, check_chunks
from inkling_jax.checkpoint.hub_source import HubSource
from inkling_jax.checkpoint.loading import (
    abstract_model,
    check_shapes,
    check_tensor_names,
    fill_variables,
    hub_layout,
    load_pretrained,
    model_variables,
)
from inkling_jax.checkpoint.safetensors_io import CheckpointError, HubCheckpoint
from inkling_jax.checkpoint.to_hub import combine_crcs
from inkling_jax.config import load_config

LOGIT_TOKENS = 8


class VerificationError(CheckpointError):
    """The converted checkpoint does not read back as it was written."""


def verify_orbax(out: str, src: str) -> list[str]:
    """Checks of a freshly converted directory `out` against its source hub directory; returns report lines."""
    manifest = orbax_io.read_manifest(out)
    params_dir = os.path.join(out, orbax_io.PARAMS_DIR)
    config = load_config(out)
    variables = model_variables(abstract_model(config, np.dtype(manifest["dtype"])))
    stored = sorted(d for d in os.listdir(params_dir) if os.path.isfile(os.path.join(params_dir, d, ".zarray")))
    if len(stored) != len(variables) or len(manifest["params"]) != len(variables):
        raise VerificationError(f"{params_dir}: {len(stored)} arrays and {len(manifest['params'])} manifest entries "
                                f"for a model of {len(variables)} parameters")
    ctx = orbax_io.context()
    for key, entry in manifest["params"].items():
        where = os.path.join(params_dir, key)
        array = orbax_io.open_array(params_dir, key, ctx)
        found = (list(array.shape), np.dtype(array.dtype.numpy_dtype).name)
        if found != (entry["shape"], entry["dtype"]):
            raise VerificationError(f"{where}: parameter {key} is {found[1]} {found[0]}, the manifest says "
                                    f"{entry['dtype']} {entry['shape']}")
    arrays = [ParamArray.stored(params_dir, key, entry) for key, entry in manifest["params"].items()]
    try:
        check_chunks(arrays)
    except CheckpointError as e:
        raise VerificationError(str(e)) from None
    lines = [f"verified {len(variables)} parameters: shapes, dtypes and the checksums of "
             f"{sum(len(a.crc32) for a in arrays)} chunk files"]
    if not _fits(variables, copies=2):
        return lines + ["logits not compared: two copies of the model do not fit in host memory"]
    dtype = manifest["dtype"]
    if manifest["source"]["quantization"]:
        source_model = abstract_model(load_config(src), np.dtype(dtype))
        fill_variables(HubSource(src), hub_layout(source_model.config), model_variables(source_model),
                       lambda _, x: jnp.asarray(x))
    else:
        source_model = load_pretrained(src, dtype, progress=False)
    return lines + [_compare_logits(source_model, load_pretrained(out, dtype, progress=False), src, out)]


def verify_hub(out: str, src: str, summary: dict) -> list[str]:
    """Checks of an exported hub directory `out` against the converted directory `src` it came from."""
    manifest = orbax_io.read_manifest(src)
    config = load_config(out)
    model = abstract_model(config, np.dtype(manifest["dtype"]))
    variables, rules = model_variables(model), hub_layout(config)
    checkpoint = HubCheckpoint(out)
    check_tensor_names(checkpoint, rules, config)
    check_shapes(checkpoint, rules, variables)
    for name, expected in summary["crc32"].items():
        tensor = checkpoint.read(name)
        rows = max(summary["slab_rows"][name], 1)
        crc = combine_crcs([_crc(tensor[a:a + rows]) for a in range(0, max(tensor.shape[0], 1), rows)])
        if crc != expected:
            raise VerificationError(f"{checkpoint.path_of(name)}: tensor {name} reads back with checksum {crc}, "
                                    f"{expected} was written")
    lines = [f"verified {len(rules)} tensors: names, shapes and checksums"]
    if summary["exact"]:
        for file, entry in manifest["source"]["files"].items():
            digest = _sha256(os.path.join(out, file))
            if digest != entry["sha256"]:
                raise VerificationError(f"{os.path.join(out, file)}: sha256 {digest} differs from the source "
                                        f"file's {entry['sha256']}")
        lines.append(f"all {len(manifest['source']['files'])} files are byte-identical to the source files")
    if not _fits(variables, copies=2):
        return lines + ["logits not compared: two copies of the model do not fit in host memory"]
    dtype = manifest["dtype"]
    return lines + [_compare_logits(load_pretrained(src, dtype, progress=False),
                                    load_pretrained(out, dtype, progress=False), src, out)]


def _compare_logits(reference, converted, src: str, out: str) -> str:
    vocab = reference.config.text.unpadded_vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, (1, LOGIT_TOKENS)).astype(np.int32)
    a, b = np.asarray(reference(ids), np.float32), np.asarray(converted(ids), np.float32)
    if not np.array_equal(a, b):
        raise VerificationError(f"{out}: logits differ from those of {src} (max abs difference "
                                f"{np.abs(a - b).max():.3g} over {LOGIT_TOKENS} tokens)")
    return f"logits on {LOGIT_TOKENS} tokens are identical to the source's"


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(64 << 20):
            digest.update(block)
    return digest.hexdigest()


def _fits(variables, copies: int) -> bool:
    need = copies * sum(math.prod(v.get_value().shape) * np.dtype(v.get_value().dtype).itemsize
                        for v in variables.values())
    try:
        with open("/proc/meminfo") as fh:
            available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need < available // 2
