"""NVFP4 (spec section 5.2): routed experts of layers 3.. stored as e2m1 values with e4m3 block scales.

A quantised `...experts.w13_weight` / `w2_weight` of shape [E, rows, cols] is stored as five tensors:
the packed weight U8 [E, rows, cols/2] (two e2m1 codes per byte, the even column in the low nibble, as
ModelOpt packs them), `.scale` F8_E4M3 [E, rows, cols/16] (one scale per 16 values along the input dim),
`.scale2` F32 [E] (a per-expert global scale), `.input_amax` [1] (activation amax, unused by a dequantised
model) and `.original_shape` I64 [3]. Dequantised: W = e2m1 * scale * scale2.

Error bound of `quantize` then `dequantize`, per element of a 16-value block with absolute maximum b:
    |W - deq(q(W))| <= (17/16) * b / 6 + 6 * 2**-10 * scale2
The grid's widest gap (4 to 6) is 2 units, so rounding moves a value by at most 1 unit of scale * scale2; the
e4m3 block scale lies within half an ulp of the exact b / (6 * scale2) (2**-4 relative when normal, 2**-10
absolute when subnormal), and values that the rounded scale pushes past 6 are clipped by at most 6 times that
scale error.

`quantize_checkpoint` is the project's quantiser: it writes such a checkpoint from a hub-layout one (tests
and tools; it holds one shard in memory at a time).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np

BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)  # codes 0..7; bit 3 is the sign
COMPANIONS = ("scale", "scale2", "input_amax", "original_shape")  # suffixes ".scale", ... of a packed weight
FIRST_QUANTISED_LAYER = 3
QUANTISED_NAME = re.compile(r"model\.llm\.layers\.(\d+)\.mlp\.experts\.w(13|2)_weight$")

from inkling_jax.checkpoint.destination import taken
from inkling_jax.checkpoint.safetensors_io import CheckpointError, HubCheckpoint, write_safetensors
from inkling_jax.config import load_config


def error_bound(weights: np.ndarray, scale2: np.ndarray) -> np.ndarray:
    """The per-element bound above, for weights [E, rows, cols] and their per-expert scale2 [E]."""
    block_amax = _blocks(np.abs(weights.astype(np.float32))).max(-1, keepdims=True)
    bound = (17 / 16) * block_amax / E2M1_MAX + 6 * 2.0 ** -10 * scale2[:, None, None, None]
    return np.broadcast_to(bound, block_amax.shape[:-1] + (BLOCK,)).reshape(weights.shape)


def _blocks(x: np.ndarray) -> np.ndarray:
    """[..., cols] -> [..., cols / 16, 16]."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of {BLOCK}, got shape {list(x.shape)}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))


def quantize(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[E, rows, cols] floats -> (packed U8 [E, rows, cols/2], scale e4m3 [E, rows, cols/16], scale2 f32 [E])."""
    w = _blocks(np.asarray(weights, np.float32))
    amax = np.abs(w).reshape(w.shape[0], -1).max(-1)
    scale2 = np.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0).astype(np.float32)
    exact = np.abs(w).max(-1) / (E2M1_MAX * scale2[:, None, None])
    scale = np.minimum(exact, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    step = scale.astype(np.float32)[..., None] * scale2[:, None, None, None]
    scaled = np.divide(np.abs(w), step, out=np.zeros_like(w), where=step > 0)
    midpoints = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
    codes = np.searchsorted(midpoints, scaled).astype(np.uint8) | np.where(w < 0, 8, 0).astype(np.uint8)
    codes = codes.reshape(weights.shape)
    return pack(codes), scale, scale2


def pack(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes [..., cols] -> bytes [..., cols/2]; the even column goes in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray) -> np.ndarray:
    """bytes [..., cols/2] -> e2m1 values (float32) [..., cols]."""
    table = np.concatenate([E2M1_VALUES, -E2M1_VALUES])
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.float32)
    out[..., 0::2], out[..., 1::2] = table[packed & 0x0F], table[packed >> 4]
    return out


def dequantize(packed: np.ndarray, scale: np.ndarray, scale2: np.ndarray) -> np.ndarray:
    """The float32 weights [E, rows, cols] of a packed tensor (any leading slice of experts)."""
    values = _blocks(unpack(packed))
    values *= scale.astype(np.float32)[..., None]  # in place: the dequantised slab is the only large buffer
    values *= np.asarray(scale2, np.float32)[:, None, None, None]
    return values.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def is_quantised_in_release(name: str, dense_layers) -> bool:
    """Whether the released NVFP4 checkpoint stores this hub tensor in FP4 (routed experts of layers 3..)."""
    match = QUANTISED_NAME.match(name)
    return bool(match) and int(match.group(1)) >= FIRST_QUANTISED_LAYER and int(match.group(1)) not in dense_layers


def quant_config_of(directory: str) -> dict | None:
    """The `quantization` block of hf_quant_config.json (or config.json's quantization_config), or None."""
    quant = os.path.join(directory, "hf_quant_config.json")
    path, field = (quant, "quantization") if os.path.exists(quant) else (os.path.join(directory, "config.json"),
                                                                         "quantization_config")
    try:
        with open(path) as fh:
            block = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise CheckpointError(f"{path}: cannot read the quantisation settings ({' '.join(str(e).split())})") from None
    block = block.get(field) if isinstance(block, dict) else block
    if block is not None and not isinstance(block, dict):
        raise CheckpointError(f"{path}: {field} is {block!r:.60}, not an object")
    return block


def quantize_checkpoint(src: str, dst: str, input_amax: float = 1.0) -> list[str]:
    """Write an NVFP4 copy of the hub checkpoint `src` to `dst` (which must not exist, atomically); returns the
    names quantised. Other tensors and files are copied as they are. `input_amax` is a stand-in activation amax
    (there is no calibration data here); conversion does not use it."""
    with taken(dst, src=src) as out:
        return _write_quantised(src, out, input_amax)


def _write_quantised(src: str, dst: str, input_amax: float) -> list[str]:
    dense = load_config(src).text.dense_layer_ids
    checkpoint = HubCheckpoint(src)
    quantised, weight_map = [], {}
    for file, st in checkpoint.files.items():
        tensors = {}
        for name in st.names:
            value = np.array(st.read(name))
            if not is_quantised_in_release(name, dense):
                tensors[name] = value
                continue
            packed, scale, scale2 = quantize(value)
            tensors.update({name: packed, f"{name}.scale": scale, f"{name}.scale2": scale2,
                            f"{name}.input_amax": np.array([input_amax], ml_dtypes.bfloat16),
                            f"{name}.original_shape": np.array(value.shape, np.int64)})
            quantised.append(name)
        write_safetensors(os.path.join(dst, file), tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=1)
    block = {"quant_algo": "NVFP4", "group_size": BLOCK, "kv_cache_quant_algo": None,
             "exclude_modules": ["model.llm.layers.*.attn*", "model.visual*", "model.audio*", "model.mtp*"]}
    with open(os.path.join(dst, "hf_quant_config.json"), "w") as fh:
        json.dump({"producer": {"name": "inkling-jax"}, "quantization": block}, fh, indent=1)
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = block
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    for extra in os.listdir(src):
        if not extra.endswith(".safetensors") and extra not in os.listdir(dst):
            if os.path.isfile(os.path.join(src, extra)):
                shutil.copy2(os.path.join(src, extra), os.path.join(dst, extra))
    return quantised
