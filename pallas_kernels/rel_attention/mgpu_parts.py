"""Pieces shared by the Mosaic GPU attention kernels (mgpu_forward, mgpu_dkdv, mgpu_dq): 64-row tiles whose rows
are the GQA group's heads x n_tok tokens, head-major; two compute warpgroups that take turns on the tensor cores.

Under Pallas' Mosaic GPU interpreter (tests on CPU) there are no register layouts, no `run_state` and no register
operands of wgmma; each helper takes `interpret` (or a staging buffer) and does the plain equivalent there.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.mgpu import column_vector, row_vector  # noqa: F401 (the kernels call them as parts.*)
from pallas_kernels.rel_attention import tiles, toeplitz
from pallas_kernels.rel_attention.tiles import NEG, Geometry

ROWS = toeplitz.TILE_ROWS
SMEM_LIMIT = 227 * 1024  # shared memory of one CTA on Hopper
COMPUTE_REGISTERS = 232  # per thread of a compute warpgroup, with mgpu.MEMORY_REGISTERS for the TMA one: 64K


def iota(axis: int, columns: int, interpret: bool):
    """Row (axis 0) or column (axis 1) indices of a [64, columns] tile, in the WGMMA layout when compiled."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, (ROWS, columns), axis)
    return plgpu.broadcasted_iota(jnp.int32, (ROWS, columns), axis, layout=plgpu.Layout.WGMMA)


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


def initial_carry(geo: Geometry, interpret: bool):
    """(output accumulator, running max, running sum) of a compute warpgroup before its first key tile."""
    return (mgpu.as_wgmma_tile(jnp.zeros((ROWS, geo.head_dim), jnp.float32), interpret),
            mgpu.as_wgmma_rows(jnp.full((ROWS,), NEG, jnp.float32), interpret),
            mgpu.as_wgmma_rows(jnp.zeros((ROWS,), jnp.float32), interpret))


def window_mask(geo: Geometry, offset, interpret: bool, s):
    """s with the entries that a tile whose first query sits `offset` positions after its first key may not see
    (the future; past the window on sliding layers) set to NEG; rows are head-major."""
    bk = s.shape[1]
    token = lax.rem(iota(0, bk, interpret), ROWS // geo.groups)
    dist = offset + token - iota(1, bk, interpret)
    return jnp.where(tiles.in_view(geo, dist), s, NEG)


def attend(carry, q, k, v, c, ready, consumed, v_ready, v_consumed, turn, mask, dtype, *, bias=None, stage=None):
    """One key tile of a compute warpgroup's online softmax: the logits c * (q @ K^T [+ A @ Tz]) once the tiles in
    `ready` have landed (the `consumed` barriers are released after the products), mask(logits) if given, then
    the probabilities times V once `v_ready` has landed. The warpgroups take turns on the tensor cores through
    `turn`. bias: (A, Tz) SMEM tiles; stage: the interpreter's staging tile for the probabilities."""
    acc, m, l = carry
    for barrier in ready:
        plgpu.barrier_wait(barrier)

    def logits(s_ref):
        plgpu.wgmma(s_ref, q, k)
        if bias is not None:
            plgpu.wgmma(s_ref, *bias)
        take_turn(turn)
        return s_ref[...]

    s = pl.run_scoped(logits, plgpu.ACC((ROWS, k.shape[-1]), jnp.float32))
    s = s * lax.broadcast_in_dim(c, s.shape, [0])
    for barrier in consumed:
        plgpu.barrier_arrive(barrier)
    if mask is not None:
        s = mask(s)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l = l * alpha + p.sum(axis=1)
    p16 = p.astype(dtype)
    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
    plgpu.barrier_arrive(turn)  # softmax done
    plgpu.barrier_wait(v_ready)
    plgpu.barrier_wait(turn)  # the other warpgroup has issued its matmuls
    acc = accumulate(acc, p16, v, stage)
    plgpu.barrier_arrive(v_consumed)
    return acc, m_new, l


def store(acc, m, l, o_smem, lse_smem, o_ref, lse_ref, b, t, g, groups, n_tok):
    """A compute warpgroup's epilogue: its normalised output rows (through o_smem, the q tile's buffer) and its
    base-2 lse row (through lse_smem) to tile t / n_tok."""
    o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_smem.dtype)
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    store_head_major(o_smem, o_ref, b, t, g, groups, n_tok)
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, g, lax.div(t, n_tok)])
    plgpu.wait_smem_to_gmem(0)


def load_query_tile(refs, smem, barriers, b, g, t, groups, n_tok, interpret):
    """A forward compute warpgroup's start: its register budget, then its q, A and c tiles for the n_tok tokens
    from t (refs: q, A, c in GMEM; smem: their SMEM tiles; barriers: q's, then A's and c's). Returns c."""
    if not interpret:
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    (q_ref, a_ref, c_ref), (q_smem, a_smem, c_smem), (q_bar, a_bar) = refs, smem, barriers
    copy_head_major(q_ref, q_smem, b, t, g, groups, n_tok, q_bar)
    plgpu.copy_gmem_to_smem(a_ref.at[b, g, lax.div(t, n_tok)], a_smem, a_bar)
    plgpu.copy_gmem_to_smem(c_ref.at[b, lax.div(t, n_tok)], c_smem, a_bar)
    plgpu.barrier_wait(q_bar)
    plgpu.barrier_wait(a_bar)
    return row_vector(c_smem, interpret)
