"""ShortConv prefill as a walk down the time axis (Triton backend); semantics of `reference.shortconv_prefill`.

A kernel of [time x channels] tiles would load every input four times, once per tap, because a tile held in
registers cannot be shifted by a row. Here each program owns a strip of channels and a run of `rows` time steps
and carries the last W-1 input rows from one step to the next, so each input is loaded once, plus a W-1 row halo
per run. Each loop step issues `unroll` row loads before using any, so that enough bytes are in flight.

Bandwidth is set by the bytes in flight per SM: resident programs x `unroll` rows x the strip's bytes per row.
Long runs leave few programs (256-row runs at 8192 x 6144 give 384, 3 per SM), hence tuning.py's short runs.
The kernel's figures against a copy of the same bytes: docs/performance.md.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.shortconv import tuning
from pallas_kernels.shortconv.kernel import and_masks, prefill_call, weighted_window, write_final_state


def strip_weights(w_ref, cols):
    """The taps w[cols, k] for every k, in fp32, from one load of the [len(cols), W] rows (16 B per channel)
    rather than W strided gathers; W must be a power of two (a Triton tile dimension)."""
    taps = lax.broadcasted_iota(jnp.int32, (1, w_ref.shape[1]), 1)
    rows = w_ref[cols[:, None], taps].astype(jnp.float32)
    return [jnp.sum(jnp.where(taps == k, rows, 0.0), axis=1) for k in range(w_ref.shape[1])]


def _strip_kernel(x_ref, w_ref, state_ref, seg_ref, len_ref, y_ref, new_state_ref, *, blocks):
    _, seq, channels = x_ref.shape
    hist = w_ref.shape[1] - 1
    bc, unroll = blocks.channels, blocks.unroll
    c_blk, run, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c0, start = c_blk * bc, run * blocks.rows
    span = pl.ds(c0, bc)
    lanes = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0)
    col_mask = lanes < channels if channels % bc else None
    ragged = seq % blocks.rows != 0  # the last run reaches past the sequence
    # The carried window: x's dtype, or the state's where that is wider (it must not be rounded to x's).
    window_dtype = x_ref.dtype if state_ref is None else jnp.promote_types(x_ref.dtype, state_ref.dtype)

    def clamp(t):  # rows are clamped into range and their values masked (see kernel.py)
        return jnp.minimum(jnp.maximum(t, 0), seq - 1)

    def run_row(t):  # a row of this run: unclamped where runs tile the sequence, so that the rows of a step
        return clamp(t) if ragged else t  # share one base address (fewer registers and address instructions)

    def load(t):  # kept in x's dtype until used: bf16 rows in flight take half the registers of fp32 ones
        return plt.load(x_ref.at[b, t, span], mask=col_mask)

    def segment(t):  # rows before the chunk (the state) carry the first segment's id, as clamping gives
        return seg_ref[b, clamp(t)] if seg_ref is not None else None

    def halo_row(j):  # input row start - hist + j: from the state (or zero) before the chunk
        t = start - hist + j
        row = load(clamp(t)).astype(window_dtype)
        if state_ref is None:
            return jnp.where(t >= 0, row, jnp.zeros((), window_dtype))
        before = and_masks(jnp.full((bc,), t < 0), col_mask)  # masked off: no memory traffic past the first run
        old = plt.load(state_ref.at[b, jnp.minimum(jnp.maximum(t + hist, 0), hist - 1), span], mask=before)
        return jnp.where(t >= 0, row, old.astype(window_dtype))

    def step_rows(i):  # the input rows of loop step i
        return [load(run_row(start + i * unroll + j)) for j in range(unroll)]

    def step(i, carry, rows):
        window, seg_window = carry  # the hist input rows (and their segment ids) before row t0
        t0 = start + i * unroll
        segs = [segment(t0 + j) for j in range(unroll)]
        for j, x in enumerate(rows):
            t = t0 + j
            taps = window
            if seg_ref is not None:
                taps = [jnp.where(s == segs[j], tap, jnp.zeros((), window_dtype)) for s, tap in zip(seg_window, window)]
            y = weighted_window(taps + [x], weights) + x.astype(jnp.float32)
            mask = and_masks(t < seq if ragged else None, col_mask)
            plt.store(y_ref.at[b, run_row(t), span], y.astype(y_ref.dtype), mask=mask)
            window, seg_window = window[1:] + [x.astype(window_dtype)], seg_window[1:] + [segs[j]]
        return window, seg_window

    # The first step's rows and the halo are loaded before the weights, whose load waits on memory before their
    # layout change (through shared memory, behind a barrier): the program's first loads all go out at once.
    first = step_rows(0)
    halo = [halo_row(j) for j in range(hist)]
    weights = strip_weights(w_ref, jnp.minimum(lanes, channels - 1) if channels % bc else lanes)
    carry = step(0, (halo, [segment(start - hist + j) for j in range(hist)]), first)
    lax.fori_loop(1, blocks.rows // unroll, lambda i, carry: step(i, carry, step_rows(i)), carry)
    pl.when(run == 0)(lambda: write_final_state(x_ref, state_ref, len_ref, new_state_ref, b, c0, bc))


@functools.partial(jax.jit, static_argnames=("interpret", "blocks"))
def shortconv_prefill(x, w, state=None, segment_ids=None, lengths=None, *, interpret=None, blocks=None):
    """Kernel form of `reference.shortconv_prefill` (same arguments and results); blocks: optional
    `tuning.StripBlocks`, default from `tuning.strip_blocks`."""
    batch, seq, channels = x.shape
    blocks = blocks or tuning.strip_blocks(channels)
    if blocks.rows % blocks.unroll or blocks.rows < w.shape[-1] - 1:
        raise ValueError(f"rows must be a multiple of unroll and cover the conv's history: {blocks}")
    grid = (pl.cdiv(channels, blocks.channels), pl.cdiv(seq, blocks.rows), batch)
    return prefill_call(functools.partial(_strip_kernel, blocks=blocks), x, w, state, segment_ids, lengths,
                        grid=grid, num_warps=blocks.num_warps, interpret=interpret, name="shortconv_prefill")
