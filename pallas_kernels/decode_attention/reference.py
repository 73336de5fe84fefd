"""Pure-jnp decode attention: gathers each cache layout into dense keys with explicit positions and calls the
generic relative-attention reference."""

import jax.numpy as jnp

from pallas_kernels.rel_attention.reference import rel_attention


def _attend_dense(q, k, v, r, rel_proj, lengths, k_pos, k_valid, **kwargs):
    """One query per sequence at position lengths-1 over dense keys [B, S, Hkv, D] at positions k_pos [B, S].
    Invalid slots are zeroed first: a cache may hold anything there, and 0 * NaN would leak into the output."""
    keep = k_valid[:, :, None, None]
    k = jnp.where(keep, k, jnp.zeros((), k.dtype))
    v = jnp.where(keep, v, jnp.zeros((), v.dtype))
    q_pos = (lengths - 1)[:, None]
    out = rel_attention(q[:, None], k, v, r[:, None], rel_proj, q_pos, k_pos, k_valid=k_valid, **kwargs)
    return out[:, 0]


def paged_decode_reference(q, k_pages, v_pages, page_table, lengths, r, rel_proj, *, tau=None, scale=None):
    """Same contract as `paged_decode_attention`."""
    batch, pages_per_seq = page_table.shape
    _, page_size, kv_heads, dim = k_pages.shape
    dense_shape = (batch, pages_per_seq * page_size, kv_heads, dim)
    k_pos = jnp.broadcast_to(jnp.arange(dense_shape[1]), dense_shape[:2])
    return _attend_dense(q, k_pages[page_table].reshape(dense_shape), v_pages[page_table].reshape(dense_shape),
                         r, rel_proj, lengths, k_pos, k_pos < lengths[:, None],
                         tau=None if tau is None else tau[:, None], scale=scale)


def ring_decode_reference(q, k_ring, v_ring, lengths, r, rel_proj, *, window, rows=None, scale=None):
    """Same contract as `ring_decode_attention`."""
    if rows is not None:
        k_ring, v_ring = k_ring[rows], v_ring[rows]
    slot = jnp.arange(k_ring.shape[1])[None, :]
    last = (lengths - 1)[:, None]
    k_pos = last - (last - slot) % window  # the newest position p <= lengths-1 with p % window == slot
    return _attend_dense(q, k_ring, v_ring, r, rel_proj, lengths, k_pos, k_pos >= 0, window=window, scale=scale)
