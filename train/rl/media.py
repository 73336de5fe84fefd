"""Vision-language prompts in RL: the same pixels reach the engine's prefill and the trainer's forward.

A prompt's images are decoded as the server decodes them (`serve.http.media`: the placeholder tokens rendered by
the chat format, the pixels cut into patches). Each step stacks the pixels of its P prompts, [P, M, T, p, p, C]
with M the most image tokens of any prompt of the file (zeros past a prompt's own, position -1), so that the
trainer compiles one step. Both sides run the policy's current vision tower on them (`tower_outputs`): the
rollout hands each prompt's rows to the engine as `Media`, the trainer puts them into its input embeddings
(`merge_media`), and with `--train-towers` its gradient reaches the tower through them.
"""

from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.config import InklingConfig, VisionConfig
from inkling_jax.nn.model import InklingModel
from serve.http.media import Media, MediaEncoder
from train.rl.prompts import Prompt


def image_reader(config: InklingConfig) -> MediaEncoder | None:
    """What reads a prompt's image parts as the server does (None for a model without a vision tower): a
    `MediaEncoder` of the model's shapes alone, whose header reading and decoding serve; the tower that turns the
    pixels into rows is the policy's own, at each step."""
    if config.vision is None:
        return None
    return MediaEncoder(nnx.eval_shape(lambda: InklingModel(config, rngs=nnx.Rngs(0))))


def step_pixels(prompts: list[Prompt], width: int, vision: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """(pixels [P, width, T, p, p, C] float32, positions [P, width] int32, -1 past a prompt's image tokens) of
    the prompts' images, in prompt order; `width`: the most image tokens of a prompt of the run."""
    patch = (vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
    pixels = np.zeros((len(prompts), width, *patch), np.float32)
    positions = np.full((len(prompts), width), -1, np.int32)
    for i, prompt in enumerate(prompts):
        filled = 0
        for start, item in prompt.images:
            pixels[i, filled:filled + item.count] = item.load()
            positions[i, filled:filled + item.count] = np.arange(start, start + item.count)
            filled += item.count
    return pixels, positions


def tower_outputs(model: InklingModel, pixels):
    """The vision tower on stacked pixels [P, M, ...] -> [P, M, hidden] (one vector per patch)."""
    prompts, width = pixels.shape[:2]
    return model.vision(pixels.reshape(prompts * width, *pixels.shape[2:])).reshape(prompts, width, -1)


def engine_media(outputs: np.ndarray, pixels: np.ndarray, positions: np.ndarray) -> list[Media | None]:
    """Per prompt, what `Engine.submit` takes: its image rows and their positions (None for a prompt without
    images); the digest keeps prompts with other pixels off each other's prefix-cache pages."""
    media = []
    for rows, values, where in zip(outputs, pixels, positions):
        real = where >= 0
        digest = hashlib.blake2b(np.ascontiguousarray(values[real]).tobytes(), digest_size=16).digest()
        media.append(Media(where[real], rows[real], digest) if real.any() else None)
    return media


def merge_media(model: InklingModel, input_ids, pixels, positions):
    """The input embeddings [N, T, hidden] of a trainer batch whose rows are P prompts' completions (prompt-major,
    N = P x G): the token embeddings, with each prompt's image rows (`tower_outputs`) at its positions."""
    tokens = model.embed_tokens(input_ids)
    rows, length = input_ids.shape
    prompt_of_row = jnp.arange(rows) // (rows // positions.shape[0])
    where = jnp.where(positions >= 0, positions, length)[prompt_of_row]  # -1: out of range, dropped
    outputs = tower_outputs(model, pixels)[prompt_of_row].astype(tokens.dtype)
    return tokens.at[jnp.arange(rows)[:, None], where].set(outputs, mode="drop")
