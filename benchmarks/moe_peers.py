"""The grouped FFNs that `benchmarks.moe` compares ours with: jax's Mosaic-GPU ragged dot (the peer) and
`jax.lax.ragged_dot`, each in the peers' layout (one product to [gate | up], SwiGLU in XLA)."""

import jax
import jax.numpy as jnp

from pallas_kernels.moe import jax_mgpu


def mgpu_peer():
    """jax's `ragged_dot_mgpu` with `transposed_ragged_dot_mgpu` for the weight gradient, as they are (tiles:
    `jax_mgpu.RAGGED_DOT_TILES`, `TRANSPOSED_TILES`), in a custom_vjp: mm(x [M, K], w [G, K, N], group_sizes [G])
    -> [M, N]."""
    jax_mgpu.kernels(interpret=False)  # a jax without them fails here, once

    @jax.custom_vjp
    def mm(x, w, gs):
        return jax_mgpu.ragged_dot(x, w, gs)

    def mm_bwd(res, dy):
        x, w, gs = res
        return jax_mgpu.ragged_dot(dy, w, gs, transpose_rhs=True), jax_mgpu.transposed_ragged_dot(x, dy, gs), None

    mm.defvjp(lambda x, w, gs: (mm(x, w, gs), (x, w, gs)), mm_bwd)
    return mm


def ffn_rows(ffn, x, wg, wu, wd, rw, gs):
    """ffn(x, wg, wu, wd, gs, rw) called in the benchmark's argument order (the differentiable ones first)."""
    return ffn(x, wg, wu, wd, gs, rw)


def unfused_ffn(mm, x, wg, wu, wd, gs, rw):
    """The peers' layout around any grouped matmul `mm`: one matmul to [gate | up], SwiGLU and the row weight
    in XLA, then down."""
    width = wd.shape[1]
    z = mm(x, jnp.concatenate([wg, wu], -1), gs).astype(jnp.float32)
    h = jax.nn.silu(z[:, :width]) * z[:, width:] * rw[:, None]
    return mm(h.astype(x.dtype), wd, gs)
