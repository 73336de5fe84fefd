"""W4A16 grouped matmul for Hopper (Mosaic GPU): NVFP4 weights become f16 in registers; an expert's tokens are N.

    out[s, :, rows of block] = epilogue([W_m[g(s)][rows] @ x[s]^T for each matrix m], column vectors of slab s)^T

Slabs hold one expert's tokens each (decode.in_slabs), token-major as the caller holds them: x [slabs, N, K],
out [slabs, N, rows]. The weights are the wgmma's left operand, which may live in registers: per k step the
memory warpgroup brings a tile of packed e2m1 codes and their f16 block scales into SMEM by TMA, and each
compute warpgroup turns its rows into f16 in registers before its products (`f16_planes`; compiled, the same
steps in PTX on 32-bit words), so the weights cross HBM and SMEM at 4 bits; each thread loads a piece's codes as
8 bytes at once (w4_codes.py).
A tile is (slab, block of `compute_wgs` x 64 output rows); each compute warpgroup owns 64 output rows and one
fp32 accumulator [64, N] per matrix (gate and up: two). x's tile is the wgmma's right operand read K-major (a
transposed view of the [N, K] tile), and the output tile leaves through the transposed WGMMA register layout
into an [N, 64] SMEM tile, so neither side needs a transpose in HBM (feature-major slabs would need XLA
transposes around every call).

The compute warpgroups bound the kernel, not the TMA stream: a step's work is instructions (gate/up, per thread:
32 words of codes to convert, 128 f16x2 scale multiplies). Hence, each to cut instructions or idle SMs:
- one wgmma call per matrix and step (`blocks_per_wgmma`), not one per NVFP4 block: the calls of a step share
  one fence and one commit;
- codes stored in the order the threads hold them (`to_units`): one 8-byte load per thread and piece, no
  repacking;
- the two code planes stored at e4m3's bit positions (`w4_codes.pack_codes`): 6 integer instructions per word
  of 8 codes before its 4 `cvt`;
- token-major x and output (above);
- the down projection's two adjacent 64-row blocks per warpgroup (`paired_rows`): its tiles have few k steps,
  and pairing halves their pipeline fills and epilogues;
- products with fewer output tiles than SMs split along K (`k_splits`, `k_splits_to_fill`): a warpgroup converts
  codes at a fixed rate, so a product whose tiles fill 48 of the 132 SMs (the attention output, the shared
  experts' down) converts at 48/132 of the chip's rate.
The kernels' figures: docs/performance.md.

The packed codes' layout and their conversion to f16 registers: w4_codes.py.
"""

import dataclasses
import functools

import jax
import jax.experimental.mosaic.gpu as mosaic_gpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.lowered_once import lowered_once
from pallas_kernels.moe.w4_codes import (BLOCK, PAIR, ROWS, UNIT_SHAPE, f16_planes, from_units,
                                          planes_in_registers)

N_ALIGN = 16  # tokens per slab are a multiple of this (the wgmma's N, and one 32-byte swizzle span of f16)
# A slab's fp32 column vectors land in SMEM rows of at least this many values, 128 bytes: their TMA copies need
# rows that start 128-byte aligned (16-value rows fail with a misaligned address)
COL_ROW = 32


@dataclasses.dataclass(frozen=True)
class W4Config:
    block_k: int = 256  # K values per pipeline step: 128 packed bytes per row (8 units)
    stages: int = 3
    compute_wgs: int = 2
    blocks_per_wgmma: int = 16  # NVFP4 blocks (16 K values each) per wgmma call: its fence and commit are shared


def config_for(n: int) -> W4Config:
    """Tiles for slabs of n tokens: 128 packed bytes per row and step for decode-sized slabs, 64 for wider ones
    (their x tile is n x block_k f16), and as many stages as fit beside the epilogue's buffers; wide slabs split a
    step's products into wgmma calls of 4 blocks. Chosen by a sweep on one H200 (jax 0.11.2) at 32 decode tokens
    and a 4096-token prefill."""
    cfg = W4Config(block_k=256, blocks_per_wgmma=16) if n <= 64 else W4Config(block_k=128, blocks_per_wgmma=4)
    # per step (two matrices, the larger case): packed codes, f16 block scales, the x tile
    stage = (ROWS * cfg.block_k + 16 * cfg.block_k) * cfg.compute_wgs + 2 * cfg.block_k * n
    fixed = cfg.compute_wgs * 2 * ROWS * n * 2 + 4096
    budget = mgpu.smem_budget(cfg.compute_wgs + 1)
    return dataclasses.replace(cfg, stages=max(2, min(4, (budget - fixed) // stage)))


def block_k(k: int, cfg: W4Config) -> int:
    """K values per pipeline step: cfg's, halved until it divides k (small shapes: tests, the tiny preset)."""
    bk = cfg.block_k
    while k % bk and bk > PAIR:
        bk //= 2
    return bk


def k_splits_to_fill(tiles: int, k: int, cfg: W4Config, interpret: bool, most: int = 4) -> int:
    """The most K splits (up to `most`, dividing the K steps) that keep `tiles` x splits within one tile per SM:
    a product of few output tiles (a decode step's attention output, 48 tiles of 128 rows) otherwise leaves most
    SMs idle, and each SM converts codes at a fixed rate (module doc)."""
    steps = k // block_k(k, cfg)
    return max(s for s in range(1, most + 1) if s == 1 or (s * tiles <= mgpu.num_sms(interpret) and steps % s == 0))


def _along_k(planes):
    """[64, 16] f16 operands in the WGMMA layout -> one [64, 16 len(planes)], the planes' columns in order (the
    layout holds 8 columns per register tile, so this only renumbers registers)."""
    layout = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK * len(planes)), jnp.float16, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,) * len(planes), return_type=out)
    def cat(ctx, *arrays):
        del ctx
        registers = np.concatenate([a.registers for a in arrays], axis=1)
        return mosaic_gpu.FragmentedArray(_registers=registers, _layout=arrays[0].layout, _is_signed=None)

    return cat(*planes)


def _multiply(acc, planes, x_smem, k0, staging):
    """acc += [planes along K] @ x_smem[:, k0 : k0 + 16 len(planes)]^T (x_smem: the [N, K] tile), as one wgmma
    call: one fence and one commit for all its instructions. staging: None when compiled; under jax 0.10.2's
    interpreter, which takes the left operand from SMEM only and has no transposed operands, [64, 16] and
    [16, N] buffers that each plane and its x columns pass through."""
    if staging is None:
        plgpu.wgmma(acc, _along_k(planes), x_smem.at[:, pl.ds(k0, BLOCK * len(planes))].transpose((1, 0)))
        return
    a_smem, b_smem = staging
    for i, a in enumerate(planes):
        a_smem[...] = a
        b_smem[...] = x_smem.at[:, pl.ds(k0 + BLOCK * i, BLOCK)][...].T
        plgpu.commit_smem()
        plgpu.wgmma(acc, a_smem, b_smem)


@lowered_once
def w4_gmm(x, packed, scales, *, slab_group, slab_rows, col_vectors, matrices: int, epilogue, out_dtype,
           cfg: W4Config, interpret: bool, paired_rows: bool = False, k_splits: int = 1):
    """Runs the kernel.

    Args:
      x: f16 [S, N, K]: slab s's tokens (N a multiple of N_ALIGN).
      packed: uint8 [G, matrices * out_rows / 64, K / 32, 8, 128]: the module doc's layout in `to_units`.
      scales: f16 [G, K / 16, out_rows / 64, matrices, 64].
      slab_group: int32 [S] the expert of each slab; slab_rows: int32 [S] its tokens (0: the slab is skipped).
      col_vectors: fp32 [S, N] arrays handed to the epilogue as [N] vectors of the tile's slab.
      epilogue: (list of fp32 accumulators [64, N], list of column vectors [N]) -> [one output tile [64, N]]
        (epilogues.py's, with axis=1).
      paired_rows: one matrix only: each warpgroup owns two adjacent 64-row blocks (two accumulators, as gate
        and up), each through the epilogue on its own. Tiles twice as tall, half as many: fewer pipeline fills
        and epilogues where there are many more tiles than SMs (module doc). Ignored where the rows are an odd
        number of 64-row blocks.
      k_splits: K's steps cut into this many equal parts, each a tile of its own writing a partial product
        (the epilogue must be linear): more tiles where there are fewer than SMs.
    Returns:
      out_dtype [S, N, out_rows]; with k_splits > 1 the partial products [k_splits, S, N, out_rows].
    """
    num_slabs, n, k = x.shape
    groups, row_groups, num_units = packed.shape[:3]
    if paired_rows and matrices != 1:
        raise ValueError("paired_rows pairs the row blocks of one matrix")
    out_rows = row_groups * ROWS // matrices
    paired_rows = paired_rows and out_rows % (2 * ROWS) == 0  # a single 64-row block stays unpaired
    accs_per_wg = 2 if paired_rows else matrices  # the row blocks a warpgroup loads per step, an accumulator each
    wg_rows = ROWS * accs_per_wg // matrices  # output rows of a warpgroup
    bk, wgs = block_k(k, cfg), cfg.compute_wgs
    if out_rows % (wgs * wg_rows):
        wgs = 1
    tile_rows = wgs * wg_rows
    per_call = min(cfg.blocks_per_wgmma, bk // BLOCK)
    if (packed.shape[3:] != UNIT_SHAPE or num_units * PAIR != k or k % bk or bk % PAIR or out_rows % tile_rows
            or n % N_ALIGN or (bk // BLOCK) % per_call or (k // bk) % k_splits):
        raise ValueError(f"bad W4 shapes: x {x.shape}, packed {packed.shape}, block_k {bk}, {wgs} warpgroups, "
                         f"{k_splits} K splits, paired rows {paired_rows}")
    nk, nblocks = k // bk, out_rows // tile_rows
    split_steps = nk // k_splits
    out_dtype = jnp.dtype(out_dtype)
    # row group r of a matrix is a tile's row block: tile `block`, warpgroup `wg`, accumulator `m` load
    # r = (block * wgs + wg) * accs_per_wg + m (for two matrices, m is the matrix: their row groups interleave)
    w_view = packed.reshape(groups * nblocks * wgs * accs_per_wg, num_units, *UNIT_SHAPE)
    s_view = scales.reshape(groups * (k // BLOCK), nblocks * wgs, accs_per_wg, ROWS)
    x_view = x.reshape(num_slabs * n, k)
    # x tiles [N, block_k]: swizzled along K, in whole swizzle spans per wgmma call (Mosaic takes K in groups
    # of one span)
    x_transforms = mgpu.tile_transforms(per_call * BLOCK, jnp.float16)
    cols_flat = [c.astype(jnp.float32).reshape(num_slabs * n) for c in col_vectors]
    n_cols = max(len(cols_flat), 1)

    def body(group_ref, rows_ref, w_ref, s_ref, x_ref, *refs):
        col_refs, out_ref = refs[:len(cols_flat)], refs[-1]
        wg = lax.axis_index("wg")

        def pipeline(slab, block, split, num_steps, step, context):
            g, k0 = group_ref[slab], split * split_steps
            specs = [
                plgpu.BlockSpec((wgs * accs_per_wg, bk // PAIR, *UNIT_SHAPE),
                                lambda kk: (g * nblocks + block, k0 + kk, 0, 0)),
                plgpu.BlockSpec((bk // BLOCK, wgs, accs_per_wg, ROWS), lambda kk: (g * nk + k0 + kk, block, 0, 0)),
                plgpu.BlockSpec((n, bk), lambda kk: (slab, k0 + kk), transforms=x_transforms),
            ]
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(num_steps,), memory_registers=mgpu.MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=cfg.stages, compute_context=context)

        zero = jnp.int32(0)
        allocs = pipeline(zero, zero, zero, cfg.stages, None, None).get_allocations(w_ref, s_ref, x_ref)

        scratch = dict(out_smem=plgpu.SMEM((wgs, 2, n, ROWS), out_dtype,
                                           transforms=mgpu.tile_transforms(ROWS, out_dtype)),
                       col_smem=plgpu.SMEM((wgs, n_cols, max(n, COL_ROW)), jnp.float32),
                       col_barriers=plgpu.Barrier(num_barriers=wgs * n_cols))
        if interpret:  # `_multiply`'s staging buffers
            scratch["a_smem"] = plgpu.SMEM((wgs, ROWS, BLOCK), jnp.float16,
                                           transforms=mgpu.tile_transforms(BLOCK, jnp.float16))
            scratch["b_smem"] = plgpu.SMEM((wgs, BLOCK, n), jnp.float16,
                                           transforms=mgpu.tile_transforms(n, jnp.float16))

        @functools.partial(pl.run_scoped, allocs=allocs, **scratch, collective_axes="wg")
        def scope(allocs, out_smem, col_smem, col_barriers, a_smem=None, b_smem=None):
            staging = None if a_smem is None else (a_smem.at[wg], b_smem.at[wg])

            @plgpu.nd_loop((k_splits * num_slabs * nblocks,), collective_axes="sm")
            def tile(info):
                split, rest = lax.div(info.index[0], num_slabs * nblocks), lax.rem(info.index[0], num_slabs * nblocks)
                slab, block = lax.div(rest, nblocks), lax.rem(rest, nblocks)

                @mgpu.profiled("step")
                def step(_, w_smem, s_smem, x_smem, accs):
                    for m in range(accs_per_wg):
                        planes = []
                        for q in range(bk // PAIR):  # a unit: 16 bytes of each row
                            unit = w_smem.at[wg * accs_per_wg + m, q]
                            for half, plane in enumerate(f16_planes(from_units(unit[...][None, None])) if interpret
                                                         else planes_in_registers(unit)):
                                b = 2 * q + half  # the NVFP4 block within the step
                                scale = mgpu.row_vector(s_smem.at[b, wg, m], interpret)
                                planes.append(plane * lax.broadcast_in_dim(scale, (ROWS, BLOCK), (0,)))
                                if len(planes) == per_call:
                                    _multiply(accs[m], planes, x_smem, BLOCK * (b + 1 - per_call), staging)
                                    planes = []
                    plgpu.wgmma_wait(0)
                    return accs

                @mgpu.profiled("epilogue")
                def finish(accs):
                    cols = []
                    for i in range(len(col_refs)):
                        plgpu.barrier_wait(col_barriers.at[wg * n_cols + i])
                        cols.append(mgpu.column_vector(col_smem.at[wg, i, pl.ds(0, n)], interpret))
                    outs = [epilogue([a[...]], cols)[0] for a in accs] if paired_rows else \
                        epilogue([a[...] for a in accs], cols)
                    out_slab = pl.ds((split * num_slabs + slab) * n, n)
                    for m, out in enumerate(outs):
                        row0 = ((block * wgs + wg) * len(outs) + m) * ROWS
                        mgpu.store_tile(out, out_smem.at[wg], out_ref.at[out_slab, pl.ds(row0, ROWS)], m,
                                        transposed=True, interpret=interpret)

                def context(run):
                    def with_accs(*accs):
                        for i, c in enumerate(col_refs):
                            plgpu.copy_gmem_to_smem(c.at[pl.ds(slab * n, n)], col_smem.at[wg, i, pl.ds(0, n)],
                                                    col_barriers.at[wg * n_cols + i])
                        run(accs)
                        finish(accs)

                    pl.run_scoped(with_accs, *[plgpu.ACC((ROWS, n), jnp.float32) for _ in range(accs_per_wg)])

                steps = jnp.where(rows_ref[slab] > 0, split_steps, 0)
                pipeline(slab, block, split, steps, step, context)(w_ref, s_ref, x_ref, allocations=allocs)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((k_splits * num_slabs * n, out_rows), out_dtype),
        grid=(mgpu.num_sms(interpret),), grid_names=("sm",),
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=mgpu.compiler_params(),
        interpret=mgpu.interpret_params(interpret),
    )
    out = kernel(slab_group.astype(jnp.int32), slab_rows.astype(jnp.int32), w_view, s_view, x_view, *cols_flat)
    return out.reshape(num_slabs, n, out_rows) if k_splits == 1 else out.reshape(k_splits, num_slabs, n, out_rows)
