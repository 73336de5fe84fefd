"""dK/dV backward on Hopper tensor cores (Pallas Mosaic GPU), FlashAttention-3 style, same contract as backward.dkdv.

One CTA per (key block of 2 x 64 keys, KV head, batch): two compute warpgroups own 64 keys each (their K, V tiles and
dK, dV accumulators stay resident) and a memory warpgroup streams the query tiles that see the block (double-
buffered): q' (q * tau * scale * log2(e), laid out per tile in the wrapper), dO, the tile's lse and delta, and on
tiles that carry relative bias the tile's A and each warpgroup's Tz^T (toeplitz.py). Tiles are keys-major, so that
P^T and dS^T come out of the products as the left operands of the next ones:

    S^T = K q'^T (+ Tz^T A^T)    P^T = exp2(S^T - lse)    dP^T = V dO^T    dS^T = P^T * (dP^T - delta)
    dV += P^T dO                 dK += dS^T q'            (dK = ln 2 * that at the end: q' carries log2(e))

A query tile is 64 rows = the GQA group's heads x 64 / groups tokens, head-major as in mgpu_forward. Query tiles
that cannot see the block are never loaded; the tiles that cross the diagonal are masked (every tile on sliding
layers). Not covered (backward.dkdv runs): packed segments, fp32, groups that do not divide 64, head_dim other than
64 or 128 (two fp32 accumulators of 64 x head_dim per thread group), tiles that exceed shared memory.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.rel_attention import tiles, toeplitz
from pallas_kernels.rel_attention import mgpu_parts as parts
from pallas_kernels.rel_attention.tiles import LOG2E, NEG, Blocks, Geometry

ROWS, SMEM_LIMIT, COMPUTE_REGISTERS = parts.ROWS, parts.SMEM_LIMIT, parts.COMPUTE_REGISTERS
KEYS = 2 * ROWS  # keys of a CTA: each compute warpgroup owns ROWS keys (a query tile has ROWS rows)


def tile(groups: int) -> Blocks:
    """The Geometry blocks of this kernel: query tiles of 64 rows (64 / groups tokens), key blocks of 128."""
    return Blocks(block_q=toeplitz.tokens_per_tile(groups), block_k=KEYS, mosaic=True)


def supports(geo: Geometry, dtype) -> bool:
    """Whether this kernel covers the call (else backward.dkdv runs)."""
    return (not geo.segmented and jnp.dtype(dtype).itemsize == 2 and ROWS % geo.groups == 0
            and geo.blocks == tile(geo.groups) and geo.head_dim in (64, 128) and buffers(geo) is not None)


def _smem_bytes(geo: Geometry, tile_slots: int, bias_slots: int) -> int:
    dim, bias_k = geo.head_dim, toeplitz.tokens_per_tile(geo.groups) * geo.d_rel
    elements = 2 * KEYS * dim + tile_slots * 2 * ROWS * dim + bias_slots * 3 * ROWS * bias_k
    return 2 * elements + tile_slots * 2 * ROWS * 4 + 1024  # bf16 tiles, lse and delta, barriers


def buffers(geo: Geometry) -> tuple[int, int] | None:
    """(query tile buffers, bias buffers): double where shared memory allows (full layers at d_rel 16: 226 KB of
    227); the sliding layer (16 tokens per tile: A and the two Tz^T are 96 KB) fits with one bias buffer."""
    return next((b for b in ((2, 2), (2, 1), (1, 1)) if _smem_bytes(geo, *b) <= SMEM_LIMIT), None)


def faster_than_triton(geo: Geometry) -> bool:
    """Where the bias tiles are double-buffered (full layers); single-buffered (the sliding layer) it was slower
    than the Triton kernel."""
    return buffers(geo) == (2, 2)


def _probs_and_dp(interpret: bool, s_terms, dp_term, probs):
    """(probs(S^T), dP^T) for S^T = the sum of a @ b^T over its (a, b) SMEM pairs and dP^T = a @ b^T of dp_term:
    all products issued at once, and probs runs while dP^T's is still in flight. The interpreter of jax 0.10.2
    has no transposed wgmma operands: there the products are dots of the SMEM contents."""
    if interpret:
        s = sum(tiles.dot_t(a[...], b[...]) for a, b in s_terms)
        return probs(s), tiles.dot_t(dp_term[0][...], dp_term[1][...])

    def issue(s_ref, dp_ref):
        for a, b in s_terms:
            plgpu.wgmma(s_ref, a, b.transpose((1, 0)))
        plgpu.wgmma(dp_ref, dp_term[0], dp_term[1].transpose((1, 0)))
        p = probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))  # every wgmma but dP^T's has finished
        return p, dp_ref[...]

    return pl.run_scoped(issue, *[plgpu.ACC((ROWS, ROWS), jnp.float32)] * 2)


def _accumulate(dk, dv, p, dscore, q_smem, do_smem, staged):
    """(dk + dscore() @ q, dv + p @ do), p and dscore() 16-bit, from registers: dscore runs while p @ do is in
    flight. Under the interpreter (`staged` given) they go one by one through SMEM (see mgpu_parts.accumulate)."""
    if staged is not None:
        dv = parts.accumulate(dv, p, do_smem, staged)
        return parts.accumulate(dk, dscore(), q_smem, staged), dv

    def issue(acc_refs):
        dk_ref, dv_ref = acc_refs
        plgpu.wgmma(dv_ref, p, do_smem)
        plgpu.wgmma(dk_ref, dscore(), q_smem)

    return pl.run_state(issue)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))


def _kernel(geo: Geometry, n_off: int, dtype, interpret: bool, q_ref, k_ref, v_ref, do_ref, ld_ref, a_ref, tz_ref,
            dk_ref, dv_ref, smem, barriers):
    k_smem, v_smem, q_smem, do_smem, ld_smem, a_smem, tz_smem, *stage = smem
    kv_bar, tile_bar, tile_free, bias_bar, bias_free = barriers
    groups, n_tok = geo.groups, geo.blocks.block_q
    n_slots, n_bias = q_smem.shape[0], a_smem.shape[0]
    b, g, wg = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("wg")
    k0 = lax.axis_index("k") * KEYS  # early keys are seen by the most queries: they go first
    lo, diag, near, end = (jnp.asarray(x, jnp.int32) for x in tiles.query_block_ranges(geo, k0))

    @pl.when(wg < 2)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        kw = k0 + wg * ROWS
        plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(kw, ROWS), g], k_smem.at[wg], kv_bar.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kw, ROWS), g], v_smem.at[wg], kv_bar.at[wg])
        plgpu.barrier_wait(kv_bar.at[wg])

        def loop(start, stop, bias, mask, carry):
            def step(i, carry):
                dk, dv = carry
                slot, bias_slot = lax.rem(i - lo, n_slots), lax.rem(i - lo, n_bias)
                plgpu.barrier_wait(tile_bar.at[slot])
                if bias:
                    plgpu.barrier_wait(bias_bar.at[bias_slot])

                s_terms = [(k_smem.at[wg], q_smem.at[slot])]
                if bias:
                    s_terms.append((tz_smem.at[bias_slot, wg], a_smem.at[bias_slot]))

                def probs(s):
                    if mask:  # rows are keys, columns query rows (head-major: token = column % n_tok)
                        token = lax.rem(parts.iota(1, ROWS, interpret), n_tok)
                        dist = geo.q_offset + i * n_tok + token - kw - parts.iota(0, ROWS, interpret)
                        s = jnp.where(tiles.in_view(geo, dist), s, NEG)
                    lse = parts.column_vector(ld_smem.at[slot, 0], interpret)
                    return jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [1]))

                p, dp = _probs_and_dp(interpret, s_terms, (v_smem.at[wg], do_smem.at[slot]), probs)
                if bias:
                    plgpu.barrier_arrive(bias_free.at[bias_slot])
                delta = lax.broadcast_in_dim(parts.column_vector(ld_smem.at[slot, 1], interpret), dp.shape, [1])
                dk, dv = _accumulate(dk, dv, p.astype(dtype), lambda: (p * (dp - delta)).astype(dtype),
                                     q_smem.at[slot], do_smem.at[slot], stage[0].at[wg] if interpret else None)
                plgpu.barrier_arrive(tile_free.at[slot])
                return dk, dv

            return lax.fori_loop(start, stop, step, carry)

        zeros = mgpu.as_wgmma_tile(jnp.zeros((ROWS, geo.head_dim), jnp.float32), interpret)
        carry = loop(lo, diag, True, True, (zeros, zeros))
        carry = loop(diag, near, True, geo.masked, carry)
        dk, dv = loop(near, end, False, geo.masked, carry)

        k_smem.at[wg][...] = (dk * (1.0 / LOG2E)).astype(dtype)
        v_smem.at[wg][...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[b, pl.ds(kw, ROWS), g])
        plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[b, pl.ds(kw, ROWS), g])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(mgpu.MEMORY_REGISTERS, action="decrease")
        first_off = toeplitz.first_offset(geo.q_offset, n_tok)

        @pl.loop(lo, end)
        def _load(i):
            step = i - lo
            slot = lax.rem(step, n_slots)

            @pl.when(step >= n_slots)
            def _():
                plgpu.barrier_wait(tile_free.at[slot])

            plgpu.copy_gmem_to_smem(q_ref.at[b, g, i], q_smem.at[slot], tile_bar.at[slot])
            parts.copy_head_major(do_ref, do_smem.at[slot], b, i * n_tok, g, groups, n_tok, tile_bar.at[slot])
            plgpu.copy_gmem_to_smem(ld_ref.at[b, g, i], ld_smem.at[slot], tile_bar.at[slot])

            @pl.when(i < near)  # the tiles that carry bias are [lo, near)
            def _bias():
                bias_slot = lax.rem(step, n_bias)

                @pl.when(step >= n_bias)
                def _():
                    plgpu.barrier_wait(bias_free.at[bias_slot])

                plgpu.copy_gmem_to_smem(a_ref.at[b, g, i], a_smem.at[bias_slot], bias_bar.at[bias_slot])
                for w in range(2):
                    off = lax.div(geo.q_offset + i * n_tok - k0 - w * ROWS - first_off, n_tok)
                    # past the table's ends a tile is all beyond E (the last Tz is zero) or all in the future (masked)
                    plgpu.copy_gmem_to_smem(tz_ref.at[jnp.clip(off, 0, n_off - 1)], tz_smem.at[bias_slot, w],
                                            bias_bar.at[bias_slot])

        parts.drain(tile_free, lo, end, n_slots)
        parts.drain(bias_free, lo, near, n_bias)


def dkdv(geo: Geometry, q, k, v, r, p, tau, qseg, kseg, dout, lse, delta):
    """(dk, dv) in k.dtype; the operands of backward.dkdv (backward.residual_args); qseg and kseg are ignored
    (no packed segments here)."""
    del qseg, kseg
    kv_heads, dim, dtype, n_tok = k.shape[2], q.shape[3], q.dtype, geo.blocks.block_q
    if not supports(geo, dtype):
        raise ValueError(f"the Mosaic GPU dK/dV kernel does not cover {geo} with {dtype}")
    n_slots, n_bias = buffers(geo)
    rel_proj = p[:, geo.rel_left:geo.rel_left + geo.extent]
    # q' in one fused pass with the per-tile regrouping.
    q_scaled = (q.astype(jnp.float32) * (tau * (geo.scale * LOG2E))[:, :, None, None]).astype(dtype)
    lse_delta = jnp.stack([parts.per_tile(x, n_tok, kv_heads) for x in (lse, delta)], axis=3)  # [B, Hkv, T/n, 2, 64]
    a = toeplitz.block_diagonal_r(r, tau * LOG2E, n_tok, kv_heads)
    tz_t = toeplitz.offset_table(rel_proj, q_offset=geo.q_offset, n_tok=n_tok, block_k=ROWS,
                                 dtype=dtype).transpose(0, 2, 1)  # [offsets, 64 keys, n_tok * d_rel]
    bias_k = a.shape[-1]
    dim_tiles, bias_tiles = mgpu.tile_transforms(dim, dtype), mgpu.tile_transforms(bias_k, dtype)
    smem = [plgpu.SMEM((2, ROWS, dim), dtype, transforms=dim_tiles),
            plgpu.SMEM((2, ROWS, dim), dtype, transforms=dim_tiles),
            plgpu.SMEM((n_slots, ROWS, dim), dtype, transforms=dim_tiles),
            plgpu.SMEM((n_slots, ROWS, dim), dtype, transforms=dim_tiles),
            plgpu.SMEM((n_slots, 2, ROWS), jnp.float32),
            plgpu.SMEM((n_bias, ROWS, bias_k), dtype, transforms=bias_tiles),
            plgpu.SMEM((n_bias, 2, ROWS, bias_k), dtype, transforms=bias_tiles)]
    if geo.interpret:  # P^T and dS^T staged for the interpreter's wgmma (see mgpu_parts.accumulate)
        smem.append(plgpu.SMEM((2, ROWS, ROWS), dtype, transforms=mgpu.tile_transforms(ROWS, dtype)))
    barriers = [plgpu.Barrier(num_arrivals=2, num_barriers=2),
                plgpu.Barrier(num_arrivals=geo.groups + 2, num_barriers=n_slots),
                plgpu.Barrier(num_arrivals=2, num_barriers=n_slots),
                plgpu.Barrier(num_arrivals=3, num_barriers=n_bias),
                plgpu.Barrier(num_arrivals=2, num_barriers=n_bias)]
    body = functools.partial(_kernel, geo, tz_t.shape[0], dtype, geo.interpret)

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped[:len(smem)], scoped[len(smem):]), *smem, *barriers,
                      collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(k.shape[1] // KEYS, kv_heads, k.shape[0]), grid_names=("k", "g", "b"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu.interpret_params(geo.interpret),
    )(parts.per_tile(q_scaled, n_tok, kv_heads), k, v, dout, lse_delta, a, tz_t)
