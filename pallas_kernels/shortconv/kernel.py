"""ShortConv as Pallas kernels (Triton backend): the prefill over [B, T, C] and the decode step over a state pool.

Semantics are those of `reference.py`. No BlockSpecs: every ref is the whole array and the kernels address
rows themselves, because a time tile also reads the 3 rows before it (its halo; from `state` on the first
tile). Row and column indices are clamped into range and the values masked, never started out of range: that
keeps one code path valid both compiled and in interpret mode (which shifts an out-of-range start instead of
masking it). Tiles are powers of two, as Triton requires.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import interpret_default
from pallas_kernels.shortconv import tuning


def weighted_window(taps, w_ref, w_cols):
    """sum_k taps[k] * w[w_cols, k] in fp32, oldest tap first (the reference's summation order).

    Static indices are passed as jnp.int32: interpret mode's discharge rules want them shaped.
    """
    acc = None
    for k, tap in enumerate(taps):
        term = tap.astype(jnp.float32) * w_ref[w_cols, jnp.int32(k)].astype(jnp.float32)
        acc = term if acc is None else acc + term
    return acc


def conv_step(x, pool_ref, slot, cols, w_ref, w_cols, mask=None):
    """One decode step at one pool slot: returns x + conv (fp32) and writes the shifted window back.

    `cols` indexes the pool's channel axis (a slice or an index array), `w_cols` the matching rows of w.
    Each element is loaded and stored by the same thread, so reading row j before overwriting it is safe.
    """
    hist = w_ref.shape[1] - 1
    window = [plt.load(pool_ref.at[slot, jnp.int32(j), cols], mask=mask) for j in range(hist)] + [x]
    y = weighted_window(window, w_ref, w_cols) + x.astype(jnp.float32)
    for j in range(hist):
        plt.store(pool_ref.at[slot, jnp.int32(j), cols], window[j + 1].astype(pool_ref.dtype), mask=mask)
    return y


def _and(a, b):
    return b if a is None else a if b is None else a & b


def _prefill_kernel(*refs, seq, channels, width, blocks, has_state, has_segments, has_lengths):
    refs = iter(refs)
    x_ref, w_ref = next(refs), next(refs)
    state_ref = next(refs) if has_state else None
    seg_ref = next(refs) if has_segments else None
    len_ref = next(refs) if has_lengths else None
    y_ref, new_state_ref = next(refs), next(refs)
    hist = width - 1
    bt, bc = blocks.time, blocks.channels
    c_blk, t_blk, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0, c0 = t_blk * bt, c_blk * bc

    rows = t0 + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    lanes = c0 + lax.broadcasted_iota(jnp.int32, (1, bc), 1)
    col_mask = lanes < channels if channels % bc else None
    cols = jnp.minimum(lanes, channels - 1) if channels % bc else lanes

    def clamp_row(r):
        return jnp.minimum(jnp.maximum(r, 0), seq - 1)

    seg_here = seg_ref[b, clamp_row(rows)] if has_segments else None
    taps = []
    for k in range(width):
        src = rows - (hist - k)  # tap k reads x[t - hist + k]
        if k == hist:
            tap = x_ref[b, clamp_row(src), cols].astype(jnp.float32)
        else:
            inside = src >= 0
            tap = plt.load(x_ref.at[b, clamp_row(src), cols], mask=inside, other=0).astype(jnp.float32)
            if has_state:  # rows before the chunk come from the state (only the first tile has any)
                state_row = jnp.minimum(jnp.maximum(src + hist, 0), hist - 1)
                from_state = plt.load(state_ref.at[b, state_row, cols], mask=~inside, other=0)
                tap = jnp.where(inside, tap, from_state.astype(jnp.float32))
        if has_segments and k < hist:  # the state carries the first segment's id: clamping to row 0 gives it
            tap = jnp.where(seg_ref[b, clamp_row(src)] == seg_here, tap, 0.0)
        taps.append(tap)
    y = weighted_window(taps, w_ref, cols) + taps[-1]
    store_mask = _and(rows < seq if seq % bt else None, col_mask)
    plt.store(y_ref.at[b, pl.ds(t0, bt), pl.ds(c0, bc)], y.astype(y_ref.dtype), mask=store_mask)

    @pl.when(t_blk == 0)
    def _write_final_state():
        length = len_ref[b] if has_lengths else seq
        span = pl.ds(c0, bc)
        lane_mask = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0) < channels if channels % bc else None
        for j in range(hist):
            src = length - hist + j  # the newest `hist` inputs before position `length`
            value = plt.load(x_ref.at[b, clamp_row(src), span], mask=lane_mask).astype(jnp.float32)
            if has_lengths or seq < hist:
                if has_state:
                    row = jnp.minimum(jnp.maximum(src + hist, 0), hist - 1)
                    old = plt.load(state_ref.at[b, row, span], mask=lane_mask).astype(jnp.float32)
                else:
                    old = jnp.zeros_like(value)
                value = jnp.where(src >= 0, value, old)
            plt.store(new_state_ref.at[b, jnp.int32(j), span], value.astype(new_state_ref.dtype), mask=lane_mask)


def _resolve(interpret):
    return interpret_default() if interpret is None else interpret


@functools.partial(jax.jit, static_argnames=("interpret", "blocks"))
def shortconv_prefill(x, w, state=None, segment_ids=None, lengths=None, *, interpret=None, blocks=None):
    """Kernel form of `reference.shortconv_prefill` (same arguments and results).

    blocks: optional `tuning.PrefillBlocks`; default from `tuning.prefill_blocks`.
    """
    batch, seq, channels = x.shape
    width = w.shape[-1]
    blocks = blocks or tuning.prefill_blocks(channels)
    inputs = [x, w]
    if state is not None:
        inputs.append(state)
    if segment_ids is not None:
        inputs.append(segment_ids.astype(jnp.int32))
    if lengths is not None:
        inputs.append(lengths.astype(jnp.int32))
    kernel = functools.partial(
        _prefill_kernel, seq=seq, channels=channels, width=width, blocks=blocks,
        has_state=state is not None, has_segments=segment_ids is not None, has_lengths=lengths is not None)
    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((batch, width - 1, channels), x.dtype))
    grid = (pl.cdiv(channels, blocks.channels), pl.cdiv(seq, blocks.time), batch)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, interpret=_resolve(interpret),
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps), name="shortconv_prefill",
    )(*inputs)


def _decode_kernel(x_ref, w_ref, slots_ref, pool_in_ref, y_ref, pool_ref, *, channels, blocks):
    del pool_in_ref  # the same buffer as pool_ref (aliased)
    bc = blocks.channels
    c0, n = pl.program_id(0) * bc, pl.program_id(1)
    lanes = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0)
    mask = lanes < channels if channels % bc else None
    w_cols = jnp.minimum(lanes, channels - 1) if channels % bc else lanes
    span = pl.ds(c0, bc)
    x = plt.load(x_ref.at[n, span], mask=mask)
    y = conv_step(x, pool_ref, slots_ref[n], span, w_ref, w_cols, mask)
    plt.store(y_ref.at[n, span], y.astype(y_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "blocks"))
def shortconv_decode(x, w, state_pool, slots, *, interpret=None, blocks=None):
    """Kernel form of `reference.shortconv_decode`: returns (y [N, C], state_pool updated in place).

    The pool is aliased to the output, so under `jax.jit(..., donate_argnums=...)` no copy is made. Slots
    must be distinct. blocks: optional `tuning.DecodeBlocks`.
    """
    tokens, channels = x.shape
    blocks = blocks or tuning.decode_blocks(channels)
    kernel = functools.partial(_decode_kernel, channels=channels, blocks=blocks)
    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(channels, blocks.channels), tokens),
        input_output_aliases={3: 1}, interpret=_resolve(interpret),
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps), name="shortconv_decode",
    )(x, w, slots.astype(jnp.int32), state_pool)
