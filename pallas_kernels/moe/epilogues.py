"""What the grouped-matmul kernels do with their fp32 accumulator tiles before the store.

Each epilogue takes (accumulator tiles [rows, cols], per-row vectors [rows]) and returns the output tiles. They
use only jnp/lax ops that both the Mosaic-GPU kernel and the portable kernel lower.
"""

import jax
from jax import lax


def plain(accs, rows):
    del rows
    return list(accs)


def swiglu(accs, rows, *, keep_preactivations: bool):
    """h = row_weight * silu(gate) * up in fp32; optionally also returns gate and up (for the backward)."""
    gate, up = accs
    weight = lax.broadcast_in_dim(rows[0], gate.shape, (0,))
    h = gate * jax.nn.sigmoid(gate) * up * weight
    return [h, gate, up] if keep_preactivations else [h]


def _broadcast(v, shape, axis: int):
    return lax.broadcast_in_dim(v, shape, (axis,))


def scaled(accs, vectors, *, axis: int = 0):
    """acc * scale per row (fp8 operands: the row's activation scale times its expert's weight scale), or per
    column with axis=1 (kernel_w4's tiles, whose columns are tokens)."""
    return [accs[0] * _broadcast(vectors[0], accs[0].shape, axis)]


def scaled_swiglu(accs, vectors, *, axis: int = 0):
    """swiglu of the gate and up accumulators, each first multiplied by its scale per row (per column with
    axis=1): vectors are (routing weight, gate scale, up scale)."""
    gate, up = accs
    weight, gate_scale, up_scale = (_broadcast(v, gate.shape, axis) for v in vectors)
    gate, up = gate * gate_scale, up * up_scale
    return [gate * jax.nn.sigmoid(gate) * up * weight]
