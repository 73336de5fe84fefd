"""Chooses the kernel and lays out operands.

`interpret`: False runs the Mosaic-GPU kernels compiled; True the portable kernels in Pallas interpret mode;
MOSAIC ("mosaic") the Mosaic-GPU kernels in Pallas's GPU interpreter on CPU (slow; checks the GPU code).

Weights come in their natural [G, K, N] form; `transpose_rhs` contracts their last axis instead (dgrad). The
Mosaic-GPU kernels read 2-D weight views; tf32 wgmma needs the contraction axis innermost, so fp32 operands
are transposed here where needed (fp32 is the test path, not the fast path).
"""

import jax.numpy as jnp

from pallas_kernels.moe import portable
from pallas_kernels.moe.groups import group_row_blocks, row_block_passes
from pallas_kernels.moe.kernel import gmm_kernel
from pallas_kernels.moe.kernel_wgrad import tgmm_kernel
from pallas_kernels.moe.tuning import fit_dims


MOSAIC = "mosaic"

# TMA copies of swizzled tiles need the row count to be a multiple of the tiling: 8 rows when rows are the
# major dimension, one 128-byte swizzle span when they are the minor one (tf32 weight gradient). Mosaic GPU
# cannot lay out these kernels' tiles narrower than one span: 64 16-bit elements, 32 fp32 ones.
_ROW_ALIGN = 8
SPAN_BYTES = 128


def _needs_k_minor(dtype) -> bool:
    return jnp.dtype(dtype).itemsize != 2


def _pad_rows(a, align=_ROW_ALIGN):
    return jnp.pad(a, [(0, -a.shape[0] % align)] + [(0, 0)] * (a.ndim - 1))


def _pad_depth(lhs, weights, transpose_rhs: bool):
    """The contraction (K) zero-padded to whole 128-byte swizzle spans, which the Mosaic-GPU kernels' tiles need (a
    tiny model's expert width as a K is 64 bytes in bf16); the zero columns add nothing to the products."""
    pad = -lhs[0].shape[1] % (SPAN_BYTES // lhs[0].dtype.itemsize)
    if not pad:
        return lhs, weights
    axis = 2 if transpose_rhs else 1
    return ([jnp.pad(a, [(0, 0), (0, pad)]) for a in lhs],
            [jnp.pad(w, [(0, pad if i == axis else 0) for i in range(3)]) for w in weights])


def gmm(lhs, weights, group_sizes, *, transpose_rhs: bool, pairs, epilogue, num_outputs: int, cfg,
        interpret: bool | str, row_inputs=(), out_dtype=None, mask_rows: bool = True):
    """Grouped matmul of rows sorted by group: see `kernel.gmm_kernel` for pairs/epilogue/row_inputs/out_dtype.

    weights: [G, K, N] arrays; out = lhs @ w[g] ([M, N]), or lhs @ w[g]^T ([M, K]) with transpose_rhs.
    """
    if interpret is not True:
        lhs, weights = _pad_depth(lhs, weights, transpose_rhs)
    num_groups, kw, nw = weights[0].shape
    n = kw if transpose_rhs else nw
    k_minor = transpose_rhs or _needs_k_minor(lhs[0].dtype)
    cfg = fit_dims(cfg, n, lhs[0].shape[1])
    if k_minor and not transpose_rhs:
        views = [w.transpose(0, 2, 1).reshape(num_groups * nw, kw) for w in weights]
    else:
        views = [w.reshape(num_groups * kw, nw) for w in weights]
    passes = row_block_passes(group_sizes, lhs[0].shape[0], cfg.block_rows)
    kwargs = dict(n=n, rhs_k_minor=k_minor, pairs=pairs, epilogue=epilogue, num_outputs=num_outputs, cfg=cfg,
                  out_dtype=out_dtype)
    if interpret is True:
        return portable.gmm_portable(lhs, views, passes, list(row_inputs), **kwargs)
    m = lhs[0].shape[0]
    outs = gmm_kernel([_pad_rows(a) for a in lhs], views, passes, list(row_inputs), interpret=interpret == MOSAIC,
                      mask_rows=mask_rows, **kwargs)
    return [o[:m] for o in outs]


def tgmm(x, dy, group_sizes, *, cfg, interpret: bool | str):
    """Per-group x[rows of g]^T @ dy[rows of g]: x [M, K], dy [M, N] -> [G, K, N] in x.dtype.

    The output rows (K) are tiled by whole warpgroups (64 rows). A K off that tiling (a tiny model's expert
    width) becomes the columns of the transposed product dy^T @ x where they fill whole 128-byte swizzle spans
    and N tiles by warpgroups (fp32 widths of 32: the result is transposed back, weight-sized, instead of
    padding the [M, K] activations); otherwise x is zero padded to the tiling and the result sliced back.
    Without either the grid would have no K block and leave the output unwritten.
    """
    k, n = x.shape[1], dy.shape[1]
    if k % cfg.wg_rows and not n % cfg.wg_rows and not k * x.dtype.itemsize % SPAN_BYTES:
        return tgmm(dy, x, group_sizes, cfg=cfg, interpret=interpret).transpose(0, 2, 1)
    cfg = fit_dims(cfg, n, k)
    x = jnp.pad(x, [(0, 0), (0, -k % cfg.block_rows_out)])
    blocks = group_row_blocks(group_sizes, x.shape[0], cfg.block_rows)
    if interpret is True:
        return portable.tgmm_portable(x, dy, blocks, cfg=cfg)[:, :k]
    mosaic_interpret = interpret == MOSAIC
    if _needs_k_minor(x.dtype):
        align = SPAN_BYTES // x.dtype.itemsize
        out = tgmm_kernel(_pad_rows(x, align).T, _pad_rows(dy, align).T, blocks, k_minor=True, cfg=cfg,
                          interpret=mosaic_interpret)
    else:
        out = tgmm_kernel(_pad_rows(x), _pad_rows(dy), blocks, k_minor=False, cfg=cfg, interpret=mosaic_interpret)
    return out[:, :k]
