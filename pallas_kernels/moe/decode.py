"""Decode-sized MoE FFN: few rows, so the cost is reading each touched expert's weights once.

The rows of each non-empty group are copied into their own slab of `slab` rows (zero padded), slabs of touched
groups back to back. On that layout the row-blocked kernels see one group per row block, so every touched
expert's weights are streamed exactly once per n-block, spread over all SMs, and untouched experts are never
read. The results are gathered back to the caller's row order. `in_slabs` without a row bound pads each group to
whole row blocks instead: the layout the fp8 kernels (fp8.py) need at every size.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default, round_up
from pallas_kernels.moe import ops
from pallas_kernels.moe.groups import group_bounds, group_of_rows, row_groups, running_sum
from pallas_kernels.moe.tuning import KernelConfigs

SLAB_ROWS = 64  # wgmma's row granularity per warpgroup
# Steps of up to this many tokens run this layout (`inkling_jax.nn.moe_dispatch.grouped_ffn`): with top-k routing
# their rows fill about one slab per touched expert, which each slab's kernel block streams once, where the
# row-blocked prefill kernels would run blocks that straddle several experts, one pass per expert.
MAX_SLAB_TOKENS = 256


@functools.partial(jax.jit, static_argnames=("max_group_rows", "interpret", "configs"))
def moe_ffn_decode(x, w_gate, w_up, w_down, group_sizes, row_weights, *, max_group_rows: int | None,
                   interpret: bool | str | None = None, configs: KernelConfigs | None = None):
    """`moe_ffn` for decode batches. Requires max(group_sizes) <= max_group_rows (static), or None: each group
    in as many slabs as its rows fill (`in_slabs`).

    With top-k routing each token visits an expert at most once, so the number of tokens in the step is a
    valid bound. Rows of a group past the bound would be dropped. Differentiable like `moe_ffn`.
    """
    ops._check(x, w_gate, w_up, w_down)
    interpret = interpret_default() if interpret is None else interpret
    w_gate, w_up, w_down = ops.pad_expert_width(w_gate, w_up, w_down)
    configs = configs or KernelConfigs(decode=True)
    return in_slabs(x, group_sizes, row_weights, max_group_rows, lambda xs, sizes, rws: ops.moe_ffn_core(
        xs, w_gate, w_up, w_down, sizes, rws, interpret, configs, ops.MatmulKernels()))


def in_slabs(x, group_sizes, row_vectors, max_group_rows: int | None, ffn, *, align: int = SLAB_ROWS):
    """ffn(x_slabs, slab_sizes, row_vector_slabs) run on the slab layout (module doc), its rows gathered back
    to the order of x: [M, N] in the dtype ffn returns. row_vectors: one vector [M] per row of x (the routing
    weights), or a tuple of them, laid out like x (padding rows get zeros). The slabs: `slab_maps`."""
    slab_sizes, src, valid, dst, in_group = slab_maps(group_sizes, x.shape[0], max_group_rows, align)
    to_slabs = lambda v: _moved(v, src, valid, dst, in_group)  # noqa: E731
    y_slabs = ffn(to_slabs(x), slab_sizes, jax.tree.map(to_slabs, row_vectors))
    return _moved(y_slabs, dst, in_group, src, valid)


def slab_maps(group_sizes, num_rows: int, max_group_rows: int | None, align: int):
    """The slab layout of num_rows rows sorted by group: (slab_sizes [G], src [P]: the row each slab row copies,
    valid [P]: whether it copies one (else padding), dst [num_rows]: each row's slab row, in_group [num_rows]:
    whether the row is in a group). Slabs have max_group_rows rows rounded up to `align` each; with max_group_rows
    None, each group's own size rounded up (every group then fills whole blocks of `align` rows, at most
    num_groups * (align - 1) padding rows in all)."""
    num_groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    if max_group_rows is None:
        slab_sizes = round_up(ends - starts, align).astype(jnp.int32)
        total = round_up(num_rows + num_groups * (align - 1), align)
    else:
        slab = round_up(max_group_rows, align)
        slab_sizes = jnp.where(ends > starts, slab, 0).astype(jnp.int32)
        total = num_groups * slab
    slab_starts = running_sum(slab_sizes) - slab_sizes

    padded = jnp.arange(total, dtype=jnp.int32)
    slab_ends = slab_starts + slab_sizes
    pg = group_of_rows(slab_ends, total)
    src = starts[pg] + padded - slab_starts[pg]
    valid = (padded < slab_ends[pg]) & (src < ends[pg])
    src = jnp.where(valid, src, 0)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    rg = row_groups(group_sizes, num_rows)
    in_group = rows < ends[rg]
    dst = jnp.where(in_group, slab_starts[rg] + rows - starts[rg], 0)
    return slab_sizes, src, valid, dst, in_group


@jax.custom_vjp
def _moved(x, index, mask, inverse, inverse_mask):
    """x[index] where mask, else zeros: rows moved into or out of the slabs. The two maps are each other's inverse
    on the rows they keep, so the gradient is the other gather (XLA would otherwise scatter-add it, slowly)."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x[index], jnp.zeros((), x.dtype))


def _moved_fwd(x, index, mask, inverse, inverse_mask):
    return _moved(x, index, mask, inverse, inverse_mask), (index, mask, inverse, inverse_mask)


def _moved_bwd(res, g):
    index, mask, inverse, inverse_mask = res
    return _moved(g, inverse, inverse_mask, index, mask), None, None, None, None


_moved.defvjp(_moved_fwd, _moved_bwd)
