"""What the gathered and segmented kernels share: the padded rank, masked tile reads and writes of whole-array
refs, fp32 products, and where each run of a slot ends.

Every ref is the whole array and a tile is a `pl.ds` window of power-of-two sizes, masked where it passes the
array's end (the input width, the rank, the output width, the rows): the array sizes are any, and neither the
activations nor the adapter pools are padded or copied. Compiled, masked lanes are never touched; Pallas's
interpreter reads them from a padded copy and drops them."""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.decode_attention.kernel import padded_size

padded_rank = padded_size  # the rank as a tile holds it: a power of two, at least a matmul's 16


def lanes_below(start, size: int, end):
    """[size] bool: which of the indices start, ..., start + size - 1 are below `end`."""
    return start + lax.broadcasted_iota(jnp.int32, (size,), 0) < end


def read(ref, *index, mask):
    """The masked tile ref[index] in fp32, zero where `mask` is False."""
    return plt.load(ref.at[index], mask=mask, other=0).astype(jnp.float32)


def add_to(ref, index, delta, mask):
    """ref[index] += delta (fp32) where `mask`, rounded once to ref's dtype; the rest is left unwritten."""
    old = plt.load(ref.at[index], mask=mask, other=0)
    plt.store(ref.at[index], (old.astype(jnp.float32) + delta).astype(ref.dtype), mask=mask)


def adapter_tile(pool_ref, slot, row0, rows: int, col0, cols: int):
    """pool[slot, row0:row0 + rows, col0:col0 + cols] of a pool [slots, in, rank] or [slots, rank, out] in
    fp32, zero past its ends."""
    mask = lanes_below(row0, rows, pool_ref.shape[1])[:, None] & lanes_below(col0, cols, pool_ref.shape[2])[None, :]
    return read(pool_ref, slot, pl.ds(row0, rows), pl.ds(col0, cols), mask=mask)


def matmul(a, b):
    """[m, k] @ [k, n] in fp32; HIGHEST keeps fp32 inputs out of TF32 on the Triton backend."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def run_ends(slots):
    """[N] int32: for each row, the index after the last row of its run (the rows around it with its slot)."""
    n = slots.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    last_of_run = jnp.append(slots[1:] != slots[:-1], True)
    return lax.cummin(jnp.where(last_of_run, index + 1, n), reverse=True)
