"""The segmented form (prefill chunks): runs of consecutive tokens share a slot (a row's chunk, rows of one
adapter side by side, or tokens sorted by slot), as Punica's SGMV takes them. A program holds a tile of tokens
and does one masked matmul per run of a slot in its tile, so runs much longer than a tile cost one matmul per
tile. Two calls: the shrink h = x @ A[slot] ([tokens, padded rank], fp32), then the expand
y += scale[slot] * h @ B[slot] over tiles of tokens and output columns. Runs of slot 0 (the base) do no work and
leave their rows of y as they are. Correct for any order of slots; fast when the runs are long."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.lora import tiles
from pallas_kernels.lora.tuning import SegmentedBlocks


def _fold_runs(slots_ref, ends_ref, first, rows: int, body, init):
    """body(slot, in_run [rows] bool, carry) -> carry, folded over the runs of slots among the tokens
    first, ..., first + rows - 1 (those that exist); in_run marks the run's tokens."""
    tokens = slots_ref.shape[0]
    last = jnp.minimum(first + rows, tokens)
    token = first + lax.broadcasted_iota(jnp.int32, (rows,), 0)

    def run(state):
        start, carry = state
        end = jnp.minimum(ends_ref[start], last)
        return end, body(slots_ref[start], (token >= start) & (token < end), carry)

    return lax.while_loop(lambda state: state[0] < last, run, (first, init))[1]


def _shrink_kernel(slots_ref, ends_ref, x_ref, a_ref, h_ref, *, blocks: SegmentedBlocks):
    first = pl.program_id(0) * blocks.rows
    fan_in, rank = x_ref.shape[1], h_ref.shape[1]

    def run(slot, in_run, h):
        def step(k, h):
            k0 = k * blocks.k
            mask = in_run[:, None] & tiles.lanes_below(k0, blocks.k, fan_in)[None, :]
            x = tiles.read(x_ref, pl.ds(first, blocks.rows), pl.ds(k0, blocks.k), mask=mask)
            return h + tiles.matmul(x, tiles.adapter_tile(a_ref, slot, k0, blocks.k, 0, rank))

        steps = pl.cdiv(fan_in, blocks.k)  # bounds as in gathered.py: slot 0 starts at the end
        return lax.fori_loop((slot == 0).astype(jnp.int32) * steps, steps, step, h)

    h_ref[...] = _fold_runs(slots_ref, ends_ref, first, blocks.rows, run,
                            jnp.zeros((blocks.rows, rank), jnp.float32))


def _expand_kernel(slots_ref, ends_ref, scale_ref, h_ref, b_ref, y_in_ref, y_ref, *, blocks: SegmentedBlocks):
    del y_in_ref  # y_ref's buffer (aliased)
    first, col0 = pl.program_id(0) * blocks.rows, pl.program_id(1) * blocks.out
    cols = tiles.lanes_below(col0, blocks.out, y_ref.shape[1])
    h = h_ref[...]

    def run(slot, in_run, carry):
        @pl.when(slot != 0)
        def _add():
            delta = tiles.matmul(h, tiles.adapter_tile(b_ref, slot, 0, h.shape[1], col0, blocks.out))
            tiles.add_to(y_ref, (pl.ds(first, blocks.rows), pl.ds(col0, blocks.out)),
                         delta * scale_ref[slot].astype(jnp.float32), in_run[:, None] & cols[None, :])
        return carry

    _fold_runs(slots_ref, ends_ref, first, blocks.rows, run, jnp.int32(0))


def segmented_add(y, x, a, b, scale, slots, *, blocks: SegmentedBlocks, interpret: bool):
    """y [N, out] + scale[s] * (x [N, in] @ A[s]) @ B[s], s = slots[token], as `kernel.lora_add` checks them."""
    tokens, rank = x.shape[0], tiles.padded_rank(a.shape[2])
    row_tiles = pl.cdiv(tokens, blocks.rows)
    ends = tiles.run_ends(slots)
    whole = pl.BlockSpec()
    params = plt.CompilerParams(num_warps=blocks.num_warps)
    h = pl.pallas_call(
        functools.partial(_shrink_kernel, blocks=blocks), grid=(row_tiles,), in_specs=[whole] * 4,
        out_specs=pl.BlockSpec((blocks.rows, rank), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((row_tiles * blocks.rows, rank), jnp.float32), compiler_params=params,
        interpret=interpret, name="lora_segmented_shrink")(slots, ends, x, a)
    return pl.pallas_call(
        functools.partial(_expand_kernel, blocks=blocks), grid=(row_tiles, pl.cdiv(y.shape[1], blocks.out)),
        in_specs=[whole] * 3 + [pl.BlockSpec((blocks.rows, rank), lambda i, j: (i, 0)), whole, whole],
        out_specs=whole, out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype), input_output_aliases={5: 0},
        compiler_params=params, interpret=interpret, name="lora_segmented_expand")(slots, ends, scale, h, b, y)
