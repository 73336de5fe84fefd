"""W4A16 grouped matmul for Hopper (Mosaic GPU): NVFP4 weights become f16 in registers; an expert's tokens are N.

    out_t[s, rows of block] = epilogue([W_m[g(s)][rows] @ x_t[s] for each matrix m], column vectors of slab s)

Slabs hold one expert's tokens each (decode.in_slabs), feature-major: x_t [slabs, K, N]. The weights are the
wgmma's left operand, which may live in registers: per k step the memory warpgroup brings a tile of packed e2m1
codes and their f16 block scales into SMEM by TMA, and each compute warpgroup turns its rows into f16 in
registers before its products (`f16_planes`; compiled, the same steps in PTX on 32-bit words), so the weights
cross HBM and SMEM at 4 bits; each thread loads a piece's codes as 8 bytes at once (the packed layout below).
A tile is (slab, block of `compute_wgs` x 64 output rows); each compute warpgroup owns 64 output rows and one
fp32 accumulator [64, N] per matrix (gate and up: two).

On the H200 (bench/results/moe.md, 2026-12-01) the 32-token decode step reads its 1.2 GB of NVFP4 experts at
0.67 of the read bandwidth in slabs of 16 tokens (432 us). The compute warpgroups bound the kernel, not the TMA
stream: an in-kernel profile (mgpu.py) put them inside their pipeline steps 0.81-0.89 of the time, with ~0.15 us
waits between steps, and a step's work is instructions (gate/up, per thread: 32 words of codes to convert,
128 f16x2 scale multiplies). What took time out, in order:
- one wgmma call per matrix and step (`blocks_per_wgmma`), not one per NVFP4 block, each call bringing a fence
  and a commit: 577 -> 533 us at 32 tokens, 739 -> 662 us at 128;
- codes stored in the order the threads hold them (`to_units`): loading the row-major pieces in the WGMMA
  layout took 2-byte loads and about as many repacking instructions again (the gate/up kernel's PTX: 64
  `ld.shared.v2.b8`, 130 `cvt.u32.u16`, 96 `prmt` per step): 531 -> 432 us at 32 tokens, 656 -> 552 at 128.
Tried and slower: all of a step's conversions before its wgmmas (639 us against 573); the conversion by
rotations and masks only (no `cvt`, 11 integer instructions per 8 codes against 9 and 4 `cvt`: 590 us against
533), which suggests that the integer pipe, not the conversion unit, is the scarce one (not profiled).

Packed layout (nvfp4.layout writes it): per expert, the 64 rows of each matrix for output rows 64j.. follow
each other; byte column c of a row holds K index 32 (c // 16) + c % 16 in its low nibble and that + 16 in its high
nibble. So columns 16q..16q+15 of the low-nibble plane are one NVFP4 block (K 32q..32q+15) and of the high plane
the next one: each [64, 16] piece is one wgmma k-step with one scale per row, and its right operand is 16
consecutive rows of x_t. In memory each [64, 16] piece is one 1024-byte unit, its bytes in the order the
compute warpgroup's threads hold them (`to_units`), so that a thread loads its 8 bytes of a piece at once.
Scales: f16 [G, K / 16, out_rows / 64, matrices, 64], the e4m3 block scale times 64.
"""

import dataclasses
import functools

import jax
import jax.experimental.mosaic.gpu as mosaic_gpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector

from pallas_kernels.moe import mgpu

ROWS = 64  # output rows per compute warpgroup (the wgmma M)
BLOCK = 16  # K values per NVFP4 block scale (and per wgmma k-step)
PAIR = 2 * BLOCK  # K values per 16 packed bytes: a low-nibble block and a high-nibble block
SCALE_FACTOR = 64.0  # the e4m3 bits built from an e2m1 code stand for its value times 2**-6
# x_t tiles [K, N], N-major: a 32-byte swizzle, so that each wgmma contracts 16 rows (one NVFP4 block) with a
# [64, 16] register operand (Mosaic takes K in groups of one swizzle span)
X_TRANSFORMS = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
N_ALIGN = 16  # tokens per slab are a multiple of this (the wgmma's N, and one 32-byte swizzle span of f16)
# Packed codes reach SMEM in units of 64 rows x 32 K values (16 bytes a row), each unit's 1024 bytes ordered so
# that each thread of a compute warpgroup finds the 8 bytes its WGMMA registers hold at 8 x its index (`to_units`)
UNIT_SHAPE = (8, 128)  # a unit's bytes as a TMA box (each box dimension is at most 256 elements)
# A slab's fp32 column vectors land in SMEM rows of at least this many values, 128 bytes: their TMA copies need
# rows that start 128-byte aligned (16-value rows failed with a misaligned address on the H200)
COL_ROW = 32


@dataclasses.dataclass(frozen=True)
class W4Config:
    block_k: int = 256  # K values per pipeline step: 128 packed bytes per row (8 units)
    stages: int = 3
    compute_wgs: int = 2
    blocks_per_wgmma: int = 16  # NVFP4 blocks (16 K values each) per wgmma call: its fence and commit are shared


def f16_planes(packed):
    """Packed bytes (uint8, two e2m1 codes each) -> (low codes, high codes) as f16 values times 2**-6, exactly:
    each 4-bit code s|e1 e0 m is moved to the e4m3 bits s|0 0 e1 e0|m 0 0, whose value is the e2m1 value over
    64 (subnormal 0.5 included), then converted."""
    wide = packed.astype(jnp.uint16)  # Mosaic GPU shifts 16- and 32-bit values only
    low = ((wide & 0x07) << 2) | ((wide & 0x08) << 4)
    high = ((wide >> 2) & 0x1C) | (wide & 0x80)
    return tuple(lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16)
                 for b in (low, high))


def config_for(n: int) -> W4Config:
    """Tiles for slabs of n tokens: 128 packed bytes per row and step for decode-sized slabs, 64 for wider ones
    (their x tile is n x block_k f16), and as many stages as fit beside the epilogue's buffers. On the H200 at 32
    tokens: 610 us; 4 stages did not fit, 2 took 619 us, 3 compute warpgroups 617-621 us (2026-11-30)."""
    cfg = W4Config(block_k=256 if n <= 64 else 128)
    # per step (two matrices, the larger case): packed codes, f16 block scales, the x tile
    stage = (ROWS * cfg.block_k + 16 * cfg.block_k) * cfg.compute_wgs + 2 * cfg.block_k * n
    fixed = cfg.compute_wgs * 2 * ROWS * n * 2 + 4096
    budget = mgpu.smem_budget(cfg.compute_wgs + 1)
    return dataclasses.replace(cfg, stages=max(2, min(4, (budget - fixed) // stage)))


def to_units(packed):
    """Packed bytes [..., rows, K / 2] (rows a multiple of 64; row-major, as the module doc lays them out) -> the
    kernel's units [..., rows / 64, K / 32, 8, 128]; NumPy or jax arrays. Thread 32 warp + 4 i + j of a compute
    warpgroup holds rows r = 16 warp + i and r + 8, columns c = 2 j and c + 1 of each 8-column half of a [64, 16]
    piece; its 8 bytes sit at 8 x its index, as two words (one per half): (r, c), (r, c + 1), (r + 8, c),
    (r + 8, c + 1)."""
    *lead, rows, half_k = packed.shape
    n = len(lead)
    t = packed.reshape(*lead, rows // ROWS, 4, 2, 8, half_k // BLOCK, 2, 4, 2)
    group, warp, row_half, i, unit, half, j, byte = range(n, n + 8)
    t = t.transpose(*range(n), group, unit, warp, i, j, half, row_half, byte)
    return t.reshape(*lead, rows // ROWS, half_k // BLOCK, *UNIT_SHAPE)


def from_units(units):
    """The inverse of `to_units`: [..., rows / 64, K / 32, 8, 128] -> [..., rows, K / 2]."""
    *lead, groups, num_units, _, _ = units.shape
    n = len(lead)
    t = units.reshape(*lead, groups, num_units, 4, 8, 4, 2, 2, 2)
    group, unit, warp, i, j, half, row_half, byte = range(n, n + 8)
    t = t.transpose(*range(n), group, warp, row_half, i, unit, half, j, byte)
    return t.reshape(*lead, groups * ROWS, num_units * BLOCK)


def _planes_in_registers(unit_ref):
    """`f16_planes` of a unit in SMEM for a compiled kernel: each thread loads its 8 bytes at once (two 32-bit
    words, eight codes each) and turns them into the f16 registers of the two [64, 16] planes in the WGMMA layout.
    Loading the pieces row-major in the WGMMA layout instead took 2-byte loads and as many repacking instructions
    again before the conversion. Mosaic's own lowering of the conversion (16-bit lanes, one element at a time)
    left the H200 kernel ALU-bound at 0.31 of the read bandwidth, hence the PTX on 32-bit words."""
    layout = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct((ROWS, BLOCK), jnp.float16, layout=layout)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=(out, out))
    def planes(ctx, ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        (chunk,) = mosaic_gpu.FragmentedArray.load_strided(ref, is_signed=False, vec_size=8).registers.reshape(-1)
        words = mgpu_utils.bitcast(chunk, ir.VectorType.get((2,), i32))
        wgmma_layout = mosaic_gpu.WGMMA_LAYOUT
        shape = wgmma_layout.registers_shape((ROWS, BLOCK))
        low, high = np.empty(4, dtype=object), np.empty(4, dtype=object)
        # x: 8 codes. low bytes: ((x & 0x07) << 2) | ((x & 0x08) << 4); high: ((x >> 2) & 0x1c) | (x & 0x80);
        # each pair of e4m3 bytes -> one f16x2 (cvt keeps the lower byte in the lower half)
        ptx = """{
          .reg .b32 a, b, lo, hi;
          .reg .b16 l0, l1, h0, h1;
          and.b32 a, $4, 0x07070707;
          shl.b32 a, a, 2;
          and.b32 b, $4, 0x08080808;
          shl.b32 b, b, 4;
          or.b32 lo, a, b;
          shr.b32 a, $4, 2;
          and.b32 a, a, 0x1c1c1c1c;
          and.b32 b, $4, 0x80808080;
          or.b32 hi, a, b;
          mov.b32 {l0, l1}, lo;
          mov.b32 {h0, h1}, hi;
          cvt.rn.f16x2.e4m3x2 $0, l0;
          cvt.rn.f16x2.e4m3x2 $1, l1;
          cvt.rn.f16x2.e4m3x2 $2, h0;
          cvt.rn.f16x2.e4m3x2 $3, h1;
        }"""
        struct = llvm.StructType.get_literal([i32] * 4)
        for half in range(2):  # word `half`: columns 8 half + c, + 1 of rows r, r + 8 (registers 2 half, + 1)
            word = vector.extract(words, [], [half])
            res = llvm.inline_asm(struct, [word], ptx, "=r,=r,=r,=r,r", has_side_effects=False)
            parts = [mgpu_utils.bitcast(llvm.extractvalue(i32, res, [i]), f16x2) for i in range(4)]
            low[2 * half], low[2 * half + 1], high[2 * half], high[2 * half + 1] = parts
        return tuple(mosaic_gpu.FragmentedArray(_registers=r.reshape(shape), _layout=wgmma_layout, _is_signed=None)
                     for r in (low, high))

    return planes(unit_ref)


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


def _multiply(acc, planes, x_rows, a_smem):
    """acc += [planes along K] @ x_rows, as one wgmma call: one fence and one commit for all its instructions
    (against a call per plane: 577 -> 533 us for the H200's 32-token step). a_smem: None when compiled; under
    jax 0.10.2's interpreter, which takes the left operand from SMEM only, a [64, 16] buffer that each plane
    passes through."""
    if a_smem is None:
        plgpu.wgmma(acc, _along_k(planes), x_rows)
        return
    for i, a in enumerate(planes):
        a_smem[...] = a
        plgpu.commit_smem()
        plgpu.wgmma(acc, a_smem, x_rows.at[pl.ds(BLOCK * i, BLOCK)])


def w4_gmm(x_t, packed, scales, *, slab_group, slab_rows, col_vectors, matrices: int, epilogue, out_dtype,
           cfg: W4Config, interpret: bool):
    """Runs the kernel.

    Args:
      x_t: f16 [S, K, N]: slab s's tokens, feature-major (N a multiple of N_ALIGN).
      packed: uint8 [G, matrices * out_rows / 64, K / 32, 8, 128]: the module doc's layout in `to_units`.
      scales: f16 [G, K / 16, out_rows / 64, matrices, 64].
      slab_group: int32 [S] the expert of each slab; slab_rows: int32 [S] its tokens (0: the slab is skipped).
      col_vectors: fp32 [S, N] arrays handed to the epilogue as [N] vectors of the tile's slab.
      epilogue: (list of fp32 accumulators [64, N], list of column vectors [N]) -> [one output tile [64, N]]
        (epilogues.py's, with axis=1).
    Returns:
      out_dtype [S, out_rows, N].
    """
    num_slabs, k, n = x_t.shape
    groups, row_groups, num_units = packed.shape[:3]
    out_rows = row_groups * ROWS // matrices
    bk, wgs = cfg.block_k, cfg.compute_wgs
    while k % bk and bk > PAIR:  # small shapes (tests, the tiny preset)
        bk //= 2
    if out_rows % (wgs * ROWS):
        wgs = 1
    tile_rows = wgs * ROWS
    per_call = min(cfg.blocks_per_wgmma, bk // BLOCK)
    if (packed.shape[3:] != UNIT_SHAPE or num_units * PAIR != k or k % bk or bk % PAIR or out_rows % tile_rows
            or n % N_ALIGN or (bk // BLOCK) % per_call):
        raise ValueError(f"bad W4 shapes: x_t {x_t.shape}, packed {packed.shape}, block_k {bk}, {wgs} warpgroups")
    nk, nblocks = k // bk, out_rows // tile_rows
    out_dtype = jnp.dtype(out_dtype)
    w_view = packed.reshape(groups * nblocks * wgs * matrices, num_units, *UNIT_SHAPE)
    s_view = scales.reshape(groups * (k // BLOCK), out_rows // ROWS, matrices, ROWS)
    x_view = x_t.reshape(num_slabs * k, n)
    cols_flat = [c.astype(jnp.float32).reshape(num_slabs * n) for c in col_vectors]
    n_cols = max(len(cols_flat), 1)

    def body(group_ref, rows_ref, w_ref, s_ref, x_ref, *refs):
        col_refs, out_ref = refs[:len(cols_flat)], refs[-1]
        wg = lax.axis_index("wg")

        def pipeline(slab, block, num_steps, step, context):
            g = group_ref[slab]
            specs = [
                plgpu.BlockSpec((wgs * matrices, bk // PAIR, *UNIT_SHAPE), lambda kk: (g * nblocks + block, kk, 0, 0)),
                plgpu.BlockSpec((bk // BLOCK, wgs, matrices, ROWS), lambda kk: (g * nk + kk, block, 0, 0)),
                plgpu.BlockSpec((bk, n), lambda kk: (slab * nk + kk, 0), transforms=X_TRANSFORMS),
            ]
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(num_steps,), memory_registers=mgpu.MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=cfg.stages, compute_context=context)

        zero = jnp.int32(0)
        allocs = pipeline(zero, zero, cfg.stages, None, None).get_allocations(w_ref, s_ref, x_ref)

        scratch = dict(out_smem=plgpu.SMEM((wgs, 2, ROWS, n), out_dtype,
                                           transforms=mgpu.tile_transforms(n, out_dtype)),
                       col_smem=plgpu.SMEM((wgs, n_cols, max(n, COL_ROW)), jnp.float32),
                       col_barriers=plgpu.Barrier(num_barriers=wgs * n_cols))
        if interpret:  # jax 0.10.2's interpreter takes the wgmma's left operand from SMEM only
            scratch["a_smem"] = plgpu.SMEM((wgs, ROWS, BLOCK), jnp.float16,
                                           transforms=mgpu.tile_transforms(BLOCK, jnp.float16))

        @functools.partial(pl.run_scoped, allocs=allocs, **scratch, collective_axes="wg")
        def scope(allocs, out_smem, col_smem, col_barriers, a_smem=None):
            @plgpu.nd_loop((num_slabs * nblocks,), collective_axes="sm")
            def tile(info):
                slab, block = lax.div(info.index[0], nblocks), lax.rem(info.index[0], nblocks)

                @mgpu.profiled("step")
                def step(_, w_smem, s_smem, x_smem, accs):
                    for m in range(matrices):
                        planes = []
                        for q in range(bk // PAIR):  # a unit: 16 bytes of each row
                            unit = w_smem.at[wg * matrices + m, q]
                            for half, plane in enumerate(f16_planes(from_units(unit[...][None, None])) if interpret
                                                         else _planes_in_registers(unit)):
                                b = 2 * q + half  # the NVFP4 block within the step
                                scale = mgpu.row_vector(s_smem.at[b, wg, m], interpret)
                                planes.append(plane * lax.broadcast_in_dim(scale, (ROWS, BLOCK), (0,)))
                                if len(planes) == per_call:
                                    x_rows = x_smem.at[pl.ds(BLOCK * (b + 1 - per_call), BLOCK * per_call)]
                                    _multiply(accs[m], planes, x_rows, None if a_smem is None else a_smem.at[wg])
                                    planes = []
                    plgpu.wgmma_wait(0)
                    return accs

                @mgpu.profiled("epilogue")
                def finish(accs):
                    cols = []
                    for i in range(len(col_refs)):
                        plgpu.barrier_wait(col_barriers.at[wg * n_cols + i])
                        cols.append(mgpu.column_vector(col_smem.at[wg, i, pl.ds(0, n)], interpret))
                    (out,) = epilogue([a[...] for a in accs], cols)
                    row0 = slab * out_rows + block * tile_rows + wg * ROWS
                    mgpu.store_tile(out, out_smem.at[wg], out_ref.at[pl.ds(row0, ROWS)], 0)

                def context(run):
                    def with_accs(*accs):
                        for i, c in enumerate(col_refs):
                            plgpu.copy_gmem_to_smem(c.at[pl.ds(slab * n, n)], col_smem.at[wg, i, pl.ds(0, n)],
                                                    col_barriers.at[wg * n_cols + i])
                        run(accs)
                        finish(accs)

                    pl.run_scoped(with_accs, *[plgpu.ACC((ROWS, n), jnp.float32) for _ in range(matrices)])

                steps = jnp.where(rows_ref[slab] > 0, nk, 0)
                pipeline(slab, block, steps, step, context)(w_ref, s_ref, x_ref, allocations=allocs)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_slabs * out_rows, n), out_dtype),
        grid=(mgpu.num_sms(interpret),), grid_names=("sm",),
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=mgpu.compiler_params(),
        interpret=mgpu.interpret_params(interpret),
    )
    out = kernel(slab_group.astype(jnp.int32), slab_rows.astype(jnp.int32), w_view, s_view, x_view, *cols_flat)
    return out.reshape(num_slabs, out_rows, n)
