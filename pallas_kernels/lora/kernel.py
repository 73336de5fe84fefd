"""The LoRA product of a step as Pallas kernels (Triton backend, like the project's other small kernels):
`lora_add` checks its arguments, flattens the rows' tokens and runs the gathered or the segmented form."""

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default
from pallas_kernels.lora import tiles, tuning
from pallas_kernels.lora.gathered import gathered_add
from pallas_kernels.lora.segmented import segmented_add


def check_shapes(y, x, a, b, scale, slots) -> None:
    """A ValueError that names the mismatch, for arguments `lora_add` cannot take."""
    problems = []
    if x.ndim < 2 or y.shape[:-1] != x.shape[:-1]:
        problems.append(f"x {x.shape} and y {y.shape} must be [rows, ..., in] and [rows, ..., out]")
    if a.ndim != 3 or b.ndim != 3 or scale.ndim != 1 or not a.shape[0] == b.shape[0] == scale.shape[0]:
        problems.append(f"a {a.shape}, b {b.shape} and scale {scale.shape} must be [slots, in, rank], "
                        "[slots, rank, out] and [slots]")
    elif (a.shape[1], a.shape[2], b.shape[2]) != (x.shape[-1], b.shape[1], y.shape[-1]):
        problems.append(f"a {a.shape} and b {b.shape} do not take x {x.shape} to y {y.shape}")
    if slots.shape != x.shape[:1] or not jnp.issubdtype(slots.dtype, jnp.integer):
        problems.append(f"slots {slots.shape} {slots.dtype} must be one integer per row of x {x.shape}")
    if problems:
        raise ValueError("LoRA product: " + "; ".join(problems))


@functools.partial(jax.jit, static_argnames=("interpret", "blocks", "sorted_slots"))
def lora_add(y, x, a, b, scale, slots, *, interpret: bool | None = None,
             blocks: tuning.GatheredBlocks | tuning.SegmentedBlocks | None = None, sorted_slots: bool = False):
    """Kernel form of `reference.lora_add`: y [rows, ..., out] + scale[s] * (x [rows, ..., in] @ A[s]) @ B[s] in
    fp32, s = slots[row] (in [0, slots); 0: the base, whose rows are left as they are), rounded to y's dtype;
    a [slots, in, rank], b [slots, rank, out], scale [slots], any dtypes. y's buffer is reused for the result.

    blocks: the tiles, whose type also picks the form; None: `tuning.blocks_for` the rank, the gathered form when
    rows hold fewer than `tuning.SEGMENTED_MIN_TOKENS` tokens each and `sorted_slots` is False, else the segmented
    form. sorted_slots: the rows come sorted by slot (an MoE's (token, expert) rows by expert and slot), so their
    slots run long however few tokens each row holds."""
    check_shapes(y, x, a, b, scale, slots)
    interpret = interpret_default() if interpret is None else interpret
    per_row = math.prod(x.shape[1:-1])
    if blocks is None:
        gathered, segmented = tuning.blocks_for(tiles.padded_rank(a.shape[2]))
        blocks = gathered if per_row < tuning.SEGMENTED_MIN_TOKENS and not sorted_slots else segmented
    form = gathered_add if isinstance(blocks, tuning.GatheredBlocks) else segmented_add
    token_slots = jnp.repeat(slots.astype(jnp.int32), per_row, total_repeat_length=x.shape[0] * per_row)
    out = form(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), a, b, scale, token_slots, blocks=blocks,
               interpret=interpret)
    return out.reshape(y.shape)
