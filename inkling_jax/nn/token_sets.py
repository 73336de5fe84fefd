"""Several sets of rows in one pass of the model (`InklingModel.extend_sets`), such as a serving step's decode rows
(one token each) and a prompt chunk's row. The position-wise modules (norms, projections, the MLP or MoE, the head)
take every set's tokens at once, one token per row, [N, 1, hidden], so that they read their weights once (and a
serving view's per-row state, a LoRA adapter slot, is per token); the sequence-aware parts (attention with its
cache writes, the ShortConvs) run set by set. One set is passed through unchanged, in its own [B, T] shape."""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from inkling_jax.nn.cache import Cache, LayerCache


class ChunkSet(NamedTuple):
    """One set of `InklingModel.extend_sets`: a chunk input_ids [B, T] continuing the rows of `cache`, `n_new [B]`
    real tokens per row (None: T), and `embeds [B, T, hidden]` to use instead of embedding input_ids (media merged
    by the caller)."""

    input_ids: jax.Array
    cache: Cache
    n_new: jax.Array | None = None
    embeds: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LayerSet:
    """What a decoder layer needs of one set of rows besides its hidden states: the positions [B, T] of its tokens
    and, with a cache, the layer's cache view of those rows, the real tokens per row `n_new [B]`, the page table
    and the ring rows (`inkling_jax.nn.cache.Cache`); or, without a cache, packed sequences' segment ids."""

    positions: jax.Array
    cache: LayerCache | None = None
    n_new: jax.Array | None = None
    page_table: jax.Array | None = None
    ring_rows: jax.Array | None = None
    segment_ids: jax.Array | None = None


class TokenLayout:
    """How the sets' [B_i, T_i, ...] arrays are laid out as one batch of tokens, set after set, row-major."""

    def __init__(self, shapes: list[tuple[int, int]]):
        """shapes: (rows, tokens per row) of each set."""
        self.shapes = [tuple(shape) for shape in shapes]

    @property
    def sizes(self) -> list[int]:
        return [rows * tokens for rows, tokens in self.shapes]

    def join(self, xs: list) -> jax.Array:
        """xs[i] [B_i, T_i, C] -> [N, 1, C] (one set: as it is)."""
        if len(xs) == 1:
            return xs[0]
        return jnp.concatenate([x.reshape(-1, 1, x.shape[-1]) for x in xs])

    def split(self, y) -> list:
        """The inverse of `join`: y [N, 1, C] -> [B_i, T_i, C] per set."""
        if len(self.shapes) == 1:
            return [y]
        return [part.reshape(*shape, y.shape[-1]) for part, shape in zip(self.split_tokens(y), self.shapes)]

    def split_tokens(self, y) -> list:
        """y [N, ...] with one entry per token (the MoE's expert ids) -> [B_i * T_i, ...] per set."""
        if len(self.shapes) == 1:
            return [y]
        ends = itertools.accumulate(self.sizes)
        return [y[end - size:end] for end, size in zip(ends, self.sizes)]
