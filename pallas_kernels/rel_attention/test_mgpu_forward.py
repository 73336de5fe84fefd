"""The Mosaic GPU (wgmma) forward vs the reference and the Triton forward, and jax.grad through it.

On a GPU these run the compiled kernel. On CPU they need Pallas' Mosaic GPU interpreter, which simulates every
warpgroup, barrier and TMA of every CTA and takes minutes: there they run only with REL_ATTENTION_MOSAIC_INTERPRET=1.
Shapes: 3+ query CTAs and 3+ key blocks of 64, lengths that are not multiples of the tiles, both layer kinds.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import interpret_default
from pallas_kernels.rel_attention import (
    forward,
    kernel,
    mgpu_forward,
    rel_attention,
    relative_bias,
    toeplitz,
    tuning,
)
from pallas_kernels.rel_attention.tiles import LOG2E

needs_gpu_or_interpreter = pytest.mark.skipif(
    interpret_default() and not os.environ.get("REL_ATTENTION_MOSAIC_INTERPRET"),
    reason="the Mosaic GPU interpreter takes minutes on CPU")

HEAD_DIM = 64
D_REL = 16


def _inputs(seq_q, seq_k, heads, kv_heads, extent, seed, dtype=jnp.bfloat16):
    """(q, k, v, r, P), tau and an output cotangent, random."""
    rng = np.random.default_rng(seed)
    normal = lambda scale, *shape: jnp.asarray(scale * rng.standard_normal(shape), dtype)
    operands = (normal(2.0, 1, seq_q, heads, HEAD_DIM), normal(2.0, 1, seq_k, kv_heads, HEAD_DIM),
                normal(1.0, 1, seq_k, kv_heads, HEAD_DIM), normal(0.5, 1, seq_q, heads, D_REL),
                normal(1.0, D_REL, extent))
    tau = jnp.asarray(1.0 + 0.3 * rng.random((1, seq_q)), jnp.float32)
    return operands, tau, normal(1.0, 1, seq_q, heads, HEAD_DIM)


@needs_gpu_or_interpreter
@pytest.mark.parametrize("seq_q, heads, kv_heads, extent, window, q_offset", [
    (150, 8, 1, 70, None, 0),  # full layer, group 8: 10 CTAs of 16 tokens, 3 key blocks, tiles beyond E
    (131, 8, 2, 40, 40, 37),  # sliding layer after a cache, group 4: 32 tokens per CTA, padded to 2 x 128
    (200, 8, 2, 96, 70, 0),  # window inside the extent, from the sequence's start (block -1 steps)
    (150, 8, 1, 64, 64, 5),  # sliding layer at group 8: 8 tokens per warpgroup
])
def test_forward_matches_reference_and_triton_lse(seq_q, heads, kv_heads, extent, window, q_offset):
    seq_k = q_offset + seq_q
    (q, k, v, r, p), tau, _ = _inputs(seq_q, seq_k, heads, kv_heads, extent, seed=seq_q)
    groups = heads // kv_heads
    blocks = (tuning.mosaic_forward(groups),) + tuning.blocks(groups, HEAD_DIM, window)[1:]
    geos, args = kernel.prepare(q, k, v, r, p, q_offset=q_offset, window=window, tau=tau, segment_ids=None,
                                scale=None, interpret=None, blocks=blocks)
    if not mgpu_forward.supports(geos[0], q.dtype):
        pytest.skip(f"no shared-memory fit for {geos[0].blocks} (see tuning.py)")
    out, lse = jax.jit(lambda *a: mgpu_forward.forward(geos[0], *a))(*args)
    triton_geo = dataclasses.replace(geos[0], blocks=tuning.blocks(groups, HEAD_DIM, window)[0])
    want_lse = jax.jit(lambda *a: forward.forward(triton_geo, *a))(*args)[1]
    q_pos = jnp.arange(seq_q)[None] + q_offset
    k_pos = jnp.arange(seq_k)[None]
    with jax.default_matmul_precision("highest"):
        want = rel_attention(*[x.astype(jnp.float32) for x in (q, k, v, r, p)], q_pos, k_pos, window=window,
                             tau=tau)
    assert out.dtype == q.dtype and out.shape == args[0].shape and lse.shape == args[0].shape[:3]
    np.testing.assert_allclose(np.asarray(out[:, :seq_q], np.float32), want, atol=3e-2, rtol=0)
    # the Triton forward rounds its bias band to bf16 before the shear: lse agrees to bf16 precision of ~|lse|
    np.testing.assert_allclose(lse[:, :seq_q], want_lse[:, :seq_q], atol=0.05, rtol=1e-2)


@needs_gpu_or_interpreter
@pytest.mark.parametrize("kv_heads, window", [(1, None), (2, 60)])  # full layer; sliding (mgpu_window.py)
def test_grad_through_mosaic_forward_and_triton_backward(kv_heads, window):
    seq_q, heads, extent = 140, 8, 60
    (q, k, v, r, p), tau, cotangent = _inputs(seq_q, seq_q, heads, kv_heads, extent, seed=5)
    pos = jnp.arange(seq_q)[None]

    def value_and_grads(fn, *xs):
        out, vjp = jax.vjp(fn, *xs)
        return out, vjp(cotangent.astype(out.dtype))

    ours = jax.jit(lambda *xs: value_and_grads(
        lambda *ys: kernel.rel_flash_attention(*ys, window=window, tau=tau, forward_impl="mosaic"), *xs))
    out, grads = ours(q, k, v, r, p)
    with jax.default_matmul_precision("highest"):
        want_out, want_grads = jax.jit(lambda *xs: value_and_grads(
            lambda *ys: rel_attention(*ys, pos, pos, window=window, tau=tau), *xs))(
                *[x.astype(jnp.float32) for x in (q, k, v, r, p)])
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=3e-2, rtol=0)
    # The Triton backward recomputes the logits with its bias band rounded to bf16, while this forward's lse is
    # closer to the exact one (here max error 0.021 vs the Triton forward's 0.044, base-2 units): the mixed pair
    # is off by up to ~3.5% of the largest dr here (the all-Triton pair: 1.3%).
    for name, got, want in zip(["q", "k", "v", "r", "P"], grads, want_grads):
        scale = float(jnp.abs(want).max())
        err = float(jnp.abs(got.astype(jnp.float32) - want).max())
        assert err <= 5e-2 * scale, f"d{name}: max error {err} vs max |grad| {scale}"


def test_auto_choice_and_explicit_refusal():
    (q, k, v, r, p), _, _ = _inputs(40, 40, 8, 1, 16, seed=1)
    seg = jnp.zeros((1, 40), jnp.int32)
    with pytest.raises(ValueError):  # packed segments stay on the Triton forward
        kernel.rel_flash_attention(q, k, v, r, p, segment_ids=seg, forward_impl="mosaic")
    with pytest.raises(ValueError):
        kernel.rel_flash_attention(q, k, v, r, p, forward_impl="cudnn")


@pytest.mark.parametrize("groups, q_offset", [(8, 0), (4, 13)])
@jax.default_matmul_precision("highest")  # fp32 products: a GPU would otherwise run them in TF32
def test_toeplitz_operands_give_the_dense_bias(groups, q_offset):
    """A @ Tz of every (query tile, key block) the kernel can meet is the tile of the dense base-2 bias."""
    kv_heads, seq_q, extent, block_k = 2, 48, 40, 64
    heads, n_tok = kv_heads * groups, toeplitz.tokens_per_tile(groups)
    rng = np.random.default_rng(groups)
    r = jnp.asarray(rng.standard_normal((1, seq_q, heads, D_REL)), jnp.float32)
    p = jnp.asarray(rng.standard_normal((D_REL, extent)), jnp.float32)
    tau = jnp.asarray(1.0 + rng.random((1, seq_q)), jnp.float32)
    seq_k = -(-(q_offset + seq_q) // block_k) * block_k
    dense = relative_bias(r, p, q_offset + jnp.arange(seq_q)[None], jnp.arange(seq_k)[None])[0]  # [H, T, S]
    dense = dense * tau[0][None, :, None] * LOG2E
    a = toeplitz.block_diagonal_r(r, tau * LOG2E, n_tok, kv_heads)[0]  # [Hkv, T / n_tok, 64, n_tok * d_rel]
    table = toeplitz.offset_table(p, q_offset=q_offset, n_tok=n_tok, block_k=block_k, dtype=jnp.float32)
    first = toeplitz.first_offset(q_offset, n_tok)
    for tile in range(seq_q // n_tok):
        p0 = q_offset + tile * n_tok
        for kb in range(seq_k // block_k):
            delta = p0 - kb * block_k
            if delta + n_tok - 1 < 0 or delta - block_k + 1 >= extent:
                continue  # a tile the kernel never meets with bias (all keys in the future, or all beyond E)
            tz = table[(delta - first) // n_tok]
            for g in range(kv_heads):
                got = (a[g, tile] @ tz).reshape(groups, n_tok, block_k)  # rows head-major
                want = dense[g * groups:(g + 1) * groups, tile * n_tok:(tile + 1) * n_tok,
                             kb * block_k:(kb + 1) * block_k]
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
