"""Row-blocked grouped matmul for Hopper: Mosaic-GPU Pallas, warp-specialised TMA + wgmma pipeline.

    out_o[rows of g] = epilogue(sum over pairs (l, r, a) of lhs_l[rows of g] @ rhs_r[g])

A persistent grid (one block per SM) walks the output tiles (row block x n-block). Each tile runs one pipeline
over (group pass, k step): a memory warpgroup streams lhs and weight tiles by TMA, and the compute warpgroups,
each owning `wg_rows` rows, issue wgmma into fp32 accumulators. In a block that straddles groups, every pass
zeroes the lhs rows of the other groups in SMEM before its wgmma, so all passes add into the same accumulator
and the epilogue writes each output tile once (rows of no group come out as zeros).

Weights arrive as 2-D views: [G*K, N] (`rhs_k_minor=False`, a weight w[g] of [K, N]) or [G*N, K]
(`rhs_k_minor=True`, w[g] stored transposed, which is what dgrad needs and what tf32 requires).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.lowered_once import lowered_once
from pallas_kernels.moe.groups import RowBlockPasses
from pallas_kernels.moe.tuning import GmmConfig, fit_stages


@lowered_once
def gmm_kernel(lhs, rhs, passes: RowBlockPasses, row_inputs, *, n: int, rhs_k_minor: bool, pairs, epilogue,
               num_outputs: int, cfg: GmmConfig, interpret: bool, out_dtype=None, mask_rows: bool = True):
    """Runs the grouped matmul.

    Args:
      lhs: [M, K] operands, rows sorted by group (all the same shape and dtype).
      rhs: 2-D weight views, [G*K, n] or [G*n, K] (see module doc).
      passes: `row_block_passes(group_sizes, M, cfg.block_rows)`.
      row_inputs: fp32 vectors of length >= num_row_blocks * block_rows, handed to the epilogue as
        (wg_rows,) slices aligned with the tile rows (e.g. routing weights).
      pairs: (lhs index, rhs index, accumulator index) products summed per accumulator.
      epilogue: (list of fp32 accumulator tiles [wg_rows, block_n], list of row vectors) -> list of
        `num_outputs` tiles.
      out_dtype: of the outputs; default the lhs dtype (fp8 operands give bf16 outputs).
      mask_rows: False leaves out the masking of row blocks that straddle groups, for callers whose groups
        fill whole row blocks (fp8.py: Mosaic GPU has no select on 8-bit registers).
    Returns:
      `num_outputs` arrays [M, n] in out_dtype.
    """
    m, k = lhs[0].shape
    dtype = lhs[0].dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    wm, bm, bn, bk = cfg.wg_rows, cfg.block_rows, cfg.block_n, cfg.block_k
    if k % bk or n % bn or bn % cfg.epi_n:
        raise ValueError(f"K={k} and N={n} must be multiples of block_k={bk} and block_n={bn}")
    nk, nnb, nmb = k // bk, n // bn, pl.cdiv(m, bm)
    n_lhs, n_rhs, n_acc = len(lhs), len(rhs), 1 + max(a for _, _, a in pairs)
    itemsize = jnp.dtype(dtype).itemsize
    rhs_block = (bn, bk) if rhs_k_minor else (bk, bn)
    cfg = fit_stages(cfg, (n_lhs * bm * bk + n_rhs * bk * bn) * itemsize,
                     cfg.compute_wgs * 2 * wm * cfg.epi_n * out_dtype.itemsize)
    lhs_tf = mgpu.tile_transforms(bk, dtype)
    rhs_tf = mgpu.tile_transforms(rhs_block[1], dtype)

    def body(first_ref, count_ref, mixed_ref, group_ref, start_ref, end_ref, *refs):
        lhs_refs, rhs_refs = refs[:n_lhs], refs[n_lhs:n_lhs + n_rhs]
        row_refs, out_refs = refs[n_lhs + n_rhs:len(refs) - num_outputs], refs[len(refs) - num_outputs:]
        wg = lax.axis_index("wg")

        def pipeline(mi, ni, first, num_steps, step, context):
            def rhs_index(s):
                g, kk = group_ref[first + lax.div(s, nk)], lax.rem(s, nk)
                return (g * nnb + ni, kk) if rhs_k_minor else (g * nk + kk, ni)

            lhs_spec = plgpu.BlockSpec((bm, bk), lambda s: (mi, lax.rem(s, nk)), transforms=lhs_tf)
            rhs_spec = plgpu.BlockSpec(rhs_block, rhs_index, transforms=rhs_tf)
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(num_steps,), memory_registers=mgpu.MEMORY_REGISTERS,
                in_specs=[lhs_spec] * n_lhs + [rhs_spec] * n_rhs, wg_axis="wg",
                num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages, compute_context=context)

        zero = jnp.int32(0)
        allocs = pipeline(zero, zero, zero, cfg.stages, None, None).get_allocations(*lhs_refs, *rhs_refs)

        n_rows = max(len(row_refs), 1)

        @functools.partial(pl.run_scoped, allocs=allocs,
                           out_smem=plgpu.SMEM((cfg.compute_wgs, 2, wm, cfg.epi_n), out_dtype,
                                               transforms=mgpu.tile_transforms(cfg.epi_n, out_dtype)),
                           row_smem=plgpu.SMEM((cfg.compute_wgs, n_rows, wm), jnp.float32),
                           row_barriers=plgpu.Barrier(num_barriers=cfg.compute_wgs * n_rows),
                           collective_axes="wg")
        def scope(allocs, out_smem, row_smem, row_barriers):
            @plgpu.nd_loop((nmb * nnb,), collective_axes="sm")
            def tile(info):
                mi, ni = plgpu.planar_snake(info.index[0], (nmb, nnb), 1, cfg.grid_tile_width)
                first, mixed = first_ref[mi], mixed_ref[mi]
                row0 = mi * bm + wg * wm

                @mgpu.profiled("step")
                def step(idx, *args):
                    *tiles, accs = args
                    lhs_tiles = [t.at[pl.ds(wg * wm, wm)] for t in tiles[:n_lhs]]

                    if mask_rows:
                        @pl.when(mixed != 0)
                        def _mask():
                            p = first + lax.div(idx[0], nk)
                            for t in lhs_tiles:
                                mgpu.zero_rows_outside(t, 0, row0, start_ref[p], end_ref[p], interpret)

                    for li, ri, ai in pairs:
                        b = tiles[n_lhs + ri]
                        plgpu.wgmma(accs[ai], lhs_tiles[li], b.transpose((1, 0)) if rhs_k_minor else b)
                    # Release this step's buffers only once its wgmma is done: the warp-specialised pipeline
                    # starts the next tile's loads right after the last release (no delayed release).
                    plgpu.wgmma_wait(0)
                    return accs

                @mgpu.profiled("epilogue")
                def finish(accs):
                    rows = []
                    for i in range(len(row_refs)):
                        plgpu.barrier_wait(row_barriers.at[wg * n_rows + i])
                        rows.append(mgpu.row_vector(row_smem.at[wg, i], interpret))
                    outs = epilogue([a[...] for a in accs], rows)
                    counter = 0
                    for out_ref, val in zip(out_refs, outs):
                        for c in range(0, bn, cfg.epi_n):
                            dst = out_ref.at[pl.ds(row0, wm), pl.ds(ni * bn + c, cfg.epi_n)]
                            counter = mgpu.store_tile(val[:, c:c + cfg.epi_n], out_smem.at[wg], dst, counter)

                def context(run):
                    def with_accs(*accs):
                        # Row vectors reach registers through SMEM; their copies overlap the main loop.
                        for i, r in enumerate(row_refs):
                            plgpu.copy_gmem_to_smem(r.at[pl.ds(row0, wm)], row_smem.at[wg, i],
                                                    row_barriers.at[wg * n_rows + i])
                        run(accs)
                        finish(accs)

                    pl.run_scoped(with_accs, *[plgpu.ACC((wm, bn), jnp.float32) for _ in range(n_acc)])

                pipeline(mi, ni, first, count_ref[mi] * nk, step, context)(
                    *lhs_refs, *rhs_refs, allocations=allocs)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((m, n), out_dtype)] * num_outputs,
        grid=(mgpu.num_sms(interpret),), grid_names=("sm",),
        num_threads=cfg.compute_wgs + 1, thread_name="wg",
        compiler_params=mgpu.compiler_params(),
        interpret=mgpu.interpret_params(interpret),
    )
    padded_rows = nmb * bm
    row_inputs = [jnp.pad(r.astype(jnp.float32), (0, max(padded_rows - r.shape[0], 0))) for r in row_inputs]
    return kernel(passes.first_pass, passes.num_passes, passes.mixed, passes.group, passes.start,
                  passes.end, *lhs, *rhs, *row_inputs)

