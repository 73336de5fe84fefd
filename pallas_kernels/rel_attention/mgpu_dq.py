"""dQ of the key tiles that carry no relative bias, on Hopper tensor cores (Pallas Mosaic GPU), FlashAttention-3 style.

On a full layer most key tiles of a query block lie entirely beyond the extent E: their dQ is plain FlashAttention
dQ. This kernel does those tiles; the Triton dQ kernel (backward.dq with dq_plain) does the tiles within E, dr and
dP, and adds this kernel's dq (`dq_split`).

One CTA per (query block of 2 * n_tok tokens, KV head, batch): two compute warpgroups own 64 rows each (the GQA
group's heads x n_tok tokens, head-major as in mgpu_forward.py) and a memory warpgroup streams the K and V tiles
through `slots` buffers; S = Q K^T and dP = dO V^T read them transposed (Pallas' Mosaic GPU interpreter has no
transposed wgmma operands: under it the wrapper transposes K and V once and the kernel loads those copies too). Per
tile, P = exp2(S * coef - lse) with coef = tau * scale * log2(e) per row (the Triton kernels' base-2 logits),
dS = P * (dP - delta), and dQ accumulates dS K; tau * scale multiplies the accumulator once at the end. The two
compute warpgroups take turns on the tensor cores as in the forward. The plain tiles of a full layer need no mask.
Covered: full layers (no window, no packed segments), 16-bit inputs, groups dividing 64, head_dim a multiple of 64.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.rel_attention import backward, tiles, toeplitz
from pallas_kernels.rel_attention import mgpu_parts as parts
from pallas_kernels.rel_attention.mgpu_parts import COMPUTE_REGISTERS, ROWS, SMEM_LIMIT
from pallas_kernels.rel_attention.tiles import LOG2E, Geometry

MAX_SLOTS = 4  # K / V pipeline depth where shared memory allows
N_ROW_VECTORS = 3  # lse, delta, coef per row


def _smem_bytes(geo: Geometry, slots: int) -> int:
    dim, bk = geo.head_dim, geo.blocks.block_k
    elements = 2 * 2 * ROWS * dim + slots * 2 * bk * dim  # q and dO of both warpgroups; K and V per slot
    return 2 * elements + 2 * N_ROW_VECTORS * ROWS * 4 + 3 * 1024  # bf16 tiles, row vectors, alignment, barriers


def slots(geo: Geometry) -> int | None:
    """Key tiles in flight: the most up to MAX_SLOTS that fit in shared memory (full layer, D 128, 64 keys: 4);
    None: not even 2 fit."""
    return next((n for n in range(MAX_SLOTS, 1, -1) if _smem_bytes(geo, n) <= SMEM_LIMIT), None)


def supports(geo: Geometry, dtype) -> bool:
    """Whether this kernel covers the call: full layers without packed segments, 16-bit inputs, the forward's CTA
    shape (geo.blocks.block_q = 2 * 64 / groups tokens), block_k and head_dim multiples of 64."""
    return (geo.window is None and not geo.segmented and jnp.dtype(dtype).itemsize == 2 and ROWS % geo.groups == 0
            and geo.blocks.block_q == 2 * (ROWS // geo.groups) and geo.blocks.block_k % 64 == 0
            and geo.head_dim % 64 == 0 and slots(geo) is not None)


def faster_than_triton(geo: Geometry) -> bool:
    """Every call it covers (full layers): the split (this kernel, then the Triton dQ on the tiles with bias) is
    faster than the Triton dQ alone."""
    return True


def _plain_blocks(geo: Geometry, split: Geometry, t0):
    """Number of this kernel's key blocks (from key 0) for the CTA at token t0: the keys before the first tile
    with bias of `split`'s query block holding t0 (split.blocks.block_q a multiple of the CTA's tokens)."""
    tq = split.blocks.block_q
    near = tiles.key_block_ranges(split, split.q_offset + lax.div(t0, tq) * tq)[1]
    return near * split.blocks.block_k // geo.blocks.block_k


def _kernel(geo: Geometry, split: Geometry, n_tok: int, n_cta: int, dtype, interpret: bool,
            q_ref, do_ref, rows_ref, k_ref, v_ref, *refs):
    *transposed_refs, dq_ref, smem, barriers = refs  # K^T, V^T under the interpreter
    q_smem, do_smem, row_smem, k_smem, v_smem, *interpret_smem = smem  # + dS, K^T, V^T under the interpreter
    in_bar, loaded, free, turn = barriers
    groups, bk, n_slots = geo.groups, geo.blocks.block_k, k_smem.shape[0]
    b, g, wg = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("wg")
    cta = n_cta - 1 - lax.axis_index("q")  # most key tiles first
    tiles_ref = [k_ref, v_ref, *transposed_refs]
    tiles_smem = [k_smem, v_smem, *interpret_smem[1:]]

    def transposed(i, slot):  # K^T (i = 0) or V^T (i = 1) of a slot, as a wgmma B operand
        return tiles_smem[2 + i].at[slot] if interpret else tiles_smem[i].at[slot].transpose((1, 0))

    t0 = cta * 2 * n_tok
    n_plain = jnp.asarray(_plain_blocks(geo, split, t0), jnp.int32)

    @pl.when(wg < 2)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        tw = t0 + wg * n_tok
        for gmem, smem_ in ((q_ref, q_smem), (do_ref, do_smem)):
            parts.copy_head_major(gmem, smem_.at[wg], b, tw, g, groups, n_tok, in_bar.at[wg])
        plgpu.copy_gmem_to_smem(rows_ref.at[b, g, 2 * cta + wg], row_smem.at[wg], in_bar.at[wg])
        plgpu.barrier_wait(in_bar.at[wg])
        lse, delta, coef = (parts.row_vector(row_smem.at[wg, i], interpret) for i in range(N_ROW_VECTORS))

        def step(kb, acc):
            slot = lax.rem(kb, n_slots)
            plgpu.barrier_wait(loaded.at[slot])

            def products(s_ref, dp_ref):
                plgpu.wgmma(s_ref, q_smem.at[wg], transposed(0, slot))
                plgpu.wgmma(dp_ref, do_smem.at[wg], transposed(1, slot))
                parts.take_turn(turn)
                return s_ref[...], dp_ref[...]

            s, dp = pl.run_scoped(products, *[plgpu.ACC((ROWS, bk), jnp.float32)] * 2)
            per_row = functools.partial(lax.broadcast_in_dim, shape=s.shape, broadcast_dimensions=[0])
            p = jnp.exp2(s * per_row(coef) - per_row(lse))
            ds = (p * (dp - per_row(delta))).astype(dtype)
            acc, ds = lax.optimization_barrier((acc, ds))
            plgpu.barrier_arrive(turn)  # elementwise work done
            plgpu.barrier_wait(turn)  # the other warpgroup has issued its matmuls
            acc = parts.accumulate(acc, ds, k_smem.at[slot], interpret_smem[0].at[wg] if interpret else None)
            plgpu.barrier_arrive(free.at[slot])
            return acc

        pl.when(wg == 1)(lambda: parts.take_turn(turn))
        acc = lax.fori_loop(0, n_plain, step, mgpu.as_wgmma_tile(jnp.zeros((ROWS, geo.head_dim), jnp.float32),
                                                                    interpret))
        pl.when(wg == 0)(lambda: parts.take_turn(turn))

        q_smem.at[wg][...] = (acc * lax.broadcast_in_dim(coef * (1 / LOG2E), acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        parts.store_head_major(q_smem.at[wg], dq_ref, b, tw, g, groups, n_tok)  # dq goes out through q's tile
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(mgpu.MEMORY_REGISTERS, action="decrease")

        @pl.loop(0, n_plain)
        def _load(kb):
            slot = lax.rem(kb, n_slots)

            @pl.when(kb >= n_slots)
            def _():
                plgpu.barrier_wait(free.at[slot])

            keys = pl.ds(kb * bk, bk)
            for i, (gmem, smem_) in enumerate(zip(tiles_ref, tiles_smem)):
                tile = gmem.at[b, keys, g] if i < 2 else gmem.at[b, g, :, keys]
                plgpu.copy_gmem_to_smem(tile, smem_.at[slot], loaded.at[slot])

        parts.drain(free, 0, n_plain, n_slots)


def row_vectors(geo: Geometry, lse, delta, tau):
    """(lse, delta, coef = tau * scale * log2(e)) per row of every 64-row tile: [B, T, Hq] x 2 and [B, T] ->
    [B, Hkv, T / n_tok, 3, 64] fp32, the rows head-major like the kernel's q tile."""
    coef = jnp.broadcast_to((tau * (geo.scale * LOG2E))[:, :, None], lse.shape)
    rows = jnp.stack([lse, delta, coef], axis=-1).astype(jnp.float32)  # [B, T, Hq, 3]
    rows = parts.per_tile(rows, toeplitz.tokens_per_tile(geo.groups), lse.shape[2] // geo.groups)
    return jnp.swapaxes(rows, 3, 4)


def dq_plain(geo: Geometry, q, k, v, r, p, tau, qseg, kseg, dout, lse, delta, *, split: Geometry | None = None):
    """dq [B, T, Hq, D] in q.dtype of the key tiles before the first tile with bias (args as backward.residual_args
    returns). The tiles with bias are those of `split`'s query blocks (default geo: this kernel's own), so that
    dq_plain + the Triton dQ of split's tiles with bias is the whole dq; split.blocks.block_q must be a multiple of
    geo.blocks.block_q and split.blocks.block_k of geo.blocks.block_k."""
    del r, p, qseg, kseg
    split = geo if split is None else split
    batch, seq_q, _, dim = q.shape
    kv_heads, dtype, bk = k.shape[2], q.dtype, geo.blocks.block_k
    n_tok = toeplitz.tokens_per_tile(geo.groups)
    if not supports(geo, dtype):
        raise ValueError(f"the Mosaic GPU dQ does not cover {geo} with {dtype}")
    if split.blocks.block_q % geo.blocks.block_q or split.blocks.block_k % bk:
        raise ValueError(f"the tiles with bias of {split.blocks} do not end on this kernel's tiles {geo.blocks}")
    n_slots = slots(geo)
    rows_tile = plgpu.SMEM((2, ROWS, dim), dtype, transforms=mgpu.tile_transforms(dim, dtype))
    key_tiles = plgpu.SMEM((n_slots, bk, dim), dtype, transforms=mgpu.tile_transforms(dim, dtype))
    smem = [rows_tile, rows_tile, plgpu.SMEM((2, N_ROW_VECTORS, ROWS), jnp.float32), key_tiles, key_tiles]
    operands = [k, v]
    if geo.interpret:  # dS staged for the interpreter's wgmma (see mgpu_parts.accumulate), K^T and V^T tiles
        smem += [plgpu.SMEM((2, ROWS, bk), dtype, transforms=mgpu.tile_transforms(bk, dtype))] + [
            plgpu.SMEM((n_slots, dim, bk), dtype, transforms=mgpu.tile_transforms(bk, dtype))] * 2
        operands += [k.transpose(0, 2, 3, 1), v.transpose(0, 2, 3, 1)]
    barriers = [plgpu.Barrier(num_arrivals=2 * geo.groups + 1, num_barriers=2),  # q, dO per head; row vectors
                plgpu.Barrier(num_arrivals=len(operands), num_barriers=n_slots),  # the key tiles of a slot
                plgpu.Barrier(num_arrivals=2, num_barriers=n_slots), plgpu.Barrier(num_arrivals=2)]
    n_cta = seq_q // (2 * n_tok)
    body = functools.partial(_kernel, geo, split, n_tok, n_cta, dtype, geo.interpret)

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped[:len(smem)], scoped[len(smem):]), *smem, *barriers,
                      collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=(n_cta, kv_heads, batch), grid_names=("q", "g", "b"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu.interpret_params(geo.interpret),
    )(q, dout.astype(dtype), row_vectors(geo, lse, delta, tau), *operands)


def dq_split(geo_triton: Geometry, geo_mosaic: Geometry, *args):
    """backward.dq's contract (dq, dr fp32, gradient of the padded P fp32): this kernel for the key tiles without
    bias and the Triton dQ (geo_triton's tiles) for those with bias, dr and dP; the Triton dQ alone where this
    kernel does not apply (sliding layers, packed segments, fp32)."""
    if not supports(geo_mosaic, args[0].dtype):
        return backward.dq(geo_triton, *args)
    return backward.dq(geo_triton, *args, dq_plain=dq_plain(geo_mosaic, *args, split=geo_triton))
