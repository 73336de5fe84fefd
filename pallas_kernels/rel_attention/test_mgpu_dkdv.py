"""The Mosaic GPU (wgmma) dK/dV backward vs the Triton dK/dV kernel and the reference's gradient.

On a GPU these run the compiled kernel. On CPU they need Pallas' Mosaic GPU interpreter, which simulates every
warpgroup, barrier and TMA of every CTA and takes minutes: there they run only with REL_ATTENTION_MOSAIC_INTERPRET=1.
Shapes: 3+ key blocks of 128 (CTAs), lengths that are not multiples of the tiles, query tiles that cross the
diagonal, carry bias and lie beyond E, both layer kinds, a chunk after a cache (q_offset > 0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rel_attention import (
    backward,
    forward,
    kernel,
    mgpu_dkdv,
    rel_attention,
    tuning,
)
from pallas_kernels.rel_attention.test_mgpu_forward import (
    HEAD_DIM,
    _inputs,
    needs_gpu_or_interpreter,
)


@needs_gpu_or_interpreter
@pytest.mark.parametrize("seq_q, heads, kv_heads, extent, window, q_offset", [
    (300, 8, 1, 90, None, 0),  # full layer, group 8: 3 key blocks, 38 query tiles of 8 tokens, tiles beyond E
    (190, 8, 2, 50, 50, 110),  # sliding layer after a cache, group 4: 3 key blocks, tiles of 16 tokens
])
def test_dkdv_matches_triton_and_reference_grad(seq_q, heads, kv_heads, extent, window, q_offset):
    seq_k = q_offset + seq_q
    (q, k, v, r, p), tau, cotangent = _inputs(seq_q, seq_k, heads, kv_heads, extent, seed=seq_q)
    groups = heads // kv_heads
    tuned = tuning.blocks(groups, HEAD_DIM, window)
    geos, args = kernel.prepare(q, k, v, r, p, q_offset=q_offset, window=window, tau=tau, segment_ids=None,
                                scale=None, interpret=None, blocks=(mgpu_dkdv.tile(groups),) + tuned)
    assert mgpu_dkdv.supports(geos[0], q.dtype)
    assert geos[0].seq_k // mgpu_dkdv.KEYS >= 3
    out, lse = jax.jit(lambda *a: forward.forward(geos[1], *a))(*args)
    dout = jnp.pad(cotangent, ((0, 0), (0, out.shape[1] - seq_q), (0, 0), (0, 0)))
    residuals = backward.residual_args(*args, out, lse, dout)
    dk, dv = jax.jit(lambda *a: mgpu_dkdv.dkdv(geos[0], *a))(*residuals)
    want_dk, want_dv = jax.jit(lambda *a: backward.dkdv(geos[2], *a))(*residuals)
    assert dk.dtype == k.dtype and dk.shape == dv.shape == args[1].shape

    q_pos, k_pos = jnp.arange(seq_q)[None] + q_offset, jnp.arange(seq_k)[None]
    with jax.default_matmul_precision("highest"):
        _, vjp = jax.vjp(lambda k_, v_: rel_attention(q.astype(jnp.float32), k_, v_, r.astype(jnp.float32),
                                                      p.astype(jnp.float32), q_pos, k_pos, window=window, tau=tau),
                         k.astype(jnp.float32), v.astype(jnp.float32))
        ref_dk, ref_dv = vjp(cotangent.astype(jnp.float32))
    for name, got, triton, ref in [("dk", dk, want_dk, ref_dk), ("dv", dv, want_dv, ref_dv)]:
        got, triton = (np.asarray(x[:, :seq_k], np.float32) for x in (got, triton))
        scale = float(jnp.abs(ref).max())
        err_ref, err_triton = float(np.abs(got - ref).max()), float(np.abs(got - triton).max())
        print(f"{name}: max |grad| {scale:.3g}, max error vs reference {err_ref:.3g}, vs Triton {err_triton:.3g}")
        assert err_ref <= 3e-2 * scale, f"{name}: max error {err_ref} vs the reference's max |grad| {scale}"
        assert err_triton <= 3e-2 * scale, f"{name}: max error {err_triton} vs Triton, max |grad| {scale}"


def test_supports():
    full = kernel.prepare(*_inputs(40, 40, 8, 1, 16, seed=1)[0], q_offset=0, window=None, tau=None,
                          segment_ids=None, scale=None, interpret=True, blocks=(mgpu_dkdv.tile(8),))[0][0]
    assert mgpu_dkdv.supports(full, jnp.bfloat16)
    assert not mgpu_dkdv.supports(full, jnp.float32)
    segmented = kernel.prepare(*_inputs(40, 40, 8, 1, 16, seed=1)[0], q_offset=0, window=None, tau=None,
                               segment_ids=jnp.zeros((1, 40), jnp.int32), scale=None, interpret=True,
                               blocks=(mgpu_dkdv.tile(8),))[0][0]
    assert not mgpu_dkdv.supports(segmented, jnp.bfloat16)
