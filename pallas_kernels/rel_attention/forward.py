"""Forward kernel: online softmax over the key tiles of one (query block, KV head, batch) program.

Returns the output and the base-2 logsumexp of every row, which the backward kernels read to rebuild the
probabilities without a second softmax pass.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.rel_attention import tiles
from pallas_kernels.rel_attention.tiles import Geometry


def _forward_kernel(q_ref, k_ref, v_ref, r_ref, p_ref, tau_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *,
                    geo: Geometry):
    n_blocks = geo.seq_q // geo.blocks.block_q
    qb = n_blocks - 1 - pl.program_id(0)  # longest causal rows first
    g = pl.program_id(1)
    bk = geo.blocks.block_k
    t0 = qb * geo.blocks.block_q
    rows = tiles.load_rows(geo, t0, g, q_ref, r_ref, tau_ref, qseg_ref)
    shear = tiles.shear_index(geo)

    def step(with_bias, mask):
        def body(kb, carry):
            k0 = kb * bk
            k = k_ref[pl.ds(k0, bk), g, :]
            bias = tiles.sheared_bias(rows, tiles.load_band(geo, p_ref, rows.p0, k0), shear) if with_bias else None
            s = tiles.tile_logits(geo, rows, k, k0, kseg_ref, bias=bias, mask=mask)
            return tiles.online_softmax_step(carry, s, v_ref[pl.ds(k0, bk), g, :])
        return body

    lo, near, diag, end = tiles.key_block_ranges(geo, rows.p0)
    carry = (jnp.full((geo.rows,), tiles.NEG, jnp.float32), jnp.zeros((geo.rows,), jnp.float32),
             jnp.zeros((geo.rows, geo.head_dim), jnp.float32))
    carry = tiles.fori(lo, near, step(False, geo.masked), carry)
    for start, stop, mask in tiles.bias_loops(geo, near, diag, end, diagonal_first=False):
        carry = tiles.fori(start, stop, step(True, mask), carry)
    m, l, acc = carry
    tok, head = tiles.row_index(geo, t0, g)
    o_ref[tok, head, :] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[tok, head] = m + jnp.log2(l)


def forward(geo: Geometry, q, k, v, r, p, tau, qseg, kseg):
    """Padded inputs (p: P with geo.rel_left zero columns either side) -> (out [B, Tq, Hq, D], base-2
    logsumexp [B, Tq, Hq] fp32)."""
    batch, seq_q, heads, _ = q.shape
    kv_heads = k.shape[2]
    args = (q, k, v, r, p, tau, qseg, kseg)
    in_specs = [tiles.whole_spec(a.shape) if a is p else tiles.batch_spec(a.shape) for a in args]
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, seq_q, heads), jnp.float32))
    return pl.pallas_call(
        functools.partial(_forward_kernel, geo=geo),
        grid=(seq_q // geo.blocks.block_q, kv_heads, batch),
        in_specs=in_specs,
        out_specs=[tiles.batch_spec(s.shape) for s in out_shape],
        out_shape=out_shape,
        compiler_params=tiles.compiler_params(geo),
        interpret=geo.interpret,
        name="rel_attention_forward",
    )(*args)
