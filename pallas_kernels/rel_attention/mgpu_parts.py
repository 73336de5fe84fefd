"""Pieces shared by the Mosaic GPU attention kernels (mgpu_forward, mgpu_dkdv, mgpu_dq): 64-row tiles whose rows
are the GQA group's heads x n_tok tokens, head-major; two compute warpgroups that take turns on the tensor cores.

Under Pallas' Mosaic GPU interpreter (tests on CPU) there are no register layouts, no `run_state` and no register
operands of wgmma; each helper takes `interpret` (or a staging buffer) and does the plain equivalent there.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import mgpu
from pallas_kernels.rel_attention import toeplitz

ROWS = toeplitz.TILE_ROWS
SMEM_LIMIT = 227 * 1024  # shared memory of one CTA on Hopper
COMPUTE_REGISTERS = 232  # per thread of a compute warpgroup, with mgpu.MEMORY_REGISTERS for the TMA one: 64K


def iota(axis: int, columns: int, interpret: bool):
    """Row (axis 0) or column (axis 1) indices of a [64, columns] tile, in the WGMMA layout when compiled."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, (ROWS, columns), axis)
    return plgpu.broadcasted_iota(jnp.int32, (ROWS, columns), axis, layout=plgpu.Layout.WGMMA)


def row_vector(ref, interpret: bool):
    """A [64] vector from SMEM that broadcasts along a tile's columns (one value per row)."""
    return ref[...] if interpret else mgpu.load_row_vector(ref)


def column_vector(ref, interpret: bool):
    """A [64] vector from SMEM that broadcasts along a tile's rows (one value per column)."""
    return ref[...] if interpret else mgpu.load_column_vector(ref)


def accumulate(acc, lhs, rhs_smem, lhs_smem):
    """acc + lhs @ rhs on the tensor cores, lhs from registers, accumulating in place. Under the interpreter
    (lhs_smem given), lhs goes through SMEM and the product through a fresh accumulator."""
    if lhs_smem is not None:
        lhs_smem[...] = lhs
        plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
            return acc_ref[...]

        return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))

    def accumulate_in_place(acc_ref):
        plgpu.wgmma(acc_ref, lhs, rhs_smem)

    return pl.run_state(accumulate_in_place)(plgpu.ACC.init(acc))


def take_turn(turn):
    """One compute warpgroup's matmuls against the other's elementwise work (FA3's ping-pong): both arrive on
    the shared barrier, then wait for it."""
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def copy_head_major(gmem, smem, b, t, g, groups, n_tok, barrier):
    """TMA copies of a [B, T, Hq, D] array's n_tok tokens from t, for the `groups` query heads of KV head g, into
    a [groups * n_tok, D] SMEM tile with the rows head-major (one copy per head, each arriving on `barrier`)."""
    for h in range(groups):
        plgpu.copy_gmem_to_smem(gmem.at[b, pl.ds(t, n_tok), g * groups + h], smem.at[pl.ds(h * n_tok, n_tok)], barrier)


def drain(free, first, end, slots: int, per_slot: int = 1):
    """At a memory warpgroup's end: wait for the releases of the last `slots` tiles of [first, end) (tile i uses
    slot (i - first) % slots, which has `per_slot` release barriers), so that every barrier phase is observed
    before the kernel exits."""
    @pl.loop(jnp.maximum(end - slots, first), end)
    def _(i):
        slot = lax.rem(i - first, slots)
        for w in range(per_slot):
            plgpu.barrier_wait(free.at[slot if per_slot == 1 else slot * per_slot + w])


def store_head_major(smem, gmem, b, t, g, groups, n_tok):
    """copy_head_major's way back: a head-major [groups * n_tok, D] SMEM tile into a [B, T, Hq, D] array (TMA;
    the caller waits with plgpu.wait_smem_to_gmem)."""
    for h in range(groups):
        plgpu.copy_smem_to_gmem(smem.at[pl.ds(h * n_tok, n_tok)], gmem.at[b, pl.ds(t, n_tok), g * groups + h])


def per_tile(x, n_tok: int, kv_heads: int):
    """[B, T, Hq, ...] -> [B, Hkv, T / n_tok, 64, ...]: each query tile's rows, head-major."""
    batch, seq, heads = x.shape[:3]
    x = x.reshape(batch, seq // n_tok, n_tok, kv_heads, heads // kv_heads, *x.shape[3:])
    x = jnp.moveaxis(x, 3, 1)  # [B, Hkv, T/n, t, G, ...]
    return jnp.swapaxes(x, 3, 4).reshape(batch, kv_heads, seq // n_tok, ROWS, *x.shape[5:])
