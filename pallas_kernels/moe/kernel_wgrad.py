"""Per-group transposed matmul (the weight gradient) for Hopper: Mosaic-GPU Pallas, warp-specialised.

    out[g] = lhs[rows of g]^T @ rhs[rows of g]        ([G, K, N], rows are the contraction)

A persistent grid walks the output tiles (group, k-block, n-block); each runs one pipeline over the row
blocks holding the group's rows, and the first and last of them zero the rows of the neighbouring groups in
SMEM (each compute warpgroup masks its own lhs columns). An empty group writes a zero tile.

`k_minor=False` (16-bit): lhs [M, K] and rhs [M, N]. `k_minor=True` (tf32, which wgmma only takes with the
contraction innermost): lhs [K, M] and rhs [N, M].
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.lowered_once import lowered_once
from pallas_kernels.moe.groups import GroupRowBlocks
from pallas_kernels.moe.tuning import WgradConfig, fit_stages


@lowered_once
def tgmm_kernel(lhs, rhs, blocks: GroupRowBlocks, *, k_minor: bool, cfg: WgradConfig, interpret: bool):
    """Returns [G, K, N] in lhs dtype; `blocks` is `group_row_blocks(group_sizes, M, cfg.block_rows)`."""
    (k, m), n = (lhs.shape, rhs.shape[0]) if k_minor else (lhs.shape[::-1], rhs.shape[1])
    num_groups = blocks.first_block.shape[0]
    dtype = lhs.dtype
    wm, br, bn = cfg.wg_rows, cfg.block_rows, cfg.block_n
    bk = cfg.block_rows_out
    if k % bk or n % bn or bn % cfg.epi_n:
        raise ValueError(f"K={k} and N={n} must be multiples of {bk} and block_n={bn}")
    nkb, nnb = k // bk, n // bn
    itemsize = jnp.dtype(dtype).itemsize
    cfg = fit_stages(cfg, (bk + bn) * br * itemsize, cfg.compute_wgs * 2 * wm * cfg.epi_n * itemsize)
    if k_minor:
        lhs_block, rhs_block = (bk, br), (bn, br)
    else:
        lhs_block, rhs_block = (br, bk), (br, bn)

    def body(first_ref, count_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref):
        wg = lax.axis_index("wg")

        def pipeline(kb, nb, first, num_steps, step, context):
            def lhs_index(s):
                return (kb, first + s) if k_minor else (first + s, kb)

            def rhs_index(s):
                return (nb, first + s) if k_minor else (first + s, nb)

            specs = [
                plgpu.BlockSpec(lhs_block, lhs_index, transforms=mgpu.tile_transforms(lhs_block[1], dtype)),
                plgpu.BlockSpec(rhs_block, rhs_index, transforms=mgpu.tile_transforms(rhs_block[1], dtype)),
            ]
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(num_steps,), memory_registers=mgpu.MEMORY_REGISTERS, in_specs=specs,
                wg_axis="wg", num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages,
                compute_context=context)

        zero = jnp.int32(0)
        allocs = pipeline(zero, zero, zero, cfg.stages, None, None).get_allocations(lhs_ref, rhs_ref)

        @functools.partial(pl.run_scoped, allocs=allocs,
                           out_smem=plgpu.SMEM((cfg.compute_wgs, 2, wm, cfg.epi_n), dtype,
                                               transforms=mgpu.tile_transforms(cfg.epi_n, dtype)),
                           collective_axes="wg")
        def scope(allocs, out_smem):
            @plgpu.nd_loop((num_groups, nkb * nnb), collective_axes="sm")
            def tile(info):
                g, lin = info.index
                kb, nb = plgpu.planar_snake(lin, (nkb, nnb), 1, cfg.grid_tile_width)
                first, start, end = first_ref[g], start_ref[g], end_ref[g]

                @mgpu.profiled("step")
                def step(idx, lhs_tile, rhs_tile, acc):
                    row0 = (first + idx[0]) * br
                    if k_minor:
                        a_tile, b = lhs_tile.at[pl.ds(wg * wm, wm), :], rhs_tile.transpose((1, 0))
                    else:
                        a_tile, b = lhs_tile.at[:, pl.ds(wg * wm, wm)], rhs_tile

                    @pl.when((row0 < start) | (row0 + br > end))
                    def _mask():
                        mgpu.zero_rows_outside(a_tile, 1 if k_minor else 0, row0, start, end, interpret)

                    plgpu.wgmma(acc, a_tile if k_minor else a_tile.transpose((1, 0)), b)
                    # Release this step's buffers only once its wgmma is done: the warp-specialised pipeline
                    # starts the next tile's loads right after the last release (no delayed release).
                    plgpu.wgmma_wait(0)
                    return acc

                def context(run):
                    def with_acc(acc):
                        run(acc)
                        val = acc[...]
                        counter = 0
                        for c in range(0, bn, cfg.epi_n):
                            dst = out_ref.at[g, pl.ds(kb * bk + wg * wm, wm), pl.ds(nb * bn + c, cfg.epi_n)]
                            counter = mgpu.store_tile(val[:, c:c + cfg.epi_n], out_smem.at[wg], dst, counter)

                    pl.run_scoped(with_acc, plgpu.ACC((wm, bn), jnp.float32))

                pipeline(kb, nb, first, count_ref[g], step, context)(lhs_ref, rhs_ref, allocations=allocs)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), dtype),
        grid=(mgpu.num_sms(interpret),), grid_names=("sm",),
        num_threads=cfg.compute_wgs + 1, thread_name="wg",
        compiler_params=mgpu.compiler_params(),
        interpret=mgpu.interpret_params(interpret),
    )
    return kernel(blocks.first_block, blocks.num_blocks, blocks.start, blocks.end, lhs, rhs)
