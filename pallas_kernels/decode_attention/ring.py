"""Decode attention over a sliding-window ring cache (local layers)."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import tuning
from pallas_kernels.decode_attention.kernel import (combine_splits, decode_partials, default_splits,
                                                    group_heads, load_valid_rows, padded_size, reversed_rel_proj,
                                                    split_kernel)


def _ring_kernel(lengths_ref, rows_ref, k_ref, v_ref, rel_ref, q_ref, r_ref, *out_refs, block, window, scale):
    b, h = pl.program_id(0), pl.program_id(1)
    length, ring = lengths_ref[b], rows_ref[b]

    def load_block(i):
        first = i * block
        # Until the ring has wrapped, only slots below the length were written.
        valid = (first + jnp.arange(block) < length) | (length >= window)
        k = load_valid_rows(k_ref.at[ring, pl.ds(first, block), h, :], valid)
        v = load_valid_rows(v_ref.at[ring, pl.ds(first, block), h, :], valid)
        # Slot j holds distance d = (length-1-j) mod W, whose reversed-P column W-1-d equals (j-length) mod W:
        # contiguous in j up to one wrap, which the doubled P absorbs.
        start = (first + window - length % window) % window
        return k, v, rel_ref[:, pl.ds(start, block)], valid

    split_kernel(q_ref, r_ref, *out_refs, num_blocks=pl.cdiv(jnp.minimum(length, window), block),
                 load_block=load_block, score_scale=scale, bias_scale=1.0)


def _largest_dividing_power_of_two(window, cap):
    block = cap
    while window % block:
        block //= 2
    return block


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "block_slots", "num_splits", "num_warps", "num_stages"))
def ring_decode_attention(q, k_ring, v_ring, lengths, r, rel_proj, *, window, rows=None, scale=None,
                          interpret=None, block_slots=None, num_splits=None, num_warps=None, num_stages=None):
    """Sliding-window attention of one new token per sequence over a ring cache, with Inkling's relative bias.

    Args:
      q: [B, Hq, D] normed queries.
      k_ring, v_ring: [N, W, Hkv, D] with W = window; position p lives in slot p % W.
      lengths: [B] int32 tokens seen including the new one (already written); the query sits at position
        lengths-1 and sees positions max(0, lengths-W)..lengths-1.
      r: [B, Hq, dr]; rel_proj: P [dr, W] (the bias extent equals the window, so every visible key has a bias).
      window: W, counting the query itself.
      rows: optional [B] int32, the ring of each query (default: ring b for query b, N == B). A step over a
        few of a server's sequences reads their rings in place instead of gathering them first.
      scale: defaults to 1 / D.
      block_slots, num_splits, num_warps, num_stages: launch tuning (defaults in tuning.py); block_slots must
        divide W, and block_slots * D must be a power of two.
    Returns [B, Hq, D] in q.dtype.
    """
    batch, heads, dim = q.shape
    rows = jnp.arange(batch, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    _, slots, kv_heads, _ = k_ring.shape
    dr, extent = rel_proj.shape
    if not slots == extent == window:
        raise ValueError(f"ring slots {slots}, bias extent {extent} and window {window} must be equal")
    block = block_slots or _largest_dividing_power_of_two(window, tuning.RING_BLOCK_SLOTS)
    if window % block:
        raise ValueError(f"block_slots {block} must divide the window {window}")
    num_splits = num_splits or default_splits(batch, kv_heads, window // block, tuning.RING_TARGET_PROGRAMS)
    rel_rows = padded_size(dr)
    reversed_p = reversed_rel_proj(rel_proj, r.dtype, rel_rows)
    group_rows = padded_size(heads // kv_heads)
    kernel = functools.partial(_ring_kernel, block=block, window=window,
                               scale=1.0 / dim if scale is None else scale)
    partials = decode_partials(
        kernel, group_heads(q, kv_heads, group_rows, dim), group_heads(r, kv_heads, group_rows, rel_rows),
        [lengths.astype(jnp.int32), rows, k_ring, v_ring, jnp.concatenate([reversed_p, reversed_p], axis=1)],
        num_splits=num_splits, num_warps=num_warps or tuning.NUM_WARPS,
        num_stages=num_stages or tuning.NUM_STAGES, interpret=interpret)
    return combine_splits(*partials, heads, q.dtype)
