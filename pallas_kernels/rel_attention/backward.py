"""Backward kernels, FlashAttention-2 style, rebuilding probabilities from the saved base-2 logsumexp.

- dK/dV: one program per (key block, KV head, batch) walks the query blocks that see it, on keys-major tiles
  (s^T = k q^T), so p^T and ds^T come out of the matmuls already transposed; no atomics.
- dQ/dr/dP: one program per (query block, KV head, batch) walks its key tiles. The bias gradient of a tile,
  dbias = dlogit * tau, is un-sheared back onto the tile's band of distances (U [rows, 2 * block_k]); then
  dr += U @ P_band^T and the band's share of dP is r^T @ U. Walking the key tiles from the diagonal outwards,
  consecutive bands overlap by exactly one half, so each program emits one finished [d_rel, block_k] chunk of
  dP per tile, at offsets relative to its own first band; XLA adds the chunks of all programs into dP.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.rel_attention import tiles
from pallas_kernels.rel_attention.row_gather import take_along_axis
from pallas_kernels.rel_attention.tiles import Geometry


def _dkdv_kernel(q_ref, k_ref, v_ref, r_ref, p_ref, tau_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
                 dk_ref, dv_ref, *, geo: Geometry):
    bk = geo.blocks.block_k
    k0 = pl.program_id(0) * bk  # early keys are seen by the most queries: they go first
    g = pl.program_id(1)
    k = k_ref[pl.ds(k0, bk), g, :]
    v = v_ref[pl.ds(k0, bk), g, :]
    shear = tiles.shear_index(geo, keys_major=True)

    def step(with_bias, mask):
        def body(qb, carry):
            dk, dv = carry
            t0 = qb * geo.blocks.block_q
            rows = tiles.load_rows(geo, t0, g, q_ref, r_ref, tau_ref, qseg_ref)
            tok, head = tiles.row_index(geo, t0, g)
            do = do_ref[tok, head, :]
            bias = tiles.sheared_bias(rows, tiles.load_band(geo, p_ref, rows.p0, k0), shear,
                                      keys_major=True) if with_bias else None
            s = tiles.tile_logits(geo, rows, k, k0, kseg_ref, bias=bias, mask=mask, keys_major=True)
            p = jnp.exp2(s - lse_ref[tok, head][None, :])  # [keys, rows]
            dv = dv + tiles.dot(p.astype(do.dtype), do)
            dlogit = p * (tiles.dot_t(v, do) - delta_ref[tok, head][None, :])
            dscore = (dlogit * (rows.tau * geo.scale)[None, :]).astype(rows.q.dtype)
            return dk + tiles.dot(dscore, rows.q), dv
        return body

    lo, diag, near, end = tiles.query_block_ranges(geo, k0)
    carry = (jnp.zeros((bk, geo.head_dim), jnp.float32),) * 2
    for start, stop, mask in tiles.bias_loops(geo, lo, diag, near, diagonal_first=True):
        carry = tiles.fori(start, stop, step(True, mask), carry)
    dk, dv = tiles.fori(near, end, step(False, geo.masked), carry)
    dk_ref[pl.ds(k0, bk), g, :] = dk.astype(dk_ref.dtype)
    dv_ref[pl.ds(k0, bk), g, :] = dv.astype(dv_ref.dtype)


def rel_chunks(geo: Geometry) -> int:
    """dP chunks of block_k distances one dQ program emits: enough for every band it can meet."""
    return (geo.blocks.block_q + geo.extent - 2) // geo.blocks.block_k + 3


def _dq_kernel(q_ref, k_ref, v_ref, r_ref, p_ref, tau_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
               *refs, geo: Geometry):
    dq_plain_ref, (dq_ref, dr_ref, dp_ref) = (refs[0], refs[1:]) if len(refs) == 4 else (None, refs)
    n_blocks = geo.seq_q // geo.blocks.block_q
    qb = n_blocks - 1 - pl.program_id(0)
    g = pl.program_id(1)
    bk = geo.blocks.block_k
    t0 = qb * geo.blocks.block_q
    rows = tiles.load_rows(geo, t0, g, q_ref, r_ref, tau_ref, qseg_ref)
    tok, head = tiles.row_index(geo, t0, g)
    do, lse, delta = do_ref[tok, head, :], lse_ref[tok, head], delta_ref[tok, head]
    shear = tiles.shear_index(geo)
    unshear, inside = tiles.unshear_index(geo)
    lo, near, diag, end = tiles.key_block_ranges(geo, rows.p0)

    def step(with_bias, mask):
        def body(kb, carry):
            k0 = kb * bk
            k = k_ref[pl.ds(k0, bk), g, :]
            band = tiles.load_band(geo, p_ref, rows.p0, k0) if with_bias else None
            bias = tiles.sheared_bias(rows, band, shear) if with_bias else None
            s = tiles.tile_logits(geo, rows, k, k0, kseg_ref, bias=bias, mask=mask)
            p = jnp.exp2(s - lse[:, None])
            dlogit = p * (tiles.dot_t(do, v_ref[pl.ds(k0, bk), g, :]) - delta[:, None])
            dscore = (dlogit * (rows.tau * geo.scale)[:, None]).astype(k.dtype)
            dq = carry[0] + tiles.dot(dscore, k)
            if not with_bias:
                return (dq,) + carry[1:]
            _, dr, pending = carry
            dbias = (dlogit * rows.tau[:, None]).astype(rows.r.dtype)
            u = jnp.where(inside, take_along_axis(dbias, unshear, 1), jnp.zeros((), dbias.dtype))
            dr = dr + tiles.dot(u, band.T)
            first_half, second_half = jnp.split(tiles.dot(rows.r.T, u), 2, axis=1)
            dp_ref[:, pl.ds((end - 1 - kb) * bk, bk)] = pending + first_half
            return dq, dr, second_half
        return body

    carry = (jnp.zeros((geo.rows, geo.head_dim), jnp.float32), jnp.zeros((geo.rows, geo.d_rel), jnp.float32),
             jnp.zeros((geo.d_rel, bk), jnp.float32))
    # From the diagonal outwards, so that consecutive bands overlap by one half.
    for start, stop, mask in reversed(tiles.bias_loops(geo, near, diag, end, diagonal_first=False)):
        carry = tiles.fori(start, stop, step(True, mask), carry, descending=True)
    if dq_plain_ref is None:
        dq, dr, pending = tiles.fori(lo, near, step(False, geo.masked), carry, descending=True)
    else:  # the key tiles [lo, near) were done elsewhere (mgpu_dq.py): add their dq
        dq, dr, pending = carry
        dq = dq + dq_plain_ref[tok, head, :].astype(jnp.float32)
    last = end - near  # chunk index of the pending half; chunks after it are zero
    dp_ref[:, pl.ds(last * bk, bk)] = pending

    def zero_chunk(c, carry):
        dp_ref[:, pl.ds(c * bk, bk)] = jnp.zeros((geo.d_rel, bk), jnp.float32)
        return carry
    jax.lax.fori_loop(last + 1, rel_chunks(geo), zero_chunk, 0)
    dq_ref[tok, head, :] = dq.astype(dq_ref.dtype)
    dr_ref[tok, head, :] = dr


def _first_band_start(geo: Geometry):
    """Distance of column 0 of every dQ program's chunks (its diagonal tile's band), per query block."""
    tq, bk = geo.blocks.block_q, geo.blocks.block_k
    p0 = geo.q_offset + np.arange(geo.seq_q // tq) * tq
    end = np.minimum(p0 + tq - 1, geo.seq_k - 1) // bk + 1
    return p0 - end * bk + 1


def _sum_rel_chunks(geo: Geometry, chunks, width):
    """[B, Hkv, n_blocks, d_rel, C] chunks, in query-block order -> the gradient of the padded P [d_rel, width].
    Query blocks whose chunks start at the same distance are summed first (a few groups: the start depends on
    the block's position modulo block_k), then each group sum lands on its columns; no scatter."""
    starts = _first_band_start(geo)
    offsets, group = np.unique(starts, return_inverse=True)
    one_hot = np.eye(len(offsets), dtype=np.float32)[group]  # [n_blocks, groups]
    # HIGHEST: on GPU an fp32 einsum would otherwise run in TF32, too coarse for dP (~1e-4 relative error)
    sums = jnp.einsum("ndc,nk->kdc", chunks.sum(axis=(0, 1)), one_hot, precision=jax.lax.Precision.HIGHEST)
    grad = jnp.zeros((geo.d_rel, width), jnp.float32)
    for i, offset in enumerate(offsets):
        col = geo.rel_left + int(offset)  # >= 0: a band never starts below -(block_q + block_k)
        cols = min(sums.shape[-1], width - col)
        grad = grad.at[:, col:col + cols].add(sums[i, :, :cols])
    return grad


def _call(kernel, geo, grid, args, out_shape, out_specs, name):
    in_specs = [tiles.whole_spec(a.shape) if i == 4 else tiles.batch_spec(a.shape) for i, a in enumerate(args)]
    return pl.pallas_call(
        functools.partial(kernel, geo=geo), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, compiler_params=tiles.compiler_params(geo), interpret=geo.interpret, name=name,
    )(*args)


def residual_args(q, k, v, r, p, tau, qseg, kseg, out, lse, dout):
    """Kernel operands of both backward kernels: the forward's inputs, dout, lse and delta = rowsum(dout * out)."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return q, k, v, r, p, tau, qseg, kseg, dout, lse, delta


def dkdv(geo: Geometry, *args):
    q, k, v = args[:3]
    shapes = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    grid = (k.shape[1] // geo.blocks.block_k, k.shape[2], q.shape[0])
    return _call(_dkdv_kernel, geo, grid, args, shapes, [tiles.batch_spec(s.shape) for s in shapes],
                 "rel_attention_dkdv")


def dq(geo: Geometry, *args, dq_plain=None):
    """-> (dq, dr fp32, gradient of the padded P fp32); args as residual_args returns. With dq_plain ([B, T, Hq, D],
    the dq of every query block's key tiles that carry no bias, [lo, near) of tiles.key_block_ranges), the kernel
    walks only the tiles that carry bias and adds dq_plain to its dq."""
    args = args if dq_plain is None else (*args, dq_plain)
    q, k, r = args[0], args[1], args[3]
    batch, kv_heads, n_blocks = q.shape[0], k.shape[2], q.shape[1] // geo.blocks.block_q
    chunks = jax.ShapeDtypeStruct(
        (batch, kv_heads, n_blocks, geo.d_rel, rel_chunks(geo) * geo.blocks.block_k), jnp.float32)
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(r.shape, jnp.float32), chunks)
    out_specs = [tiles.batch_spec(shapes[0].shape), tiles.batch_spec(shapes[1].shape),
                 pl.BlockSpec((None, None, None) + chunks.shape[3:], lambda i, g, b: (b, g, i, 0, 0))]
    grad_q, grad_r, chunks = _call(_dq_kernel, geo, (n_blocks, kv_heads, batch), args, shapes, out_specs,
                                   "rel_attention_dq")
    # Program i of the dQ grid handled query block n_blocks - 1 - i.
    return grad_q, grad_r, _sum_rel_chunks(geo, chunks[:, :, ::-1], args[4].shape[1])
