"""Grid/BlockSpec versions of the two grouped-matmul kernels, for Pallas interpret mode (CPU tests).

They take the same operands, tile schedules (`groups.py`) and epilogues (`epilogues.py`) as the Mosaic-GPU
kernels in `kernel.py` / `kernel_wgrad.py`, but each grid step contracts whole rows at once instead of
pipelining k tiles through SMEM. The Mosaic-GPU interpreter could run the real kernels on CPU, but too slowly
for the test suite; those kernels are checked compiled on a GPU (docs/kernels.md).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.moe.groups import GroupRowBlocks, RowBlockPasses
from pallas_kernels.moe.tuning import GmmConfig, WgradConfig


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)


def gmm_portable(lhs, rhs, passes: RowBlockPasses, row_inputs, *, n: int, rhs_k_minor: bool, pairs, epilogue,
                 num_outputs: int, cfg: GmmConfig, out_dtype=None):
    """Same contract as `kernel.gmm_kernel`."""
    m, k = lhs[0].shape
    bm, bn = cfg.block_rows, cfg.block_n
    n_lhs, n_rhs, n_row = len(lhs), len(rhs), len(row_inputs)
    n_acc = 1 + max(a for _, _, a in pairs)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731

    def body(first_ref, count_ref, group_ref, start_ref, end_ref, *refs):
        lhs_refs, rhs_refs = refs[:n_lhs], refs[n_lhs:n_lhs + n_rhs]
        row_refs, out_refs = refs[n_lhs + n_rhs:n_lhs + n_rhs + n_row], refs[n_lhs + n_rhs + n_row:]
        i, j = pl.program_id(0), pl.program_id(1)
        first = first_ref[i]
        rows = i * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

        def one_pass(p, accs):
            g, inside = group_ref[first + p], (rows >= start_ref[first + p]) & (rows < end_ref[first + p])
            xs = [jnp.where(inside, r[...], 0) for r in lhs_refs]
            accs = list(accs)
            for li, ri, ai in pairs:
                if rhs_k_minor:
                    w = rhs_refs[ri][pl.ds(g * n + j * bn, bn), :].T
                else:
                    w = rhs_refs[ri][pl.ds(g * k, k), pl.ds(j * bn, bn)]
                accs[ai] = accs[ai] + _dot(xs[li], w)
            return tuple(accs)

        zeros = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(n_acc))
        accs = lax.fori_loop(0, count_ref[i], one_pass, zeros)
        outs = epilogue(list(accs), [r[...].astype(jnp.float32) for r in row_refs])
        for out_ref, val in zip(out_refs, outs):
            out_ref[...] = val.astype(out_ref.dtype)

    meta = [passes.first_pass, passes.num_passes, passes.group, passes.start, passes.end]
    return pl.pallas_call(
        body,
        grid=(pl.cdiv(m, bm), n // bn),
        in_specs=[full(a.shape) for a in meta]
        + [pl.BlockSpec((bm, k), lambda i, j: (i, 0))] * n_lhs
        + [full(r.shape) for r in rhs]
        + [pl.BlockSpec((bm,), lambda i, j: (i,))] * n_row,
        out_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))] * num_outputs,
        out_shape=[jax.ShapeDtypeStruct((m, n), out_dtype or lhs[0].dtype)] * num_outputs,
        interpret=True,
    )(*meta, *lhs, *rhs, *row_inputs)


def tgmm_portable(lhs, rhs, blocks: GroupRowBlocks, *, cfg: WgradConfig):
    """out[g] = lhs[rows of g]^T @ rhs[rows of g] for lhs [M, K], rhs [M, N]; [G, K, N] in lhs dtype."""
    (m, k), n = lhs.shape, rhs.shape[1]
    bk, bn = cfg.block_rows_out, cfg.block_n
    num_groups = blocks.start.shape[0]
    full = lambda shape: pl.BlockSpec(shape, lambda g, a, b: (0,) * len(shape))  # noqa: E731

    def body(start_ref, end_ref, lhs_ref, rhs_ref, out_ref):
        g = pl.program_id(0)
        rows = lax.broadcasted_iota(jnp.int32, (m, 1), 0)
        inside = (rows >= start_ref[g]) & (rows < end_ref[g])
        out_ref[...] = _dot(jnp.where(inside, lhs_ref[...], 0).T, rhs_ref[...]).astype(out_ref.dtype)[None]

    return pl.pallas_call(
        body,
        grid=(num_groups, k // bk, n // bn),
        in_specs=[full(blocks.start.shape), full(blocks.end.shape),
                  pl.BlockSpec((m, bk), lambda g, a, b: (0, a)), pl.BlockSpec((m, bn), lambda g, a, b: (0, b))],
        out_specs=pl.BlockSpec((1, bk, bn), lambda g, a, b: (g, a, b)),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype),
        interpret=True,
    )(blocks.start, blocks.end, lhs, rhs)
