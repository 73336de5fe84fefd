"""Prefill chunks over a KV cache: each row's T new tokens attend to its cached keys and to each other (inference
only, no backward). The serving engine's prefill runs this instead of the dense reference, whose [B, H, T, S]
logits grow with the cache (at a 32k-token span, ~2 GB per row and layer).

Positions are key indices: row b's query t sits at index q_start[b] + t, and only keys in [key_start[b],
key_end[b]) exist; distances (causality, the window, the relative bias) are index differences. The keys come
through a page table, key s of row b at row s % page_size of page page_table[b, s // page_size]:
- full layers: the paged cache with the chunk already written, q_start = cached length, key_start = 0,
  key_end = cached + new tokens;
- sliding layers: [the ring in position order | the chunk] as one page per row ([B, W + T, Hkv, D] with table
  [[0], [1], ...]), q_start = W, key_start = W - min(cached, W), key_end = W + new tokens;
- sliding rings that already hold the chunk (decode steps, a speculative verify over rings longer than the
  window), read in place: every table entry of a row names its ring, key indices are positions less a multiple
  of the ring's length (`inkling_jax.nn.cache.ring_as_pages`).
One program per (query block, KV head, row) walks only the key blocks inside [key_start, key_end), the causal
limit and the window; keys are gathered row by row from their pages (Pallas Triton backend), so no copy of the
span is made. The tiles, relative bias and online softmax are forward.py's (tiles.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import interpret_default
from pallas_kernels.decode_attention.kernel import load_valid_rows
from pallas_kernels.rel_attention import tiles, tuning
from pallas_kernels.rel_attention.tiles import Blocks, Geometry


def _chunk_kernel(q_start_ref, key_start_ref, key_end_ref, table_ref, k_ref, v_ref, p_ref, q_ref, r_ref, tau_ref,
                  o_ref, *, geo: Geometry):
    b, g = pl.program_id(2), pl.program_id(1)
    bk, dim, page_size = geo.blocks.block_k, geo.head_dim, k_ref.shape[1]
    key_start, key_end = key_start_ref[b], key_end_ref[b]
    t0 = pl.program_id(0) * geo.blocks.block_q
    rows = tiles.load_rows(geo, t0, g, q_ref, r_ref, tau_ref, None, q_offset=q_start_ref[b])
    shear = tiles.shear_index(geo)

    def step(with_bias):
        def body(kb, carry):
            k0 = kb * bk
            index = k0 + jnp.arange(bk)
            valid = (index >= key_start) & (index < key_end)
            # Table entries of absent keys may hold anything: page 0 is addressed there instead (never read).
            page = jnp.where(valid, table_ref[b, jnp.where(valid, index // page_size, 0)], 0)
            cells = (page[:, None], (index % page_size)[:, None], g, jnp.arange(dim)[None, :])
            k, v = load_valid_rows(k_ref.at[cells], valid), load_valid_rows(v_ref.at[cells], valid)
            bias = tiles.sheared_bias(rows, tiles.load_band(geo, p_ref, rows.p0, k0), shear) if with_bias else None
            s = tiles.tile_logits(geo, rows, k, k0, None, bias=bias, mask=True)
            return tiles.online_softmax_step(carry, jnp.where(valid[None, :], s, tiles.NEG), v)
        return body

    lo, near, _, end = tiles.key_block_ranges(geo, rows.p0)
    lo = jnp.maximum(lo, key_start // bk)
    end = jnp.maximum(jnp.minimum(end, tiles.ceil_div(key_end, bk)), lo)
    near = jnp.clip(near, lo, end)
    carry = (jnp.full((geo.rows,), tiles.NEG, jnp.float32), jnp.zeros((geo.rows,), jnp.float32),
             jnp.zeros((geo.rows, dim), jnp.float32))
    carry = tiles.fori(lo, near, step(False), carry)
    _, l, acc = tiles.fori(near, end, step(True), carry)
    tok, head = tiles.row_index(geo, t0, g)
    # A row with no key at all (an idle batch row) gives zeros rather than 0 / 0.
    o_ref[tok, head, :] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "blocks"))
def rel_chunk_attention(q, k_pages, v_pages, page_table, r, rel_proj, *, q_start, key_start, key_end,
                        window: int | None = None, tau=None, scale: float | None = None,
                        interpret: bool | None = None, blocks: Blocks | None = None):
    """Attention of prefill chunks over a cache, with Inkling's relative bias; returns [B, T, Hq, D] in q.dtype.

    Args:
      q: [B, T, Hq, D] normed queries (not tau-scaled); r: [B, T, Hq, d_rel]; rel_proj: P [d_rel, E].
      k_pages, v_pages: [num_pages, page_size, Hkv, D]; key s of row b is row s % page_size of page
        page_table[b, s // page_size]; page_table: [B, pages] int (entries of absent keys are ignored).
      q_start, key_start, key_end: [B] int: query t of row b sits at key index q_start[b] + t and sees the
        keys s with key_start[b] <= s < key_end[b], s <= its own index (and within the window).
      window: sliding window length counting the query itself, or None for full attention.
      tau: optional [B, T] fp32 log-scaling that multiplies the whole logit.
      scale: defaults to 1 / head_dim.
      blocks: the tile (block_q counts tokens) and launch parameters; default `tuning.chunk`.
    """
    batch, seq_q, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    d_rel, extent = rel_proj.shape
    if (heads % kv_heads or r.shape != (batch, seq_q, heads, d_rel) or k_pages.shape != v_pages.shape
            or k_pages.shape[-1] != dim or page_table.shape[0] != batch):
        raise ValueError(f"bad shapes q {q.shape} pages {k_pages.shape} {v_pages.shape} table {page_table.shape} "
                         f"r {r.shape} P {rel_proj.shape}")
    groups = heads // kv_heads
    blocks = blocks or tuning.chunk(groups, seq_q)
    seq_q_pad = tiles.ceil_div(seq_q, blocks.block_q) * blocks.block_q
    span = page_table.shape[1] * page_size
    geo = Geometry(groups=groups, head_dim=dim, d_rel=d_rel, extent=extent, window=window, q_offset=0,
                   segmented=False, scale=float(1.0 / dim if scale is None else scale), seq_q=seq_q_pad,
                   seq_k=tiles.ceil_div(span, blocks.block_k) * blocks.block_k, rel_left=2 * blocks.block_k,
                   interpret=interpret_default() if interpret is None else bool(interpret), blocks=blocks)

    def pad_tokens(x, value=0):
        return jnp.pad(x, [(0, 0), (0, seq_q_pad - seq_q)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

    tau = jnp.ones((batch, seq_q), jnp.float32) if tau is None else tau.astype(jnp.float32)
    p = jnp.pad(rel_proj.astype(q.dtype), ((0, 0), (geo.rel_left, geo.rel_left)))
    whole = [jnp.asarray(x, jnp.int32) for x in (q_start, key_start, key_end, page_table)] + [k_pages, v_pages, p]
    per_row = [pad_tokens(q), pad_tokens(r), pad_tokens(tau, 1.0)]
    out = pl.pallas_call(
        functools.partial(_chunk_kernel, geo=geo),
        grid=(seq_q_pad // blocks.block_q, kv_heads, batch),
        in_specs=[pl.BlockSpec()] * len(whole) + [tiles.batch_spec(x.shape) for x in per_row],
        out_specs=tiles.batch_spec(per_row[0].shape),
        out_shape=jax.ShapeDtypeStruct(per_row[0].shape, q.dtype),
        compiler_params=tiles.compiler_params(geo),
        interpret=geo.interpret,
        name="rel_chunk_attention",
    )(*whole, *per_row)
    return out[:, :seq_q]
