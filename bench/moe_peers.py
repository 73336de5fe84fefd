"""The peer MoE FFNs bench/moe.py measures ours against: jax's Mosaic-GPU grouped matmuls made differentiable,
and the peers' unfused layout around any grouped matmul (`jax.lax.ragged_dot` or that one)."""

import jax
import jax.numpy as jnp


def mgpu_peer():
    """jax's `ragged_dot_mgpu` with `transposed_ragged_dot_mgpu` for the weight gradient, in a custom_vjp:
    mm(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd
    tiles = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)

    @jax.custom_vjp
    def mm(x, w, gs):
        return rd.ragged_dot(x, w, group_sizes=gs, grid_block_n=8, **tiles)

    def mm_bwd(res, dy):
        x, w, gs = res
        dx = rd.ragged_dot(dy, w, group_sizes=gs, grid_block_n=8, transpose_rhs=True, **tiles)
        return dx, trd.transposed_ragged_dot(x, dy, group_sizes=gs, grid_block_n=4, **tiles), None

    mm.defvjp(lambda x, w, gs: (mm(x, w, gs), (x, w, gs)), mm_bwd)
    return mm


def unfused_ffn(mm, x, wg, wu, wd, gs, rw):
    """The peers' layout: one matmul to [gate | up], SwiGLU and row weight in XLA, then down."""
    width = wd.shape[1]
    z = mm(x, jnp.concatenate([wg, wu], -1), gs).astype(jnp.float32)
    h = jax.nn.silu(z[:, :width]) * z[:, width:] * rw[:, None]
    return mm(h.astype(x.dtype), wd, gs)
