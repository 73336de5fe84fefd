"""Public SwiGLU MoE FFN over rows sorted by expert: the decode layout for few rows, else every expert's rows
padded to whole row blocks of the kernels' tiles (`decode.in_slabs`), forward and backward, so that no block straddles
two experts: the row-blocked kernels would visit such a block once per expert, and those blocks' longer pipelines
leave SMs idle at the end of the grid."""

import functools

import jax

from pallas_kernels._common import interpret_default
from pallas_kernels.moe import decode, ops
from pallas_kernels.moe.jax_mgpu import MatmulKernels
from pallas_kernels.moe.tuning import KernelConfigs, large_steps

# At most this many rows, every group fits one decode slab, so the decode path is always valid.
DECODE_MAX_ROWS = decode.SLAB_ROWS


@functools.partial(jax.jit, static_argnames=("interpret", "configs", "kernels"))
def moe_ffn(x, w_gate, w_up, w_down, group_sizes, row_weights, *, interpret: bool | str | None = None,
            configs: KernelConfigs | None = None, kernels: MatmulKernels | None = None):
    """out[rows of g] = row_weights * (silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g].

    Args:
      x: [M, H], rows sorted by expert. w_gate, w_up: [G, H, I]; w_down: [G, I, H] (same dtype as x).
      group_sizes: [G] int32, sum <= M (rows past the sum produce zeros).
      row_weights: [M] routing weight of each row (fp32 or x.dtype).
      interpret / configs / kernels: as in `grouped_matmul`.
    Returns:
      [M, H] in x.dtype. SwiGLU and the row weight are applied in fp32 on the fp32 accumulators (on the
      x.dtype products with jax's forward matmuls), the result is cast to x.dtype before the down projection.
      Differentiable in x, the three weights and row_weights. With M <= DECODE_MAX_ROWS it runs the decode
      layout (`moe_ffn_decode`), always on our kernels; else the slab layout, with `tuning.LARGE`'s tiles
      for steps of many rows per group (`tuning.large_steps`) unless `configs` is given.
    """
    ops._check(x, w_gate, w_up, w_down)
    interpret = interpret_default() if interpret is None else interpret
    w_gate, w_up, w_down = ops.pad_expert_width(w_gate, w_up, w_down)
    if x.shape[0] <= DECODE_MAX_ROWS:
        return decode.moe_ffn_decode(x, w_gate, w_up, w_down, group_sizes, row_weights,
                                     max_group_rows=x.shape[0], interpret=interpret, configs=configs)
    configs, _ = block_tiles(x.shape[0], group_sizes.shape[0], x.dtype, configs)
    return _in_slabs(x, w_gate, w_up, w_down, group_sizes, row_weights, interpret, configs,
                     kernels or MatmulKernels())


def block_tiles(num_rows: int, num_groups: int, dtype, configs: KernelConfigs | None = None
                ) -> tuple[KernelConfigs, int]:
    """(the tiles `moe_ffn` runs num_rows rows of num_groups groups with, the rows of their row blocks): the
    slab layout pads every group's rows to a multiple of the latter. `tuning.LARGE`'s tiles for steps of many
    rows per group (`tuning.large_steps`) unless `configs` is given."""
    configs = configs or KernelConfigs(large=large_steps(num_rows, num_groups))
    return configs, max(configs.get(role, dtype).block_rows for role in ("swiglu", "gmm"))


@functools.partial(jax.jit, static_argnames=("configs", "interpret", "kernels"))
def moe_ffn_in_blocks(x, w_gate, w_up, w_down, group_sizes, row_weights, *, configs: KernelConfigs,
                      interpret: bool | str | None = None, kernels: MatmulKernels | None = None):
    """`moe_ffn` on rows already in the slab layout of `configs`' row blocks (`block_tiles`): every group's rows
    start at a multiple of the block rows, zero rows with zero row weights pad each group to whole blocks, and
    group_sizes count those padded rows. Forward and backward run on that layout. For callers that place their
    rows so as they route them (`inkling_jax.nn.moe_dispatch`), which saves `moe_ffn`'s gathers into and out of
    it."""
    ops._check(x, w_gate, w_up, w_down)
    interpret = interpret_default() if interpret is None else interpret
    w_gate, w_up, w_down = ops.pad_expert_width(w_gate, w_up, w_down)
    return ops.moe_ffn_core(x, w_gate, w_up, w_down, group_sizes, row_weights, interpret, configs,
                            kernels or MatmulKernels())


def _in_slabs(x, w_gate, w_up, w_down, group_sizes, row_weights, interpret, configs, kernels):
    """`ops.moe_ffn_core` on every expert's rows padded to whole blocks of the kernels' rows, forward and
    backward (the moves into and out of the slabs are each other's gradient: `decode._moved`)."""
    _, align = block_tiles(x.shape[0], group_sizes.shape[0], x.dtype, configs)
    return decode.in_slabs(x, group_sizes, row_weights, None, lambda xs, sizes, rws: ops.moe_ffn_core(
        xs, w_gate, w_up, w_down, sizes, rws, interpret, configs, kernels), align=align)
