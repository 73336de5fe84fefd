"""How a hub tensor streams onto its model parameters in slabs, and how parameters are chunked on disk.

A slab is a run of whole rows (dim 0) of a hub tensor: contiguous in its file. Every rule of the hub layout
table (`loading.Rule`) sends a slab to one slice of each target parameter along one axis: rows of a copied
tensor to rows, rows of a transposed `[out, in]` linear to columns, rows 2i/2i+1 of a 2-D interleaved gate/up
tensor to column i of both targets, experts to experts. Slabs hold whole chunks along that axis, so every
chunk of the output is written once, whole.

Chunks start from the shard shape of the target mesh (so a restoring process reads the chunks its devices
hold, and no more) and are split further, along the streamed axis first, until they fit `chunk_bytes`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from inkling_jax.checkpoint.loading import Rule

BAND = 16  # source rows per band of a transposing copy that changes the dtype
TILE = 256  # source rows per tile of `transpose_into`
WORDS = 32  # 16-byte words of a source row per band of `transpose_into` (measured best of 16 .. 128)


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    name: str  # the hub tensor
    rule: Rule
    hub_shape: tuple[int, ...]
    target_shape: tuple[int, ...]  # every target of a rule has this shape
    axis: int  # the target axis that hub rows feed
    rows_per_index: int  # hub rows per index along `axis` (2 for a 2-D interleaved gate/up tensor)
    chunks: tuple[int, ...]
    slab_rows: int
    row_cost: int  # host bytes one hub row occupies while it is converted

    def slabs(self) -> list[tuple[int, int]]:
        rows = self.hub_shape[0]
        return [(a, min(a + self.slab_rows, rows)) for a in range(0, rows, self.slab_rows)]

    def region(self, start: int, stop: int) -> tuple[slice, ...]:
        """The slice of each target that hub rows [start, stop) fill."""
        index = [slice(None)] * len(self.target_shape)
        index[self.axis] = slice(start // self.rows_per_index, stop // self.rows_per_index)
        return tuple(index)


def fed_axis(rule: Rule, hub_ndim: int) -> tuple[int, int]:
    """(target axis fed by hub rows, hub rows per target index) of a rule."""
    if rule.kind == "linear":
        return 1, 1
    if rule.kind == "interleaved" and hub_ndim == 2:
        return 1, 2
    return 0, 1


def chunk_shape(shape, itemsize: int, shard_shape, axis: int, chunk_bytes: int) -> tuple[int, ...]:
    """The shard shape, split along `axis` first and then along the other axes in order, to <= chunk_bytes.
    Each split divides by the smallest factor up to 7, so chunks tile the shard exactly; a length with no
    such factor is halved (rounding up)."""
    chunks = [max(1, s) for s in shard_shape]
    order = [axis] + [a for a in range(len(chunks)) if a != axis]
    for a in order:
        while chunks[a] > 1 and math.prod(chunks) * itemsize > chunk_bytes:
            factor = next((f for f in (2, 3, 5, 7) if chunks[a] % f == 0), None)
            chunks[a] = chunks[a] // factor if factor else (chunks[a] + 1) // 2
    return tuple(min(c, max(1, s)) for c, s in zip(chunks, shape))


def plan_tensor(name: str, rule: Rule, hub_shape, target_shape, *, row_cost: int, slab_bytes: int,
                chunks=None, itemsize: int = 0, shard_shape=None, chunk_bytes: int = 0) -> TensorPlan:
    """row_cost: host bytes one hub row occupies while it is converted (read buffer, decoded and cast copies).
    chunks: the targets' chunk shape when they exist already; otherwise one is chosen from the shard shape."""
    hub_shape, target_shape = tuple(hub_shape), tuple(target_shape)
    axis, per = fed_axis(rule, len(hub_shape)) if hub_shape else (0, 1)
    axis = min(axis, len(target_shape) - 1)
    if chunks is None:
        chunks = chunk_shape(target_shape, itemsize, shard_shape, axis, chunk_bytes)
    chunks = tuple(chunks)
    unit = chunks[axis] * per  # hub rows per chunk along the streamed axis
    slab_rows = unit * max(1, slab_bytes // max(1, unit * row_cost))
    return TensorPlan(name, rule, hub_shape, target_shape, axis, per, chunks,
                      min(slab_rows, max(hub_shape[0], 1)) if hub_shape else 1, row_cost)


def contiguous(x: np.ndarray, dtype, out: np.ndarray | None = None) -> np.ndarray:
    """`x` as a C-contiguous array of `dtype`: `x` itself when it is one already, else a copy (into `out` when
    given: a C-contiguous array of x's shape and `dtype`). A transposed view (rows of its source along the
    last axis) goes through `transpose_into` when the dtype stays; numpy's strided copy of such a view moves
    one element at a time, 3 to 5 times slower."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype and x.flags.c_contiguous:
        return x
    out = np.empty(x.shape, dtype) if out is None else out
    if x.ndim >= 2 and x.dtype == dtype and x.strides[-2] == x.itemsize and x.shape[-2] > 1:
        return transpose_into(np.swapaxes(x, -1, -2), out)
    if x.ndim < 2 or abs(x.strides[-1]) <= abs(x.strides[-2]) or x.shape[-1] <= BAND:
        np.copyto(out, x, casting="unsafe")
        return out
    for start in range(0, x.shape[-1], BAND):
        out[..., start:start + BAND] = x[..., start:start + BAND]
    return out


def transpose_into(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[..., c, r] = src[..., r, c], for `src` whose rows (last axis) are contiguous and a C-contiguous
    `out` of the same dtype. Rows are moved as 16-byte words (8 bf16 values) in TILE x WORDS tiles, which keeps
    both sides in cache; each band of words is then split into its values while it is still in cache."""
    unit = np.dtype(f"u{src.itemsize}") if src.itemsize in (1, 2, 4, 8) else None
    word = next((w for w in (16, 8) if unit is not None and src.shape[-1] * src.itemsize % w == 0), None)
    if word is None or src.strides[-1] != src.itemsize:
        np.copyto(out, np.swapaxes(src, -1, -2))
        return out
    for lead in np.ndindex(src.shape[:-2]):
        _transpose_words(src[lead].view(f"V{word}"), out[lead].view(unit), word // src.itemsize)
    return out


def _transpose_words(words: np.ndarray, out: np.ndarray, per_word: int) -> None:
    rows, count = words.shape
    band = np.empty((min(WORDS, count), rows), words.dtype)
    for w0 in range(0, count, WORDS):
        w1 = min(w0 + WORDS, count)
        part = band[:w1 - w0]
        for r0 in range(0, rows, TILE):
            part[:, r0:r0 + TILE] = words[r0:r0 + TILE, w0:w1].T
        values = part.view(out.dtype).reshape(w1 - w0, rows, per_word)
        out[w0 * per_word:w1 * per_word].reshape(w1 - w0, per_word, rows)[...] = values.transpose(0, 2, 1)


def to_hub(rule: Rule, values: list[np.ndarray]) -> np.ndarray:
    """`rule.to_hub(values)`, with the transposes done by `contiguous`: the rule's own swap of the last two axes
    then meets arrays already transposed in memory, so its copies run along rows."""
    if rule.kind in ("linear", "interleaved", "experts_down"):
        values = [np.swapaxes(contiguous(np.swapaxes(v, -1, -2), v.dtype), -1, -2) for v in values]
    return rule.to_hub(values)
