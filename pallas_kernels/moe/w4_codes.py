"""NVFP4 codes as the W4 kernels (kernel_w4.py) read them: their layout in memory and their conversion to f16.

Packed layout (nvfp4.layout writes it): per expert, the 64 rows of each matrix for output rows 64j.. follow
each other; byte column c of a row holds the codes of K index 32 (c // 16) + c % 16 (its "low plane") and that
+ 16 (its "high plane"), their bits placed by `pack_codes`. So columns 16q..16q+15 of the low plane are one
NVFP4 block (K 32q..32q+15) and of the high plane the next one: each [64, 16] piece is one wgmma k-step with
one scale per row, and its right operand is x's 16 matching K columns. In memory each [64, 16] piece is one
1024-byte unit, its bytes in the order the compute warpgroup's threads hold them (`to_units`), so that a thread
loads its 8 bytes of a piece at once.
Scales: f16 [G, K / 16, out_rows / 64, matrices, 64], the e4m3 block scale times 64.
"""

import jax.experimental.mosaic.gpu as mosaic_gpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector

ROWS = 64  # output rows per compute warpgroup (the wgmma M), and the rows of a unit
BLOCK = 16  # K values per NVFP4 block scale (and per wgmma k-step)
PAIR = 2 * BLOCK  # K values per 16 packed bytes: a block of the low plane and one of the high plane
SCALE_FACTOR = 64.0  # the e4m3 bits built from an e2m1 code stand for its value times 2**-6
# Packed codes reach SMEM in units of 64 rows x 32 K values (16 bytes a row), each unit's 1024 bytes ordered so
# that each thread of a compute warpgroup finds the 8 bytes its WGMMA registers hold at 8 x its index (`to_units`)
UNIT_SHAPE = (8, 128)  # a unit's bytes as a TMA box (each box dimension is at most 256 elements)


def pack_codes(low, high):
    """Two planes' e2m1 codes (uint8 0..15, bits s|e1 e0 m) -> one byte each: low's bits where an e4m3 byte of the
    same value over 64 has them (s 7, e1 4, e0 3, m 2), high's at s 5, e1 6, e0 1, m 0, so that `f16_planes`
    takes low's e4m3 byte with one AND and high's with two shifts. NumPy or jax."""
    return ((low & 8) << 4) | ((low & 7) << 2) | ((high & 8) << 2) | ((high & 4) << 4) | (high & 3)


def unpack_codes(packed):
    """The inverse of `pack_codes`: bytes -> (low codes, high codes)."""
    return ((packed >> 4) & 8) | ((packed >> 2) & 7), ((packed >> 2) & 8) | ((packed >> 4) & 4) | (packed & 3)


def f16_planes(packed):
    """Packed bytes (`pack_codes`) -> (low codes, high codes) as f16 values times 2**-6, exactly: each code is
    moved to the e4m3 bits s|0 0 e1 e0|m 0 0, whose value is the e2m1 value over 64 (subnormal 0.5 included),
    then converted."""
    wide = packed.astype(jnp.uint16)  # Mosaic GPU shifts 16- and 32-bit values only
    low = wide & 0x9C
    high = ((wide << 2) & 0x8C) | ((wide >> 2) & 0x10)
    return tuple(lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16)
                 for b in (low, high))


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


def planes_in_registers(unit_ref):
    """`f16_planes` of a unit in SMEM for a compiled kernel: each thread loads its 8 bytes at once (two 32-bit
    words, eight codes each) and turns them into the f16 registers of the two [64, 16] planes in the WGMMA layout.
    (Pieces row-major in the WGMMA layout would take 2-byte loads and as many repacking instructions again.)
    Mosaic's own lowering of the conversion works on 16-bit lanes, one element at a time, and leaves the kernel
    ALU-bound, hence the PTX on 32-bit words."""
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
        # x: 8 codes (`f16_planes` on 4 bytes at once; the masks drop what the shifts carry across bytes);
        # each pair of e4m3 bytes -> one f16x2 (cvt keeps the lower byte in the lower half)
        ptx = """{
          .reg .b32 a, b, lo, hi;
          .reg .b16 l0, l1, h0, h1;
          and.b32 lo, $4, 0x9c9c9c9c;
          shl.b32 a, $4, 2;
          and.b32 a, a, 0x8c8c8c8c;
          shr.b32 b, $4, 2;
          and.b32 b, b, 0x10101010;
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
