"""The decode cache: what a sequence must keep between steps.

Per layer:
- K and V after their ShortConv (K also after its norm, never tau-scaled). Full-attention layers keep every
  position in pages, `[num_pages, page_size, Hkv, D]`, shared by all rows through `page_table [B, pages_per_row]`
  (position p of row b lives in page `page_table[b, p // page_size]` at offset `p % page_size`); sliding layers
  keep a ring of `window` slots per row (or a few more, `ring_slack`), where position p lives in slot
  p % slots, so their memory never grows with the sequence.
- The four ShortConv states (k, v, attention output, MLP output): the last `width - 1` conv *inputs*.
Plus `lengths [B]`: tokens already in the cache per row (rows may differ). `init_cache` gives each row its own
contiguous pages; a server hands pages out from a shared pool instead, by writing `page_table`. Likewise
`ring_rows [B]` (None: row b's own) names the ring of each row, so that a server's step over a few of its
sequences uses their rings in place (a ring is megabytes per row; gathering and scattering them cost more than
the attention that reads them).

All shapes are fixed by (batch, max_len), so prefill and decode steps jit once per shape.
"""

import math

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
    page_table: jax.Array  # [B, pages_per_row] int32, pages of the full-attention layers
    layers: tuple[LayerCache, ...]
    ring_rows: jax.Array | None = None  # [B] int32, rows of the sliding layers' rings; None: row b uses ring b

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]


DEFAULT_PAGE_SIZE = 16


def init_layer_cache(cfg: TextConfig, local: bool, batch: int, num_pages: int, page_size: int, dtype,
                     ring_slack: int = 0) -> LayerCache:
    shape = cfg.attention(local)
    hist = cfg.conv_kernel_size - 1
    kv_width = shape.num_kv_heads * shape.head_dim
    rows = (batch, shape.window + ring_slack) if local else (num_pages, page_size)
    kv_shape = rows + (shape.num_kv_heads, shape.head_dim)
    # Every field its own buffer: the jitted steps donate the cache, and a buffer cannot be donated twice.
    return LayerCache(k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype),
                      k_conv=jnp.zeros((batch, hist, kv_width), dtype),
                      v_conv=jnp.zeros((batch, hist, kv_width), dtype),
                      attn_conv=jnp.zeros((batch, hist, cfg.hidden_size), dtype),
                      mlp_conv=jnp.zeros((batch, hist, cfg.hidden_size), dtype))


def init_cache(cfg: TextConfig, batch: int, max_len: int, dtype=jnp.float32, *, page_size: int = DEFAULT_PAGE_SIZE,
               num_pages: int | None = None, ring_slack: int = 0) -> Cache:
    """An empty cache for `batch` rows of up to `max_len` tokens each.

    By default every row owns ceil(max_len / page_size) contiguous pages; pass `num_pages` to size a shared
    pool (the page table then starts all-zero and the caller assigns pages). `ring_slack`: slots the sliding
    layers' rings hold past the window: n of them let a step write n positions past what its row keeps without
    overwriting a position the window still holds (speculative decoding's verify and draft chains).
    """
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's context of {cfg.max_position_embeddings}")
    if ring_slack < 0:
        raise ValueError(f"ring_slack must be >= 0, got {ring_slack}")
    per_row = -(-max_len // page_size)
    if num_pages is None:
        num_pages = batch * per_row
        page_table = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, per_row)
    else:
        page_table = jnp.zeros((batch, per_row), jnp.int32)
    layers = tuple(init_layer_cache(cfg, cfg.is_local(i), batch, num_pages, page_size, dtype, ring_slack)
                   for i in range(cfg.num_layers))
    return Cache(lengths=jnp.zeros((batch,), jnp.int32), page_table=page_table, layers=layers)


def cache_bytes(cfg: TextConfig, batch: int, max_len: int, dtype=jnp.bfloat16, **kwargs) -> int:
    """Memory an `init_cache` of this size takes, without allocating it."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, max_len, dtype, **kwargs))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def ring_as_pages(rows, ring_len: int, first_key, span: int, align: int = 1):
    """Sliding rings [N, ring_len, ...] read in place as one page each through a page table (the chunk kernel's
    layout, `pallas_kernels/rel_attention/chunk.py`): every entry of row b's table names its ring `rows[b]`, so
    key index i reads slot i % ring_len. Returns (table [B, n], base [B]): key index = position - base, base a
    multiple of ring_len (and of `align`, which keeps key blocks at absolute positions) at most first_key [B],
    the table long enough for the `span` positions from first_key on."""
    period = math.lcm(ring_len, align)
    base = first_key // period * period
    table = jnp.broadcast_to(rows.astype(jnp.int32)[:, None], (rows.shape[0], -(-(period + span) // ring_len)))
    return table, base
