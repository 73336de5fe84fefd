"""Pure-jnp decode attention prologue: what the fused kernel does, as the unfused sequence.

For N new tokens: K and V ShortConv against their state pools (`shortconv.reference.shortconv_decode`),
per-head RMSNorm of q and of the conv'd k, the log-scaling tau folded into the normed q (full layers), and
K (conv'd, normed, not tau-scaled) and V (conv'd) written into the KV cache at flat slots `write_idx`.
A token whose write_idx is negative (an idle row of a decode batch) writes nothing: its pool rows and the cache
stay as they were; its q, k, v outputs are computed all the same.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.shortconv.reference import shortconv_decode


def head_rms_norm(x, weight, eps):
    """RMSNorm over the last axis: statistics in fp32, cast to x.dtype before the (non 1+) weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight * normed.astype(x.dtype)).astype(x.dtype)


def fold_tau(q, tau):
    """q * tau in fp32, rounded once more to q.dtype (tau broadcast against q)."""
    return (q.astype(jnp.float32) * tau).astype(q.dtype)


def attn_prologue(q, k, v, k_conv_w, v_conv_w, q_norm_w, k_norm_w, k_pool, v_pool, slots, k_cache, v_cache,
                  write_idx, tau=None, *, eps=1e-6):
    """Args:
      q: [N, Hq*D]; k, v: [N, Hkv*D] projections of the N new tokens.
      k_conv_w, v_conv_w: [Hkv*D, 4] conv taps (fp32); q_norm_w, k_norm_w: [D].
      k_pool, v_pool: [S, 3, Hkv*D] conv states; slots: [N] distinct rows of the pools.
      k_cache, v_cache: [M, Hkv, D] the KV cache as flat slots; write_idx: [N] distinct slots to write, or
        negative for a token that writes nothing.
      tau: optional [N] fp32 log-scaling factor (full layers).

    Returns:
      (q_out [N, Hq, D], k_out [N, Hkv, D], v_out [N, Hkv, D], k_pool, v_pool, k_cache, v_cache).
    """
    tokens = q.shape[0]
    cache_slots, kv_heads, dim = k_cache.shape
    keep = write_idx >= 0
    k_conv, k_pool = _kept_rows(shortconv_decode(k, k_conv_w, k_pool, slots), k_pool, slots, keep)
    v_conv, v_pool = _kept_rows(shortconv_decode(v, v_conv_w, v_pool, slots), v_pool, slots, keep)
    q_out = head_rms_norm(q.reshape(tokens, -1, dim), q_norm_w, eps)
    if tau is not None:
        q_out = fold_tau(q_out, tau.astype(jnp.float32)[:, None, None])
    k_out = head_rms_norm(k_conv.reshape(tokens, kv_heads, dim), k_norm_w, eps)
    v_out = v_conv.reshape(tokens, kv_heads, dim)
    dest = jnp.where(keep, write_idx, cache_slots)  # out of range: dropped
    k_cache = k_cache.at[dest].set(k_out.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[dest].set(v_out.astype(v_cache.dtype), mode="drop")
    return q_out, k_out, v_out, k_pool, v_pool, k_cache, v_cache


def _kept_rows(conv_result, old_pool, slots, keep):
    """(y, pool) of a decode step, with the pool rows of tokens not kept restored to `old_pool`'s."""
    y, pool = conv_result
    rows = jnp.where(keep[:, None, None], pool[slots], old_pool[slots])
    return y, pool.at[slots].set(rows)
