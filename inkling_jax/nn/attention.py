"""Inkling attention: ShortConv on K and V, per-head q/k RMSNorm, the query-conditioned relative bias, the
sliding window on local layers and log-scaling on full layers. The score computation itself is behind `kernels`
(self-attention, prefill chunks over a cache, decode steps), so a Pallas kernel replaces it without touching this
file; so is a decode step's prologue (the ShortConvs, norms and cache write), which the Pallas backend fuses into
one kernel."""

import jax.numpy as jnp
from flax import nnx
from jax import lax

from inkling_jax.backend import Backend
from inkling_jax.config import TextConfig, log_scaling_tau
from inkling_jax.nn import kernels
from inkling_jax.nn.cache import LayerCache
from inkling_jax.nn.layers import Linear, RMSNorm, ShortConv, normal
from inkling_jax.parallel.kernel_sharding import pin_heads


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, local: bool, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        s = cfg.attention(local)
        self.local = local
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.window = s.window
        self.d_rel = cfg.d_rel
        self.log_scaling = (cfg.log_scaling_n_floor, cfg.log_scaling_alpha) if s.log_scaling else None
        hidden, kv_width = cfg.hidden_size, s.num_kv_heads * s.head_dim
        self.wq = Linear(hidden, s.num_heads * s.head_dim, dtype=dtype, rngs=rngs, backend=backend)
        self.wk = Linear(hidden, kv_width, dtype=dtype, rngs=rngs, backend=backend)
        self.wv = Linear(hidden, kv_width, dtype=dtype, rngs=rngs, backend=backend)
        self.wr = Linear(hidden, s.num_heads * cfg.d_rel, dtype=dtype, rngs=rngs, backend=backend)
        self.wo = Linear(s.num_heads * s.head_dim, hidden, dtype=dtype, rngs=rngs, backend=backend)
        self.k_sconv = ShortConv(kv_width, cfg.conv_kernel_size, rngs=rngs, split_channels=True, backend=backend)
        self.v_sconv = ShortConv(kv_width, cfg.conv_kernel_size, rngs=rngs, split_channels=True, backend=backend)
        self.q_norm = RMSNorm(s.head_dim, cfg.rms_norm_eps, dtype=dtype, backend=backend)
        self.k_norm = RMSNorm(s.head_dim, cfg.rms_norm_eps, dtype=dtype, backend=backend)
        # One bank of bias-vs-distance profiles per layer, shared by all heads: P [d_rel, E].
        self.rel_proj = nnx.Param(normal(rngs, (cfg.d_rel, s.extent), dtype))
        self.mesh = None  # set by `placement.shard_model`: the kernels then run per device on its own heads
        self.backend = backend  # which kernels run (`inkling_jax.backend`)

    def __call__(self, u, positions, *, segment_ids=None, cache: LayerCache | None = None, n_new=None,
                 page_table=None, ring_rows=None, keep_conv_inputs: bool = False):
        """u [B, T, hidden] (normed) at `positions [B, T]`: `project`, `attend`, then `wo`.

        Without a cache the T tokens attend among themselves (segment ids separate packed sequences).
        With a cache the T tokens continue each row at `positions = lengths + t`; only the first `n_new[b]`
        of them are real (right padding); full layers find their pages through `page_table`.
        `keep_conv_inputs`: the K and V ShortConv states come back with every input of the chunk (`ShortConv`).
        Returns (output [B, T, hidden], updated cache fields or None).
        """
        out, updated = self.attend(*self.project(u), positions, segment_ids=segment_ids, cache=cache, n_new=n_new,
                                   page_table=page_table, ring_rows=ring_rows, keep_conv_inputs=keep_conv_inputs)
        return self.wo(out), updated

    def attend(self, q, k, v, r, positions, *, segment_ids=None, cache: LayerCache | None = None, n_new=None,
               page_table=None, ring_rows=None, keep_conv_inputs: bool = False):
        """The sequence-aware part of a call, between the position-wise projections and `wo`: q, k, v, r
        [B, T, width] as `project` gives them -> (out [B, T, heads * head_dim], updated cache fields or None).
        A caller that runs several sets of rows in one pass (`DecoderLayer.over_sets`) projects all their tokens
        at once and attends set by set."""
        batch, seq = q.shape[:2]
        r = r.reshape(batch, seq, self.num_heads, self.d_rel)
        tau = None if self.log_scaling is None else log_scaling_tau(positions, *self.log_scaling)
        if cache is not None and segment_ids is not None:
            raise ValueError("packed segments and a decode cache cannot be combined")
        if cache is not None and seq == 1 and not keep_conv_inputs and kernels.fused_decode_prologue(self.backend):
            q, _, _, new_k, new_v, k_conv, v_conv = kernels.decode_prologue(
                q[:, 0], k[:, 0], v[:, 0], self.k_sconv.weight[...], self.v_sconv.weight[...],
                self.q_norm.weight[...], self.k_norm.weight[...], cache.k_conv, cache.v_conv, cache.k, cache.v,
                self._cache_index(cache, page_table, ring_rows, positions, n_new)[:, 0], backend=self.backend,
                eps=self.q_norm.eps, mesh=self.mesh)
            out = self._decode_attention(new_k, new_v, page_table, ring_rows, q[:, None], r, positions, n_new, tau)
            return out.reshape(batch, seq, -1), dict(k=new_k, v=new_v, k_conv=k_conv, v_conv=v_conv)

        k, k_conv = self.k_sconv(k, None if cache is None else cache.k_conv, segment_ids, n_new, keep_conv_inputs)
        v, v_conv = self.v_sconv(v, None if cache is None else cache.v_conv, segment_ids, n_new, keep_conv_inputs)
        q = self.q_norm(q.reshape(batch, seq, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(batch, seq, self.num_kv_heads, self.head_dim))
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim)

        if cache is None:
            out = kernels.self_attention(q, k, v, r, self.rel_proj[...], positions, backend=self.backend,
                                         window=self.window, tau=tau, segment_ids=segment_ids, mesh=self.mesh)
            updated = None
        else:
            out, new_k, new_v = self._cached_attention(cache, page_table, ring_rows, q, k, v, r, positions, n_new,
                                                       tau)
            updated = dict(k=new_k, v=new_v, k_conv=k_conv, v_conv=v_conv)
        return out.reshape(batch, seq, -1), updated

    def project(self, u):
        """(q, k, v, r) of u [B, T, hidden], flat per token: the position-wise maps. Serving forms replace them
        (`inkling_jax.quant.attention`)."""
        return self.wq(u), self.wk(u), self.wv(u), self.wr(u)

    def _cache_index(self, cache, page_table, ring_rows, positions, n_new):
        """[B, T] row of each token in the cache flattened to [rows, Hkv, D], or -1 where nothing is written:
        padding tokens, and on sliding layers all but the last `window` real tokens (so no two writes collide)."""
        seq = positions.shape[1]
        real = jnp.arange(seq)[None, :] < n_new[:, None]
        if self.local:
            window = cache.k.shape[1]
            keep = real & (jnp.arange(seq)[None, :] >= n_new[:, None] - window)
            rows = jnp.arange(positions.shape[0]) if ring_rows is None else ring_rows
            flat = rows[:, None] * window + jnp.mod(positions, window)
            return jnp.where(keep, flat, -1)
        page_size = cache.k.shape[1]
        page = jnp.take_along_axis(page_table, jnp.minimum(positions // page_size, page_table.shape[1] - 1), axis=1)
        return jnp.where(real, page * page_size + positions % page_size, -1)

    def _decode_attention(self, k_cache, v_cache, page_table, ring_rows, q, r, positions, n_new, tau):
        """A decode step's attention straight over the cache that already holds the new token."""
        lengths = jnp.maximum(positions[:, 0] + n_new, 1)  # idle rows (n_new 0) compute noise, write nothing
        out = kernels.decode_attention(q[:, 0], k_cache, v_cache, r[:, 0], self.rel_proj[...], lengths,
                                       backend=self.backend, page_table=None if self.local else page_table,
                                       ring_rows=ring_rows, window=self.window,
                                       tau=None if tau is None else tau[:, 0], mesh=self.mesh)
        return out[:, None]

    def _cached_attention(self, cache, page_table, ring_rows, q, k, v, r, positions, n_new, tau):
        """Write the chunk's K/V into the cache and attend over the cache (and, on sliding layers, the chunk)."""
        batch, seq = positions.shape
        cached = positions[:, 0]
        step = seq == 1
        # Rings longer than the window by seq - 1 or more (a speculative verify's) take the chunk's writes in slots
        # no query of it reads: they are written first and read in place, like the paged cache.
        in_place = self.local and 1 < seq <= cache.k.shape[1] - self.window + 1
        if self.local and not step and not in_place:  # a page a row: [the ring before the chunk, oldest first | chunk]
            window = cache.k.shape[1]
            rows = jnp.arange(batch) if ring_rows is None else ring_rows
            slots = jnp.mod(cached[:, None] - window + jnp.arange(window)[None, :], window)
            k_pages = jnp.concatenate([cache.k[rows[:, None], slots], k], axis=1)
            v_pages = jnp.concatenate([cache.v[rows[:, None], slots], v], axis=1)
            # The writes below take the chunk from the pages, so they cannot run before the ring is read; without
            # that order XLA copies the whole ring pool twice per array and layer. The barrier keeps XLA from
            # folding the slice back into k, v.
            k_pages, v_pages = lax.optimization_barrier((k_pages, v_pages))
            k, v = k_pages[:, window:], v_pages[:, window:]
            table = jnp.arange(batch, dtype=jnp.int32)[:, None]
            q_start, key_start = jnp.full_like(cached, window), window - jnp.minimum(cached, window)
            key_end = window + n_new
        flat = self._cache_index(cache, page_table, ring_rows, positions, n_new)
        k, v = (pin_heads(self.mesh, (self.num_heads, self.num_kv_heads), a, 2) for a in (k, v))
        new_k, new_v = scatter_rows(cache.k, flat, k), scatter_rows(cache.v, flat, v)
        if step:  # a decode step: attend straight over the cache
            out = self._decode_attention(new_k, new_v, page_table, ring_rows, q, r, positions, n_new, tau)
            return out, new_k, new_v
        if in_place:
            out = kernels.ring_chunk_attention(q, new_k, new_v, ring_rows, r, self.rel_proj[...], backend=self.backend,
                                               cached=cached, n_new=n_new, window=self.window, tau=tau, mesh=self.mesh)
            return out, new_k, new_v
        if not self.local:  # the paged cache, with the chunk already written
            k_pages, v_pages, table = new_k, new_v, page_table
            q_start, key_start, key_end = cached, jnp.zeros_like(cached), cached + n_new
        out = kernels.chunk_attention(q, k_pages, v_pages, table, r, self.rel_proj[...], backend=self.backend,
                                      q_start=q_start, key_start=key_start, key_end=key_end, window=self.window,
                                      tau=tau, mesh=self.mesh, first_position=cached if self.local else None)
        return out, new_k, new_v


def scatter_rows(cache, flat_index, rows):
    """cache [P, S, ...] with rows [B, T, ...] written at flat (p * S + s) indices; negative ones are dropped."""
    flat = cache.reshape(-1, *cache.shape[2:])
    index = jnp.where(flat_index < 0, flat.shape[0], flat_index).reshape(-1)
    flat = flat.at[index].set(rows.reshape(-1, *rows.shape[2:]), mode="drop")
    return flat.reshape(cache.shape)
