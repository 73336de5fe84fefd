"""ShortConv's decode step over a state pool as a Pallas kernel (Triton backend), and the pieces the prefill
kernel (strip.py) shares with it: the taps' weighted sum, the final state, the prefill's pallas_call.

Semantics are those of `reference.py`. No BlockSpecs: every ref is the whole array and the kernels address
rows themselves, because a run of time steps also reads the 3 rows before it (its halo; from `state` on the
first run). Row and column indices are clamped into range and the values masked, never started out of range: that
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


def tap_weights(w_ref, w_cols):
    """The taps w[w_cols, k] for every k, in fp32.

    Static indices are passed as jnp.int32: interpret mode's discharge rules want them shaped.
    """
    return [w_ref[w_cols, jnp.int32(k)].astype(jnp.float32) for k in range(w_ref.shape[1])]


def weighted_window(taps, weights):
    """sum_k taps[k] * weights[k] in fp32, oldest tap first (the reference's summation order)."""
    acc = None
    for tap, weight in zip(taps, weights, strict=True):
        term = tap.astype(jnp.float32) * weight
        acc = term if acc is None else acc + term
    return acc


def conv_step(x, pool_ref, slot, cols, w_ref, w_cols, mask=None, keep=None):
    """One decode step at one pool slot: returns x + conv (fp32) and writes the shifted window back, unless the
    scalar `keep` is given and False.

    `cols` indexes the pool's channel axis (a slice or an index array), `w_cols` the matching rows of w.
    Each element is loaded and stored by the same thread, so reading row j before overwriting it is safe.
    """
    hist = w_ref.shape[1] - 1
    window = [plt.load(pool_ref.at[slot, jnp.int32(j), cols], mask=mask) for j in range(hist)] + [x]
    y = weighted_window(window, tap_weights(w_ref, w_cols)) + x.astype(jnp.float32)

    def write_back():
        for j in range(hist):
            plt.store(pool_ref.at[slot, jnp.int32(j), cols], window[j + 1].astype(pool_ref.dtype), mask=mask)
    write_back() if keep is None else pl.when(keep)(write_back)
    return y


def and_masks(a, b):
    return b if a is None else a if b is None else a & b


def write_final_state(x_ref, state_ref, len_ref, new_state_ref, b, c0, bc):
    """new_state[b, :, c0:c0+bc] = the newest W-1 inputs before position lengths[b] (T without lengths),
    reaching back into `state` (or zeros) where the chunk is shorter than that. state_ref, len_ref: or None."""
    seq, channels = x_ref.shape[1], x_ref.shape[2]
    hist = new_state_ref.shape[1]
    length = seq if len_ref is None else len_ref[b]
    span = pl.ds(c0, bc)
    lane_mask = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0) < channels if channels % bc else None
    for j in range(hist):
        src = length - hist + j
        value = plt.load(x_ref.at[b, jnp.minimum(jnp.maximum(src, 0), seq - 1), span], mask=lane_mask)
        value = value.astype(jnp.float32)
        if len_ref is not None or seq < hist:
            if state_ref is not None:
                row = jnp.minimum(jnp.maximum(src + hist, 0), hist - 1)
                old = plt.load(state_ref.at[b, row, span], mask=lane_mask).astype(jnp.float32)
            else:
                old = jnp.zeros_like(value)
            value = jnp.where(src >= 0, value, old)
        plt.store(new_state_ref.at[b, jnp.int32(j), span], value.astype(new_state_ref.dtype), mask=lane_mask)


def prefill_call(body, x, w, state, segment_ids, lengths, *, grid, num_warps, interpret, name):
    """The pallas_call of a prefill kernel body(x_ref, w_ref, state_ref, seg_ref, len_ref, y_ref,
    new_state_ref), where the optional inputs that are not given come as None; returns (y, new_state)."""
    optional = [state, None if segment_ids is None else segment_ids.astype(jnp.int32),
                None if lengths is None else lengths.astype(jnp.int32)]
    given = [a is not None for a in optional]

    def kernel(x_ref, w_ref, *refs):
        refs = iter(refs)
        body(x_ref, w_ref, *[next(refs) if g else None for g in given], next(refs), next(refs))

    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((x.shape[0], w.shape[-1] - 1, x.shape[2]), x.dtype))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, interpret=interpret_default() if interpret is None else interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps), name=name,
    )(x, w, *[a for a in optional if a is not None])


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
        input_output_aliases={3: 1}, interpret=interpret_default() if interpret is None else interpret,
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps), name="shortconv_decode",
    )(x, w, slots.astype(jnp.int32), state_pool)
