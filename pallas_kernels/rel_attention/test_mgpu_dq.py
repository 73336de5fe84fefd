"""The Mosaic GPU (wgmma) dQ of the key tiles without bias (mgpu_dq.py) and its split with the Triton dQ.

On a GPU these run the compiled kernel. On CPU the Mosaic ones need Pallas' Mosaic GPU interpreter (minutes): there
they run only with REL_ATTENTION_MOSAIC_INTERPRET=1, eagerly (inside one jit with the interpreted Triton dQ, the
interpreter's warpgroup threads deadlocked on a 2-core machine). Shapes: 3+ query CTAs and 3+ key blocks of 64
beyond E, lengths that are not multiples of the tiles, both GQA group sizes of Inkling, a q_offset > 0 case.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rel_attention import (
    backward,
    forward,
    kernel,
    mgpu_dq,
    rel_attention,
    tiles,
    tuning,
)
from pallas_kernels.rel_attention.test_mgpu_forward import D_REL, HEAD_DIM, _inputs, needs_gpu_or_interpreter
from pallas_kernels.rel_attention.tiles import LOG2E, Geometry


def _residuals(seq_q, heads, kv_heads, extent, window, q_offset, dtype, seed):
    """Padded residual operands (backward.residual_args) after the Triton forward, the geometries of the Triton dQ
    and of the Mosaic dQ, and the unpadded inputs, tau and cotangent."""
    inputs, tau, cotangent = _inputs(seq_q, q_offset + seq_q, heads, kv_heads, extent, seed, dtype)
    groups = heads // kv_heads
    tuned = tuning.blocks(groups, HEAD_DIM, window)
    geos, args = kernel.prepare(*inputs, q_offset=q_offset, window=window, tau=tau, segment_ids=None, scale=None,
                                interpret=None, blocks=(tuned[0], tuned[2], tuning.mosaic_forward(groups)))
    out, lse = jax.jit(lambda *a: forward.forward(geos[0], *a))(*args)
    padded_ct = jnp.pad(cotangent, ((0, 0), (0, geos[0].seq_q - seq_q), (0, 0), (0, 0)))
    return backward.residual_args(*args, out, lse, padded_ct), geos[1], geos[2], (inputs, tau, cotangent)


def _dense_plain_dq(geo, split, q, k, v, r, p, tau, qseg, kseg, dout, lse, delta):
    """The dq of the keys before split's first tile with bias, per query token, from dense fp32 matrices."""
    f32 = lambda x: x.astype(jnp.float32)
    kk, vv = (jnp.repeat(f32(x), geo.groups, axis=2) for x in (k, v))  # [B, S, Hq, D]
    coef = tau * (geo.scale * LOG2E)  # [B, T]
    with jax.default_matmul_precision("highest"):
        s = jnp.einsum("bthd,bshd->bhts", f32(q), kk) * coef[:, None, :, None]
        prob = jnp.exp2(s - lse.transpose(0, 2, 1)[..., None])
        dp = jnp.einsum("bthd,bshd->bhts", f32(dout), vv)
        tq, bk = split.blocks.block_q, split.blocks.block_k
        p0 = geo.q_offset + (np.arange(geo.seq_q) // tq) * tq
        plain_end = tiles.key_block_ranges(split, p0)[1] * bk  # [T] first key of a tile with bias
        plain = jnp.arange(geo.seq_k)[None, :] < plain_end[:, None]
        ds = jnp.where(plain, prob * (dp - delta.transpose(0, 2, 1)[..., None]), 0.0)
        return jnp.einsum("bhts,bshd->bthd", ds, kk) * (coef / LOG2E)[:, :, None, None]


def _max_error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max()), float(np.abs(want).max())


@needs_gpu_or_interpreter
@pytest.mark.parametrize("seq_q, kv_heads, extent, q_offset", [
    (250, 1, 40, 0),  # group 8: 16 CTAs of 16 tokens, up to 3 key blocks beyond E
    (75, 2, 30, 170),  # group 4 after a cache: 4 CTAs of 32 tokens, 2-3 key blocks beyond E
])
def test_split_dq_matches_dense_plain_part_triton_dq_and_reference(seq_q, kv_heads, extent, q_offset):
    heads = 8
    args, geo_triton, geo_mosaic, (inputs, tau, cotangent) = _residuals(
        seq_q, heads, kv_heads, extent, None, q_offset, jnp.bfloat16, seed=seq_q)
    assert mgpu_dq.supports(geo_mosaic, jnp.bfloat16)

    got = mgpu_dq.dq_split(geo_triton, geo_mosaic, *args)  # one interpreted Mosaic run (minutes): checked thrice
    dense_plain = _dense_plain_dq(geo_mosaic, geo_triton, *args)
    with_dense_plain = jax.jit(lambda *a: backward.dq(geo_triton, *a[:-1], dq_plain=a[-1]))(
        *args, dense_plain.astype(jnp.bfloat16))
    err, scale = _max_error(got[0], with_dense_plain[0])
    plain_scale = _max_error(dense_plain, dense_plain)[1]
    # 1% of the plain part's largest value, plus one bf16 rounding of the sum (the dq, not its plain part, is rounded)
    assert plain_scale > 0 and err <= 1e-2 * plain_scale + 2.0 ** -8 * scale, (
        f"dq vs a dense plain part: {err} vs {plain_scale} (whole dq {scale})")

    want = jax.jit(lambda *a: backward.dq(geo_triton, *a))(*args)
    for name, x, y in zip(("dq", "dr", "dP"), got, want):
        assert x.shape == y.shape and x.dtype == y.dtype, name
    err, scale = _max_error(got[0], want[0])
    assert err <= 1e-2 * scale, f"dq vs the Triton dQ: {err} vs {scale}"
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5 * float(jnp.abs(want[1]).max()))
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5 * float(jnp.abs(want[2]).max()))

    q_pos = jnp.arange(seq_q)[None] + q_offset
    k_pos = jnp.arange(q_offset + seq_q)[None]
    with jax.default_matmul_precision("highest"):
        _, vjp = jax.vjp(lambda q: rel_attention(q, *[x.astype(jnp.float32) for x in inputs[1:]], q_pos, k_pos,
                                                 tau=tau), inputs[0].astype(jnp.float32))
        want_dq = vjp(cotangent.astype(jnp.float32))[0]
    err, scale = _max_error(got[0][:, :seq_q], want_dq)
    assert err <= 3e-2 * scale, f"dq vs jax.grad of the reference: {err} vs {scale}"


def test_triton_dq_alone_where_the_mosaic_dq_does_not_apply():
    """Sliding layers (no tiles without bias) and fp32 fall back to the Triton dQ, bit for bit."""
    for window, dtype in ((24, jnp.bfloat16), (None, jnp.float32)):
        args, geo_triton, geo_mosaic, _ = _residuals(70, 8, 2, 24, window, 5, dtype, seed=3)
        assert not mgpu_dq.supports(geo_mosaic, dtype)
        got = mgpu_dq.dq_split(geo_triton, geo_mosaic, *args)
        want = backward.dq(geo_triton, *args)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)


def test_rejects_a_split_that_cuts_its_tiles():
    args, geo_triton, geo_mosaic, _ = _residuals(70, 8, 1, 24, None, 0, jnp.bfloat16, seed=4)
    split = dataclasses.replace(geo_triton, blocks=dataclasses.replace(geo_triton.blocks, block_k=32))
    with pytest.raises(ValueError):
        mgpu_dq.dq_plain(geo_mosaic, *args, split=split)


@pytest.mark.parametrize("groups", [8, 4])
def test_row_vectors_are_head_major_per_tile(groups):
    batch, seq, kv_heads = 2, 64, 2
    geo = Geometry(groups=groups, head_dim=HEAD_DIM, d_rel=D_REL, extent=16, window=None, q_offset=0,
                   segmented=False, scale=0.125, seq_q=seq, seq_k=seq, rel_left=128, interpret=True,
                   blocks=tuning.mosaic_forward(groups))
    rng = np.random.default_rng(groups)
    lse, delta = (jnp.asarray(rng.standard_normal((batch, seq, kv_heads * groups)), jnp.float32) for _ in range(2))
    tau = jnp.asarray(1.0 + rng.random((batch, seq)), jnp.float32)
    rows = np.asarray(mgpu_dq.row_vectors(geo, lse, delta, tau))
    n_tok = 64 // groups
    assert rows.shape == (batch, kv_heads, seq // n_tok, 3, 64)
    for b, g, tile, h, t in [(0, 0, 0, 0, 0), (1, 1, 3, groups - 1, n_tok - 1), (1, 0, 2, 1, 3)]:
        token, head = tile * n_tok + t, g * groups + h
        np.testing.assert_allclose(rows[b, g, tile, :, h * n_tok + t],
                                   [lse[b, token, head], delta[b, token, head],
                                    tau[b, token] * geo.scale * LOG2E], rtol=1e-6)
