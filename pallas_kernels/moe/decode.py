"""Decode-sized MoE FFN: few rows, so the cost is reading each touched expert's weights once.

The rows of each non-empty group are copied into their own slab of `slab` rows (zero padded), slabs of touched
groups back to back. On that layout the row-blocked kernels see one group per row block, so every touched
expert's weights are streamed exactly once per n-block, spread over all SMs, and untouched experts are never
read. The results are gathered back to the caller's row order.
"""

import jax.numpy as jnp

from pallas_kernels._common import interpret_default
from pallas_kernels.moe import ops
from pallas_kernels.moe.groups import group_bounds
from pallas_kernels.moe.tuning import KernelConfigs

SLAB_ROWS = 64  # wgmma's row granularity per warpgroup


def moe_ffn_decode(x, w_gate, w_up, w_down, group_sizes, row_weights, *, max_group_rows: int,
                   interpret: bool | str | None = None, configs: KernelConfigs | None = None):
    """`moe_ffn` for decode batches. Requires max(group_sizes) <= max_group_rows (static).

    With top-k routing each token visits an expert at most once, so the number of tokens in the step is a
    valid bound. Rows of a group past the bound would be dropped. Differentiable like `moe_ffn`.
    """
    ops._check(x, w_gate, w_up, w_down)
    interpret = interpret_default() if interpret is None else interpret
    w_gate, w_up, w_down = ops.pad_expert_width(w_gate, w_up, w_down)
    configs = configs or KernelConfigs(decode=True)
    num_rows, num_groups = x.shape[0], group_sizes.shape[0]
    slab = -(-max_group_rows // SLAB_ROWS) * SLAB_ROWS
    starts, ends = group_bounds(group_sizes, num_rows)
    slab_sizes = jnp.where(ends > starts, slab, 0).astype(jnp.int32)
    slab_starts = jnp.cumsum(slab_sizes) - slab_sizes

    padded = jnp.arange(num_groups * slab, dtype=jnp.int32)
    # Searches by comparing all pairs (small arrays): the default scan is an XLA while loop (see groups.py).
    slab_ends = slab_starts + slab_sizes
    pg = jnp.minimum(jnp.searchsorted(slab_ends, padded, side="right", method="compare_all"), num_groups - 1)
    src = starts[pg] + padded - slab_starts[pg]
    valid = (padded < slab_ends[pg]) & (src < ends[pg])
    src = jnp.where(valid, src, 0)
    x_slabs = jnp.where(valid[:, None], x[src], 0)
    rw_slabs = jnp.where(valid, row_weights[src], 0)

    y_slabs = ops.moe_ffn_core(x_slabs, w_gate, w_up, w_down, slab_sizes, rw_slabs, interpret, configs)

    rows = jnp.arange(num_rows, dtype=jnp.int32)
    rg = jnp.minimum(jnp.searchsorted(ends, rows, side="right", method="compare_all"), num_groups - 1)
    in_group = rows < ends[rg]
    dst = jnp.where(in_group, slab_starts[rg] + rows - starts[rg], 0)
    return jnp.where(in_group[:, None], y_slabs[dst], 0).astype(x.dtype)
