"""The gathered form (decode-sized steps): programs per token, each with its own slot's factors, as Punica's
BGMV does. Two calls: the shrink h = x @ A[slot] ([tokens, padded rank], fp32), its input columns split over
programs of `k_tiles` tiles each (a decode step has few tokens: one program per token would leave most SMs idle
while each streams its whole A) whose partial sums are added after; then the expand y += scale[slot] * h @ B[slot]
over tiles of output columns. A token of slot 0 (the base) does no work and its row of y is left as it is. A
token's products are vector-matrix: a broadcast multiply and sum, since a Triton matmul takes 16 rows or more."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.lora import tiles
from pallas_kernels.lora.tuning import GatheredBlocks


def _shrink_kernel(slots_ref, x_ref, a_ref, h_ref, *, blocks: GatheredBlocks):
    token, first = pl.program_id(0), pl.program_id(1) * blocks.k_tiles
    slot = slots_ref[token]
    fan_in, rank = x_ref.shape[1], h_ref.shape[0]

    def step(k, h):  # tiles past the input's end read as zeros
        k0 = (first + k) * blocks.k
        x = tiles.read(x_ref, token, pl.ds(k0, blocks.k), mask=tiles.lanes_below(k0, blocks.k, fan_in))
        return h + jnp.sum(x[:, None] * tiles.adapter_tile(a_ref, slot, k0, blocks.k, 0, rank), axis=0)

    # A traced lower bound and a static upper one (slot 0: no steps), the lower one an int32 product: Triton's
    # loop wants its bounds of one type, and its lowering of `jnp.where` here gives an i1.
    steps = blocks.k_tiles
    h_ref[...] = lax.fori_loop((slot == 0).astype(jnp.int32) * steps, steps, step, jnp.zeros((rank,), jnp.float32))


def _expand_kernel(slots_ref, scale_ref, h_ref, b_ref, y_in_ref, y_ref, *, blocks: GatheredBlocks):
    del y_in_ref  # y_ref's buffer (aliased)
    token, col0 = pl.program_id(0), pl.program_id(1) * blocks.out
    slot = slots_ref[token]

    @pl.when(slot != 0)
    def _add():
        b = tiles.adapter_tile(b_ref, slot, 0, h_ref.shape[0], col0, blocks.out)
        delta = jnp.sum(h_ref[...][:, None] * b, axis=0) * scale_ref[slot].astype(jnp.float32)
        cols = tiles.lanes_below(col0, blocks.out, y_ref.shape[1])
        tiles.add_to(y_ref, (token, pl.ds(col0, blocks.out)), delta, cols)


def gathered_add(y, x, a, b, scale, slots, *, blocks: GatheredBlocks, interpret: bool):
    """y [N, out] + scale[s] * (x [N, in] @ A[s]) @ B[s], s = slots[token], as `kernel.lora_add` checks them."""
    tokens, rank = x.shape[0], tiles.padded_rank(a.shape[2])
    whole = pl.BlockSpec()
    params = plt.CompilerParams(num_warps=blocks.num_warps)
    splits = pl.cdiv(pl.cdiv(x.shape[1], blocks.k), blocks.k_tiles)
    partial_h = pl.pallas_call(
        functools.partial(_shrink_kernel, blocks=blocks), grid=(tokens, splits), in_specs=[whole] * 3,
        out_specs=pl.BlockSpec((None, None, rank), lambda t, s: (s, t, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, tokens, rank), jnp.float32), compiler_params=params,
        interpret=interpret, name="lora_gathered_shrink")(slots, x, a)
    h = partial_h.sum(axis=0)
    return pl.pallas_call(
        functools.partial(_expand_kernel, blocks=blocks), grid=(tokens, pl.cdiv(y.shape[1], blocks.out)),
        in_specs=[whole, whole, pl.BlockSpec((None, rank), lambda t, j: (t, 0)), whole, whole], out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), input_output_aliases={4: 0}, compiler_params=params,
        interpret=interpret, name="lora_gathered_expand")(slots, scale, h, b, y)
