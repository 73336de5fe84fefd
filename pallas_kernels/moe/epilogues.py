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
