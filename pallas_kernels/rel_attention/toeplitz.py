"""The relative bias of a tile as a matmul, for the tensor-core (Mosaic GPU) forward: operands built in the wrapper.

A warpgroup tile holds 64 rows = `groups` heads x `n_tok` consecutive tokens, head-major (row = head * n_tok +
token, so that each head's rows are one strided TMA box of q). With the tile's first query at position p0 and its
first key at k0, the base-2 bias of the tile is

    bias = A @ Tz,   A[(h, t), (t', c)] = r'[t, h, c] * [t == t'],   Tz[(t', c), j] = P[c, (p0 + t') - (k0 + j)]

(zero where the distance falls outside [0, E)), with r' = r * tau * log2(e) (or another per-token factor: see
`block_diagonal_r`). A is block-diagonal in the tokens and is laid out per query tile like q; Tz depends only
on the offset p0 - k0, so a table of every Tz the kernel can meet is built once ([offsets, n_tok * d_rel,
block_k], a few MB) and the kernel loads the slice of its offset.
"""

import jax.numpy as jnp

TILE_ROWS = 64  # rows of one warpgroup's tile (the wgmma M)


def tokens_per_tile(groups: int) -> int:
    if TILE_ROWS % groups:
        raise ValueError(f"a GQA group of {groups} heads does not divide a {TILE_ROWS}-row tile")
    return TILE_ROWS // groups


def first_offset(q_offset: int, n_tok: int) -> int:
    """Smallest offset p0 - k0 in the table: offsets step by n_tok (k0 steps by block_k, a multiple of n_tok)
    and are congruent to q_offset; the first one lies at or below -(n_tok - 1), the last distance a tile needs."""
    return q_offset % n_tok - n_tok


def num_offsets(q_offset: int, n_tok: int, block_k: int, extent: int) -> int:
    """Offsets from first_offset up to the last tile that still has a distance below E (extent + block_k - 2),
    plus n_tok: the second warpgroup of a CTA starts n_tok tokens later and shares the first one's key blocks."""
    return (extent + block_k - 2 + n_tok - first_offset(q_offset, n_tok)) // n_tok + 1


def offset_table(rel_proj, *, q_offset: int, n_tok: int, block_k: int, dtype):
    """Every Tz as [offsets, n_tok * d_rel, block_k]; rel_proj is P [d_rel, E] (unpadded)."""
    d_rel, extent = rel_proj.shape
    n_off = num_offsets(q_offset, n_tok, block_k, extent)
    delta = first_offset(q_offset, n_tok) + n_tok * jnp.arange(n_off)
    dist = delta[:, None, None] + jnp.arange(n_tok)[None, :, None] - jnp.arange(block_k)[None, None, :]
    inside = (dist >= 0) & (dist < extent)
    cols = rel_proj.astype(jnp.float32)[:, jnp.clip(dist, 0, extent - 1)]  # [d_rel, offsets, n_tok, block_k]
    table = jnp.where(inside[None], cols, 0.0).transpose(1, 2, 0, 3)  # [offsets, n_tok, d_rel, block_k]
    return table.reshape(n_off, n_tok * d_rel, block_k).astype(dtype)


def block_diagonal_r(r, factor, n_tok: int, kv_heads: int):
    """A per query tile: r [B, T, Hq, d_rel] (T a multiple of n_tok) times `factor` (per token [B, T], or a
    scalar) -> [B, Hkv, T / n_tok, 64, n_tok * d_rel] in r.dtype, the rows of each tile head-major as the
    kernel's q tile."""
    batch, seq, heads, d_rel = r.shape
    groups = heads // kv_heads
    scaled = r.astype(jnp.float32) * jnp.reshape(factor, jnp.shape(factor) + (1, 1))
    scaled = scaled.reshape(batch, seq // n_tok, n_tok, kv_heads, groups, d_rel)
    eye = jnp.eye(n_tok, dtype=jnp.float32)
    # [B, T/n, t, Hkv, G, c] x [t, s] -> [B, Hkv, T/n, G, t, s, c]
    a = jnp.einsum("bqtkgc,ts->bkqgtsc", scaled, eye)
    return a.reshape(batch, kv_heads, seq // n_tok, groups * n_tok, n_tok * d_rel).astype(r.dtype)
