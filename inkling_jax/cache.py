"""The decode cache: what a sequence must keep between steps.

Per layer:
- K and V after their ShortConv (K also after its norm, never tau-scaled). Full-attention layers keep every
  position, `[B, max_len, Hkv, D]`; sliding layers keep a ring of exactly `window` slots, where position p lives
  in slot p % window, so their memory never grows with the sequence.
- The four ShortConv states (k, v, attention output, MLP output): the last `width - 1` conv *inputs*.
Plus `lengths [B]`: tokens already in the cache per row (rows may differ).

All shapes are fixed by (batch, max_len), so prefill and decode steps jit once per shape.
"""

import jax
import jax.numpy as jnp
from flax import struct

from inkling_jax.config import TextConfig


@struct.dataclass
class LayerCache:
    k: jax.Array
    v: jax.Array
    k_conv: jax.Array
    v_conv: jax.Array
    attn_conv: jax.Array
    mlp_conv: jax.Array


@struct.dataclass
class Cache:
    lengths: jax.Array  # [B] int32
    layers: tuple[LayerCache, ...]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


def init_layer_cache(cfg: TextConfig, local: bool, batch: int, max_len: int, dtype) -> LayerCache:
    shape = cfg.attention(local)
    slots = shape.window if local else max_len
    hist = cfg.conv_kernel_size - 1
    kv_width = shape.num_kv_heads * shape.head_dim
    kv_shape = (batch, slots, shape.num_kv_heads, shape.head_dim)
    # Every field its own buffer: the jitted steps donate the cache, and a buffer cannot be donated twice.
    return LayerCache(k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype), k_conv=jnp.zeros((batch, hist, kv_width), dtype),
                      v_conv=jnp.zeros((batch, hist, kv_width), dtype),
                      attn_conv=jnp.zeros((batch, hist, cfg.hidden_size), dtype),
                      mlp_conv=jnp.zeros((batch, hist, cfg.hidden_size), dtype))


def init_cache(cfg: TextConfig, batch: int, max_len: int, dtype=jnp.float32) -> Cache:
    """An empty cache for `batch` rows of up to `max_len` tokens each."""
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's context of {cfg.max_position_embeddings}")
    layers = tuple(init_layer_cache(cfg, cfg.is_local(i), batch, max_len, dtype) for i in range(cfg.num_layers))
    return Cache(lengths=jnp.zeros((batch,), jnp.int32), layers=layers)


def cache_bytes(cfg: TextConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> int:
    """Memory an `init_cache` of this size takes, without allocating it."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, max_len, dtype))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
