"""Mosaic-GPU pieces shared by the grouped-matmul and relative-attention kernels, working on jax 0.10.2 and 0.11.2.

On CPU the kernels run in Pallas's Mosaic-GPU interpret mode, which simulates the warpgroups, SMEM, TMA and
barriers, so the tests run the same kernel code as the H200.

In-kernel profiles: with PALLAS_MGPU_PROFILE_DIR set, the MoE kernels compiled afterwards record the start and
end of their named ranges (`profiled`: each pipeline step, each epilogue) per warpgroup with Mosaic GPU's
profiler, and every call writes a trace file there (Perfetto's format). Read the shares, not the lengths:
recording slows the kernels down. The records take PROFILE_RANGES x 16 bytes of SMEM per warpgroup, which the
stage counts make room for.
"""

import functools
import inspect
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
except ImportError:  # jax 0.10.2 has it only under _src
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

# Interpreted kernels run on a couple of simulated SMs: enough to exercise the persistent loop.
INTERPRET_SMS = 2
HOPPER_SMS = 132
# Registers kept by the TMA-issuing warpgroup (the rest go to the compute warpgroups).
MEMORY_REGISTERS = 40
SMEM_BYTES = 225 * 1024  # what a CTA's buffers may take on Hopper (227 KiB), less barriers and alignment
PROFILE_DIR_ENV = "PALLAS_MGPU_PROFILE_DIR"
PROFILE_RANGES = 320  # named ranges each warpgroup may record per call (a decode kernel's steps fit)
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters and (
    inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty)


def interpret_params(interpret: bool):
    # TMA zero-fills reads past the array end; the interpreter does the same with zero-initialised memory.
    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero") if interpret else None


def num_sms(interpret: bool) -> int:
    if interpret:
        return INTERPRET_SMS
    # lowered for CUDA on a machine without a GPU (`Backend(interpret=False)`): an H100 / H200's count
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else HOPPER_SMS


def profile_dir() -> str:
    return os.environ.get(PROFILE_DIR_ENV, "")


def compiler_params():
    profile = {}
    if profile_dir():
        os.makedirs(profile_dir(), exist_ok=True)
        profile = dict(profile_space=PROFILE_RANGES, profile_dir=profile_dir())
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **profile)


def smem_budget(warpgroups: int) -> int:
    """SMEM bytes a kernel's buffers may take: less the profiler's records (4 words per range) when profiling."""
    return SMEM_BYTES - (16 * PROFILE_RANGES * warpgroups if profile_dir() else 0)


def profiled(name: str):
    """Makes each call of a kernel-body function a range named `name` in in-kernel profiles (a no-op otherwise)."""
    def wrap(fn):
        @functools.wraps(fn)
        def named(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)
        return named
    return wrap


def tile_transforms(minor: int, dtype) -> tuple:
    """SMEM tiling + swizzle for a tile whose minor dimension holds `minor` elements."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _load(ref, layout):
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)


def load_row_vector(ref):
    """A [rows] vector laid out to broadcast along the columns of a WGMMA accumulator."""
    return _load(ref, plgpu.Layout.WGMMA.reduce(1))


def load_column_vector(ref):
    """A [columns] vector laid out to broadcast along the rows of a WGMMA accumulator."""
    return _load(ref, plgpu.Layout.WGMMA.reduce(0))


def row_vector(ref, interpret: bool):
    """`load_row_vector`, or under the interpreter (which has no rule for laid-out loads) a plain read."""
    return ref[...] if interpret else load_row_vector(ref)


def column_vector(ref, interpret: bool):
    """`load_column_vector`, or under the interpreter a plain read."""
    return ref[...] if interpret else load_column_vector(ref)


def as_wgmma_tile(x, interpret: bool):
    """x laid out as a WGMMA accumulator tile when compiled (jax 0.10.2's interpreter has no rule for layout
    casts, and needs none)."""
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def as_wgmma_rows(x, interpret: bool):
    """A [rows] vector laid out to broadcast along a WGMMA accumulator's columns when compiled."""
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def zero_rows_outside(tile_ref, row_axis: int, first_row, start, end, interpret: bool):
    """Zeroes the rows of an SMEM tile whose absolute index is outside [start, end)."""
    vals = tile_ref[...]
    rows = first_row + as_wgmma_tile(lax.broadcasted_iota(jnp.int32, vals.shape, row_axis), interpret)
    tile_ref[...] = jnp.where((rows >= start) & (rows < end), vals, jnp.zeros_like(vals))
    plgpu.commit_smem()


def store_tile(vals, smem, gmem, slot_counter: int, *, transposed: bool = False, interpret: bool = False):
    """Writes a register tile through one of two SMEM slots to GMEM with TMA; returns the next slot counter.

    A slot is reused only after its previous TMA store has finished reading it. The first store of a tile
    waits for all: the previous tile may have left its last store in either slot. transposed: a WGMMA
    accumulator tile [rows, cols] goes out as its transpose (the slots and gmem are [cols, rows]); compiled,
    through the transposed WGMMA register layout (a shuffle per register pair) into a transposed view of the
    slot, which is how Mosaic stores a transposed tile; under the interpreter, a plain transpose.
    """
    slot = slot_counter % 2
    plgpu.wait_smem_to_gmem(1 if slot_counter else 0, wait_read_only=True)
    if not transposed:
        smem[slot] = vals.astype(smem.dtype)
    elif interpret:
        smem[slot] = vals.T.astype(smem.dtype)
    else:
        view = smem.at[slot].transpose((1, 0))
        view[...] = plgpu.layout_cast(vals.astype(smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem.at[slot], gmem)
    return slot_counter + 1
