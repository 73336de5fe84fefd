"""Pure-jnp attention with Inkling's query-conditioned relative bias.

For query i and key j (absolute positions p_i, p_j; distance d = p_i - p_j):

    s[h, i, j] = tau_i * ( q[i, h] . k[j, g(h)] * scale + b[h, i, j] ),   scale = 1 / head_dim
    b[h, i, j] = sum_e r[i, h, e] * P[e, d]   if 0 <= d < E, else 0

masked to d >= 0 (causal), d < window on sliding layers, equal segment ids and valid keys; softmax in fp32.
g(h) = h // (Hq / Hkv) (consecutive query heads share a KV head). tau is the log-scaling factor of full
layers (1 elsewhere); like the reference model it scales the normed q and the bias, not k.
"""

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def relative_bias(r, rel_proj, q_pos, k_pos):
    """b[B, H, T, S] from r [B, T, H, dr] and P [dr, E]: the dense form, for references, tiny shapes and the
    model's prefill chunks that continue a cache. P's column for each (query, key) distance is gathered first
    ([B, T, S, dr]), so nothing of size [B, H, T, E] is built."""
    extent = rel_proj.shape[-1]
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    inside = (dist >= 0) & (dist < extent)
    columns = jnp.take(rel_proj.astype(r.dtype).T, jnp.clip(dist, 0, extent - 1), axis=0)  # [B, T, S, dr]
    columns = jnp.where(inside[..., None], columns, jnp.zeros((), columns.dtype))
    return jnp.einsum("bthd,btsd->bhts", r, columns)


def self_relative_bias(r, rel_proj):
    """`relative_bias` for T tokens attending among themselves, distances taken as index differences (t - s):
    R = r @ P [B, H, T, E] skewed into b[B, H, T, T] by a pad and a reshape, not gathered. The same values
    where s <= t; zeros above the diagonal (masked by causality). A gather of P's columns has a scatter onto
    E columns as its gradient, which made the jnp path's training steps many times slower."""
    batch, seq, heads, _ = r.shape
    extent = rel_proj.shape[-1]
    rel = jnp.einsum("bthd,de->bhte", r, rel_proj.astype(r.dtype))[..., :seq]
    rel = jnp.pad(rel, ((0, 0), (0, 0), (0, 0), (0, max(seq - extent, 0))))[..., ::-1]  # [t, T - 1 - d]
    # Row t must start at column T - 1 - t: in rows of length 2T - 1 over the flattened [T, 2T] that is a
    # shift of one column per row.
    flat = jnp.pad(rel, ((0, 0), (0, 0), (0, 0), (0, seq))).reshape(batch, heads, 2 * seq * seq)
    skewed = flat[..., seq - 1: seq - 1 + seq * (2 * seq - 1)].reshape(batch, heads, seq, 2 * seq - 1)
    return skewed[..., :seq]


def attention_mask(q_pos, k_pos, window=None, q_segment=None, k_segment=None, k_valid=None):
    """Boolean [B, T, S]: which keys each query may attend to."""
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    mask = dist >= 0
    if window is not None:
        mask &= dist < window
    if q_segment is not None:
        mask &= q_segment[:, :, None] == k_segment[:, None, :]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask


def rel_attention(q, k, v, r, rel_proj, q_pos, k_pos, *, window=None, tau=None, q_segment=None,
                  k_segment=None, k_valid=None, scale=None, index_distances=False):
    """Attention output [B, T, Hq, D] in q.dtype.

    Args:
      q: [B, T, Hq, D] normed queries; k, v: [B, S, Hkv, D]; r: [B, T, Hq, dr]; rel_proj: [dr, E].
      q_pos: [B, T] int and k_pos: [B, S] int absolute positions.
      window: sliding-window length (the window counts the query itself); None for full attention.
      tau: optional [B, T] fp32 log-scaling factor per query.
      q_segment, k_segment: optional [B, T], [B, S] ids of packed sequences.
      k_valid: optional [B, S] bool, False for cache slots that hold nothing.
      scale: defaults to 1 / head_dim.
      index_distances: self-attention whose positions step by one inside each segment (the flash kernel's
        contract): the bias is built by `self_relative_bias`, fast to differentiate.
    """
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    scale = 1.0 / dim if scale is None else scale
    dtype = q.dtype
    bias = self_relative_bias(r, rel_proj) if index_distances else relative_bias(r, rel_proj, q_pos, k_pos)
    if tau is not None:
        t = tau[:, None, :, None]
        q = (q.astype(jnp.float32) * tau[:, :, None, None]).astype(dtype)
        bias = (bias.astype(jnp.float32) * t).astype(dtype)
    qg = q.reshape(batch, seq, kv_heads, groups, dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k).reshape(batch, heads, seq, k.shape[1]) * scale
    scores = scores.astype(dtype) + bias
    mask = attention_mask(q_pos, k_pos, window, q_segment, k_segment, k_valid)[:, None]
    scores = jnp.where(mask, scores.astype(jnp.float32), NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    # Rows with no visible key (padding queries) get zeros rather than a uniform average.
    probs = jnp.where(mask.any(-1, keepdims=True), probs, 0.0).astype(dtype)
    probs = probs.reshape(batch, kv_heads, groups, seq, k.shape[1])
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, seq, heads, dim).astype(dtype)


def chunk_attention(q, k_pages, v_pages, page_table, r, rel_proj, *, q_start, key_start, key_end, window=None,
                    tau=None, scale=None):
    """chunk.rel_chunk_attention's contract, densely: the table's keys gathered into [B, span, Hkv, D], then
    rel_attention over key indices (query t of row b at q_start[b] + t; keys outside [key_start, key_end) absent)."""
    batch, seq = q.shape[:2]
    keys, values = (x[page_table].reshape(batch, -1, *x.shape[2:]) for x in (k_pages, v_pages))
    q_pos = q_start[:, None] + jnp.arange(seq)[None, :]
    k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1])[None, :], (batch, keys.shape[1]))
    k_valid = (k_pos >= key_start[:, None]) & (k_pos < key_end[:, None])
    return rel_attention(q, keys, values, r, rel_proj, q_pos, k_pos, window=window, tau=tau, k_valid=k_valid,
                         scale=scale)
