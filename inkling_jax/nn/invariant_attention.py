"""Batch-invariant attention (`Backend.batch_invariant`): training's self-attention, prefill chunks and decode
steps all run the prefill-chunk kernel (`pallas_kernels/rel_attention/chunk.py`) at one fixed tile, so a query's
logits and output come from the same operations in the same order whichever of the three computes it, whatever
the other rows and tokens:
- its key blocks cover the same absolute positions in every call ([j * block_k, (j + 1) * block_k)): the kernel
  numbers keys by index, so a layout whose index 0 is not at a multiple of block_k (a sliding layer's [ring |
  chunk] page) is shifted right to be;
- it walks them in position order with the online softmax, and a block with no key the query may see changes
  nothing (its probabilities are exactly 0 and its rescale exactly 1, or, before the first visible block, the
  carry is multiplied by exactly 0 there);
- each query's row of a tile is computed apart from the other rows (a row of a tile's matmul).
A decode step is a one-token chunk (padded to the tile), so it costs a tile's compute per row; it reads the cache
as it lies (`kernels.decode_attention`: a ring through `cache.ring_as_pages`, aligned to the tile's key blocks).
"""

import jax.numpy as jnp

from pallas_kernels.rel_attention import rel_chunk_attention, tuning
from pallas_kernels.rel_attention.tiles import Blocks


def blocks(groups: int) -> Blocks:
    """The one tile of every call at a GQA group size: the prefill-chunk kernel's tuned tile, whatever the
    chunk's length."""
    return tuning.as_blocks(tuning.CHUNK, groups)


def chunk_attention(q, k_pages, v_pages, page_table, r, rel_proj, *, q_start, key_start, key_end, window, tau,
                    interpret: bool, first_position=None):
    """`rel_chunk_attention`'s contract at the fixed tile. first_position [B]: the absolute position of query 0
    where key indices are not positions (a sliding layer's one page per row: index i is position i +
    first_position - q_start); None where they are (the paged cache, a whole sequence)."""
    tile = blocks(q.shape[2] // k_pages.shape[2])
    if first_position is not None:
        k_pages, v_pages, shift = _aligned(k_pages[page_table[:, 0]], v_pages[page_table[:, 0]],
                                           jnp.mod(first_position - q_start, tile.block_k), tile.block_k)
        page_table = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
        q_start, key_start, key_end = q_start + shift, key_start + shift, key_end + shift
    return rel_chunk_attention(q, k_pages, v_pages, page_table, r, rel_proj, q_start=q_start, key_start=key_start,
                               key_end=key_end, window=window, tau=tau, interpret=interpret, blocks=tile)


def _aligned(k_rows, v_rows, shift, block_k: int):
    """Rows [B, S, Hkv, D] moved `shift[b]` (< block_k) places to the right in [B, S + block_k, Hkv, D] (zeros
    before and after), so that index shift[b] + i holds what index i did."""
    span = k_rows.shape[1]
    index = jnp.arange(span + block_k)[None, :] - shift[:, None]
    inside = ((index >= 0) & (index < span))[..., None, None]
    take = jnp.clip(index, 0, span - 1)[..., None, None]

    def move(rows):
        return jnp.where(inside, jnp.take_along_axis(rows, take, axis=1), jnp.zeros((), rows.dtype))
    return move(k_rows), move(v_rows), shift


def self_attention(q, k, v, r, rel_proj, *, window, tau, interpret: bool):
    """T tokens of one sequence per row, at positions 0 .. T - 1, attending among themselves: the row's keys are
    one page, the queries a chunk starting at 0."""
    batch, seq = q.shape[:2]
    zeros = jnp.zeros((batch,), jnp.int32)
    return chunk_attention(q, k, v, jnp.arange(batch, dtype=jnp.int32)[:, None], r, rel_proj, q_start=zeros,
                           key_start=zeros, key_end=jnp.full((batch,), seq, jnp.int32), window=window, tau=tau,
                           interpret=interpret)
