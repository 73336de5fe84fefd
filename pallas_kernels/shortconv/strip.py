"""ShortConv prefill as a walk down the time axis (Triton backend); semantics of `reference.shortconv_prefill`.

The tiled kernel (kernel.py) loads every input four times, once per tap, because a tile held in registers cannot
be shifted by a row. Here each program owns a strip of channels and a run of `rows` time steps and carries the
last W-1 input rows from one step to the next, so each input is loaded once, plus a W-1 row halo per run. Each
loop step issues `unroll` row loads before using any, so that enough bytes are in flight.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.shortconv import tuning
from pallas_kernels.shortconv.kernel import (and_masks, prefill_call, tap_weights, weighted_window,
                                             write_final_state)


def _strip_kernel(x_ref, w_ref, state_ref, seg_ref, len_ref, y_ref, new_state_ref, *, blocks):
    _, seq, channels = x_ref.shape
    hist = w_ref.shape[1] - 1
    bc, unroll = blocks.channels, blocks.unroll
    c_blk, run, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c0, start = c_blk * bc, run * blocks.rows
    span = pl.ds(c0, bc)
    lanes = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0)
    col_mask = lanes < channels if channels % bc else None
    weights = tap_weights(w_ref, jnp.minimum(lanes, channels - 1) if channels % bc else lanes)

    def clamp(t):  # rows are clamped into range and their values masked (see kernel.py)
        return jnp.minimum(jnp.maximum(t, 0), seq - 1)

    def load(t):
        return plt.load(x_ref.at[b, clamp(t), span], mask=col_mask).astype(jnp.float32)

    def segment(t):  # rows before the chunk (the state) carry the first segment's id, as clamping gives
        return seg_ref[b, clamp(t)] if seg_ref is not None else None

    def halo_row(j):  # input row start - hist + j: from the state (or zero) before the chunk
        t = start - hist + j
        if state_ref is None:
            return jnp.where(t >= 0, load(t), 0.0)
        old = plt.load(state_ref.at[b, jnp.minimum(jnp.maximum(t + hist, 0), hist - 1), span], mask=col_mask)
        return jnp.where(t >= 0, load(t), old.astype(jnp.float32))

    def step(i, carry):
        window, seg_window = carry  # the hist input rows (and their segment ids) before row t0
        t0 = start + i * unroll
        rows = [load(t0 + j) for j in range(unroll)]
        segs = [segment(t0 + j) for j in range(unroll)]
        for j, x in enumerate(rows):
            t = t0 + j
            taps = window
            if seg_ref is not None:
                taps = [jnp.where(s == segs[j], tap, 0.0) for s, tap in zip(seg_window, window)]
            y = weighted_window(taps + [x], weights) + x
            mask = and_masks(t < seq if seq % blocks.rows else None, col_mask)
            plt.store(y_ref.at[b, clamp(t), span], y.astype(y_ref.dtype), mask=mask)
            window, seg_window = window[1:] + [x], seg_window[1:] + [segs[j]]
        return window, seg_window

    halo = [halo_row(j) for j in range(hist)]
    lax.fori_loop(0, blocks.rows // unroll, step, (halo, [segment(start - hist + j) for j in range(hist)]))
    pl.when(run == 0)(lambda: write_final_state(x_ref, state_ref, len_ref, new_state_ref, b, c0, bc))


@functools.partial(jax.jit, static_argnames=("interpret", "blocks"))
def shortconv_prefill_strip(x, w, state=None, segment_ids=None, lengths=None, *, interpret=None, blocks=None):
    """Same arguments and results as `shortconv_prefill`; blocks: optional `tuning.StripBlocks`."""
    batch, seq, channels = x.shape
    blocks = blocks or tuning.strip_blocks(channels)
    if blocks.rows % blocks.unroll or blocks.rows < w.shape[-1] - 1:
        raise ValueError(f"rows must be a multiple of unroll and cover the conv's history: {blocks}")
    grid = (pl.cdiv(channels, blocks.channels), pl.cdiv(seq, blocks.rows), batch)
    return prefill_call(functools.partial(_strip_kernel, blocks=blocks), x, w, state, segment_ids, lengths,
                        grid=grid, num_warps=blocks.num_warps, interpret=interpret, name="shortconv_prefill_strip")
