"""Inkling attention: ShortConv on K and V, per-head q/k RMSNorm, the query-conditioned relative bias, the
sliding window on local layers and log-scaling on full layers. The score computation itself is behind
`kernels.attention`, so a Pallas kernel replaces it without touching this file."""

import jax.numpy as jnp
from flax import nnx

from inkling_jax import kernels
from inkling_jax.cache import LayerCache
from inkling_jax.config import TextConfig, log_scaling_tau
from inkling_jax.layers import Linear, RMSNorm, ShortConv, normal


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, local: bool, *, dtype, rngs: nnx.Rngs):
        s = cfg.attention(local)
        self.local = local
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.window = s.window
        self.d_rel = cfg.d_rel
        self.log_scaling = (cfg.log_scaling_n_floor, cfg.log_scaling_alpha) if s.log_scaling else None
        hidden, kv_width = cfg.hidden_size, s.num_kv_heads * s.head_dim
        self.wq = Linear(hidden, s.num_heads * s.head_dim, dtype=dtype, rngs=rngs)
        self.wk = Linear(hidden, kv_width, dtype=dtype, rngs=rngs)
        self.wv = Linear(hidden, kv_width, dtype=dtype, rngs=rngs)
        self.wr = Linear(hidden, s.num_heads * cfg.d_rel, dtype=dtype, rngs=rngs)
        self.wo = Linear(s.num_heads * s.head_dim, hidden, dtype=dtype, rngs=rngs)
        self.k_sconv = ShortConv(kv_width, cfg.conv_kernel_size, rngs=rngs)
        self.v_sconv = ShortConv(kv_width, cfg.conv_kernel_size, rngs=rngs)
        self.q_norm = RMSNorm(s.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(s.head_dim, cfg.rms_norm_eps, dtype=dtype)
        # One bank of bias-vs-distance profiles per layer, shared by all heads: P [d_rel, E].
        self.rel_proj = nnx.Param(normal(rngs, (cfg.d_rel, s.extent), dtype))

    def __call__(self, u, positions, *, segment_ids=None, cache: LayerCache | None = None, n_new=None):
        """u [B, T, hidden] (normed) at `positions [B, T]`.

        Without a cache the T tokens attend among themselves (segment ids separate packed sequences).
        With a cache the T tokens continue each row at `positions = lengths + t`; only the first `n_new[b]`
        of them are real (right padding). Returns (output [B, T, hidden], updated cache fields or None).
        """
        batch, seq, _ = u.shape
        q = self.wq(u).reshape(batch, seq, self.num_heads, self.head_dim)
        r = self.wr(u).reshape(batch, seq, self.num_heads, self.d_rel)
        k, k_conv = self.k_sconv(self.wk(u), None if cache is None else cache.k_conv, segment_ids, n_new)
        v, v_conv = self.v_sconv(self.wv(u), None if cache is None else cache.v_conv, segment_ids, n_new)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(batch, seq, self.num_kv_heads, self.head_dim))
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        tau = None if self.log_scaling is None else log_scaling_tau(positions, *self.log_scaling)

        if cache is None:
            keys, values, k_pos, k_valid, updated = k, v, positions, None, None
        else:
            if segment_ids is not None:
                raise ValueError("packed segments and a decode cache cannot be combined")
            update = self._ring_update if self.local else self._full_update
            keys, values, k_pos, k_valid, new_k, new_v = update(cache, k, v, positions, n_new)
            updated = dict(k=new_k, v=new_v, k_conv=k_conv, v_conv=v_conv)
        out = kernels.attention(q, keys, values, r, self.rel_proj[...], positions, k_pos, window=self.window,
                                tau=tau, q_segment=segment_ids, k_segment=segment_ids, k_valid=k_valid)
        return self.wo(out.reshape(batch, seq, -1)), updated

    @staticmethod
    def _full_update(cache, k, v, positions, n_new):
        """Write the new K/V at their positions; attend over the whole (fixed-size) cache."""
        batch, seq = positions.shape
        slots = cache.k.shape[1]
        real = jnp.arange(seq)[None, :] < n_new[:, None]
        idx = jnp.where(real, positions, slots)  # padding goes out of range and is dropped
        rows = jnp.arange(batch)[:, None]
        new_k = cache.k.at[rows, idx].set(k, mode="drop")
        new_v = cache.v.at[rows, idx].set(v, mode="drop")
        k_pos = jnp.broadcast_to(jnp.arange(slots)[None, :], (batch, slots))
        k_valid = k_pos < (positions[:, :1] + n_new[:, None])
        return new_k, new_v, k_pos, k_valid, new_k, new_v

    @staticmethod
    def _ring_update(cache, k, v, positions, n_new):
        """Attend over [ring before this chunk ; the chunk], then keep the newest `window` tokens in the ring."""
        batch, seq = positions.shape
        window = cache.k.shape[1]
        last = positions[:, :1] - 1  # the newest cached position, -1 for an empty row
        slot = jnp.arange(window)[None, :]
        slot_pos = last - jnp.mod(last - slot, window)  # the position each slot holds (negative: empty)
        real = jnp.arange(seq)[None, :] < n_new[:, None]
        keys = jnp.concatenate([cache.k, k], axis=1)
        values = jnp.concatenate([cache.v, v], axis=1)
        k_pos = jnp.concatenate([slot_pos, positions], axis=1)
        k_valid = jnp.concatenate([slot_pos >= 0, real], axis=1)
        # Only the last `window` real tokens survive, so no two writes hit the same slot.
        keep = real & (jnp.arange(seq)[None, :] >= n_new[:, None] - window)
        idx = jnp.where(keep, jnp.mod(positions, window), window)
        rows = jnp.arange(batch)[:, None]
        new_k = cache.k.at[rows, idx].set(k, mode="drop")
        new_v = cache.v.at[rows, idx].set(v, mode="drop")
        return keys, values, k_pos, k_valid, new_k, new_v
