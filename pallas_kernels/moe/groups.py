"""Tile schedules for rows sorted by group, computed with jnp before a kernel launch.

Forward-style kernels (`RowBlockPasses`) tile the rows in blocks; a block that straddles groups is visited once
per group it touches ("passes"), each pass masking the rows of the other groups, and all passes accumulate into
one output tile. Empty groups are dropped first, so no pass is wasted on them.

Weight-gradient kernels (`GroupRowBlocks`) walk, for each group, the row blocks that hold its rows.
"""

import dataclasses

import jax
import jax.numpy as jnp


def running_sum(v):
    """The inclusive cumulative sum of a short vector [G] as one masked reduction over [G, G]: XLA lowers
    `jnp.cumsum` on the GPU to a chain of reduce-window, pad and add kernels, a launch each in a decode step."""
    n = v.shape[0]
    upto = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    return jnp.sum(jnp.where(upto, v[None, :], jnp.zeros((), v.dtype)), axis=1)


def group_bounds(group_sizes, num_rows):
    """(start, end) row of every group, clipped to num_rows (sum(group_sizes) may not exceed it)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = running_sum(sizes)
    return jnp.minimum(ends - sizes, num_rows), jnp.minimum(ends, num_rows)


def group_of_rows(ends, num_rows: int):
    """The group of each of `num_rows` rows sorted by group, from the groups' cumulative ends; rows past the last
    end get the last group. One fused comparison of all pairs (small arrays), not the default search's XLA while
    loop, whose loop-carried copies add tiny memcpys to a decode step."""
    rows = jnp.arange(num_rows, dtype=ends.dtype)
    return jnp.minimum(jnp.searchsorted(ends, rows, side="right", method="compare_all"), ends.shape[0] - 1)


def row_groups(group_sizes, num_rows: int):
    """The group of each of `num_rows` rows sorted by group (rows past the last group: the last group). The one
    expression for it (the kernels' per-row scales, `decode.in_slabs`), so that XLA can share it within a step
    rather than compute two variants of it."""
    return group_of_rows(group_bounds(group_sizes, num_rows)[1], num_rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowBlockPasses:
    """Per row block: its first pass and pass count; per pass (non-empty groups in order): group and rows."""

    first_pass: jax.Array  # [num_blocks] index into the pass arrays
    num_passes: jax.Array  # [num_blocks] non-empty groups touching the block (0 past the last row)
    mixed: jax.Array  # [num_blocks] 1 if some row of the block must be masked in some pass
    group: jax.Array  # [G] group id of each pass (non-empty groups first)
    start: jax.Array  # [G] first row of the pass's group
    end: jax.Array  # [G] one past its last row


def row_block_passes(group_sizes, num_rows, block_rows):
    starts, ends = group_bounds(group_sizes, num_rows)
    nonempty = ends > starts
    group = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)
    # Empty groups sit at the end with an empty range past every row, so searches never land on them.
    past = jnp.int32(num_rows + block_rows)
    start = jnp.where(nonempty[group], starts[group], past)
    end = jnp.where(nonempty[group], ends[group], past)
    num_blocks = -(-num_rows // block_rows)
    lo = jnp.arange(num_blocks, dtype=jnp.int32) * block_rows
    hi = jnp.minimum(lo + block_rows, num_rows)
    # compare_all: one fused comparison instead of the default scan, an XLA while loop whose loop-carried copies
    # add tiny memcpys to every decode step (the arrays here are small).
    first = jnp.searchsorted(end, lo, side="right", method="compare_all").astype(jnp.int32)
    stop = jnp.searchsorted(start, hi, side="left", method="compare_all").astype(jnp.int32)
    count = jnp.maximum(stop - first, 0)
    head = jnp.minimum(first, group.shape[0] - 1)
    mixed = (count > 1) | (start[head] > lo) | (end[head] < hi)
    return RowBlockPasses(first, count, mixed.astype(jnp.int32), group, start, end)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupRowBlocks:
    """Per group: the first row block holding its rows, how many blocks, and its row range (for masks)."""

    first_block: jax.Array  # [G]
    num_blocks: jax.Array  # [G] (0 for an empty group)
    start: jax.Array  # [G]
    end: jax.Array  # [G]


def group_row_blocks(group_sizes, num_rows, block_rows):
    starts, ends = group_bounds(group_sizes, num_rows)
    first = starts // block_rows
    count = jnp.where(ends > starts, -(-ends // block_rows) - first, 0)
    return GroupRowBlocks(first.astype(jnp.int32), count.astype(jnp.int32), starts, ends)
