"""Decode attention over a paged KV cache (full-attention layers)."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import tuning
from pallas_kernels.decode_attention.kernel import (combine_splits, decode_partials, default_splits,
                                                    group_heads, load_valid_rows, padded_size, reversed_rel_proj,
                                                    split_kernel)


def _paged_kernel(lengths_ref, tau_ref, page_table_ref, k_ref, v_ref, rel_ref, q_ref, r_ref, *out_refs,
                  pages_per_block, extent, scale):
    b, h = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]
    tau = tau_ref[b]
    page_size, dim = k_ref.shape[1], k_ref.shape[-1]
    block = pages_per_block * page_size

    def load_block(i):
        # Block i holds pages i*pages_per_block.. of the sequence; each row looks up its own page, so the tile
        # comes out as [block, D] directly (no reshape between the load and the matmul).
        rows = jnp.arange(block)
        first = i * block
        valid = first + rows < length
        # Table entries past the last page may hold anything: address page 0 there instead (never read).
        pages = jnp.where(valid, page_table_ref[b, i * pages_per_block + rows // page_size], 0)
        cells = (pages[:, None], (rows % page_size)[:, None], h, jnp.arange(dim)[None, :])
        k = load_valid_rows(k_ref.at[cells], valid)
        v = load_valid_rows(v_ref.at[cells], valid)
        # Key at position p has distance length-1-p, stored at column extent-length+p of the reversed P,
        # shifted by the `block` zero columns padded on the left; blocks wholly beyond the extent clamp onto
        # those zeros (no bias).
        start = jnp.clip(extent - length + first + block, 0, extent + block)
        return k, v, rel_ref[:, pl.ds(start, block)], valid

    split_kernel(q_ref, r_ref, *out_refs, num_blocks=pl.cdiv(length, block), load_block=load_block,
                 score_scale=scale * tau, bias_scale=tau)


def contiguous_as_pages(cache, page_size):
    """A contiguous cache [B, L, Hkv, D] as pages [B*L/page_size, page_size, Hkv, D] plus its identity page
    table [B, L/page_size], for `paged_decode_attention` (a reshape: no copy)."""
    batch, seq, kv_heads, dim = cache.shape
    if seq % page_size:
        raise ValueError(f"page_size {page_size} must divide the cache length {seq}")
    pages_per_seq = seq // page_size
    table = jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)
    return cache.reshape(batch * pages_per_seq, page_size, kv_heads, dim), table


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block", "num_splits", "num_warps", "num_stages"))
def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, r, rel_proj, *, tau=None, scale=None,
                           interpret=None, pages_per_block=None, num_splits=None, num_warps=None,
                           num_stages=None):
    """Attention of one new token per sequence over a paged cache, with Inkling's relative bias.

    Args:
      q: [B, Hq, D] normed queries (not tau-scaled).
      k_pages, v_pages: [num_pages, page_size, Hkv, D]; the token at position p of sequence b lives in page
        page_table[b, p // page_size], row p % page_size. page_size * D must be a power of two.
      page_table: [B, pages_per_seq] int32; entries past a sequence's last page are ignored (any value).
      lengths: [B] int32 tokens in the cache including the new one (already written); the query sits at
        position lengths-1 and sees keys 0..lengths-1.
      r: [B, Hq, dr] bias coefficients; rel_proj: P [dr, E]: bias r . P[:, d] at distance d < E, 0 beyond.
      tau: optional [B] fp32 log-scaling that multiplies the whole logit.
      scale: defaults to 1 / D.
      pages_per_block, num_splits, num_warps, num_stages: launch tuning (defaults in tuning.py).
    Returns [B, Hq, D] in q.dtype. Query heads h*G..h*G+G-1 share KV head h (G = Hq / Hkv).
    """
    batch, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    dr, extent = rel_proj.shape
    pages_per_block = pages_per_block or max(1, tuning.PAGED_BLOCK_TOKENS // page_size)
    block = pages_per_block * page_size
    max_blocks = pl.cdiv(page_table.shape[1], pages_per_block)
    num_splits = num_splits or default_splits(batch, kv_heads, max_blocks, tuning.PAGED_TARGET_PROGRAMS)
    tau = jnp.ones((batch,), jnp.float32) if tau is None else tau.astype(jnp.float32)
    # Whole blocks of the table are read; the padding entries point at page 0 and are masked by length.
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, max_blocks * pages_per_block - page_table.shape[1])))
    rel_rows = padded_size(dr)
    rel = jnp.pad(reversed_rel_proj(rel_proj, r.dtype, rel_rows), ((0, 0), (block, block)))
    rows = padded_size(heads // kv_heads)
    kernel = functools.partial(_paged_kernel, pages_per_block=pages_per_block, extent=extent,
                               scale=1.0 / dim if scale is None else scale)
    partials = decode_partials(
        kernel, group_heads(q, kv_heads, rows, dim), group_heads(r, kv_heads, rows, rel_rows),
        [lengths.astype(jnp.int32), tau, table, k_pages, v_pages, rel], num_splits=num_splits,
        num_warps=num_warps or tuning.NUM_WARPS, num_stages=num_stages or tuning.NUM_STAGES,
        interpret=interpret)
    return combine_splits(*partials, heads, q.dtype)
