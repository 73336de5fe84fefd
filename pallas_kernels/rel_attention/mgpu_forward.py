"""Forward kernel on Hopper tensor cores (Pallas Mosaic GPU), FlashAttention-3 style, same contract as forward.py.

One CTA per (query block of 2 * n_tok tokens, KV head, batch): two compute warpgroups own 64 rows each (the GQA
group's heads x n_tok tokens, head-major) and a memory warpgroup streams the K/V tiles (double-buffered) and, on
tiles that carry relative bias, each compute warpgroup's Tz (toeplitz.py). Per key tile the logits are
c * (q @ K^T + A @ Tz), the two products in one wgmma accumulator, with A built from r / scale and the per-row
factor c = tau * scale * log2(e) applied to the tile in registers (no pass over q in the wrapper); the online
softmax runs in base 2. The compute warpgroups take turns on the tensor cores (a shared barrier
orders one's matmuls against the other's softmax). Key blocks past the diagonal, and outside the window on
sliding layers, are never loaded; only diagonal tiles (every tile on sliding layers) are masked. On sliding layers
whose window lies within the relative extent the CTA body is mgpu_window.py's: its warpgroups' tokens lie a key
block apart, so that they share one Tz stream.
Not covered (kernel.py keeps the Triton forward for them): packed segments, fp32, groups that do not divide 64,
head_dim not a multiple of 64 (Mosaic finds no layouts at 32), and layers whose tiles exceed shared memory even
with single Tz and V buffers (`buffers`).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.rel_attention import mgpu_parts as parts
from pallas_kernels.rel_attention import mgpu_window, tiles, toeplitz
from pallas_kernels.rel_attention.tiles import LOG2E, Geometry

ROWS, SMEM_LIMIT = parts.ROWS, parts.SMEM_LIMIT
# K pipeline depth (V's is 2 where shared memory allows, else 1: see `buffers`); deeper K or V pipelines were
# slower.
K_SLOTS = 2


def supports(geo: Geometry, dtype) -> bool:
    """Whether this kernel covers the call (else the Triton forward runs)."""
    return (not geo.segmented and jnp.dtype(dtype).itemsize == 2 and ROWS % geo.groups == 0
            and geo.blocks.block_q == 2 * (ROWS // geo.groups) and geo.blocks.block_k % 64 == 0
            and geo.head_dim % 64 == 0 and buffers(geo) is not None)


def _smem_bytes(geo: Geometry, tz_slots: int, v_slots: int) -> int:
    bk, dim, bias_k = geo.blocks.block_k, geo.head_dim, toeplitz.tokens_per_tile(geo.groups) * geo.d_rel
    elements = (2 * ROWS * (dim + bias_k) + (K_SLOTS + v_slots) * bk * dim
                + tz_slots * _tz_per_slot(geo) * bias_k * bk)
    return 2 * elements + 3 * 1024  # bf16 tiles; the lse and c rows, 1 KB-aligned each; barriers


def _tz_per_slot(geo: Geometry) -> int:
    """Tz tiles per buffer: one shared by the two warpgroups (mgpu_window.py), or one each."""
    return 1 if mgpu_window.applies(geo) else 2


def faster_than_triton(geo: Geometry) -> bool:
    """Where Tz and V are double-buffered (full layers; sliding layers through mgpu_window.py's shared Tz);
    single-buffered it was slower than the Triton forward."""
    return buffers(geo) == (2, 2)


def buffers(geo: Geometry) -> tuple[int, int] | None:
    """(Tz buffers, V buffers): double where shared memory allows. None: no fit."""
    return next((b for b in ((2, 2), (1, 2), (1, 1)) if _smem_bytes(geo, *b) <= SMEM_LIMIT), None)


def _kernel(geo: Geometry, n_tok: int, n_off: int, n_cta: int, dtype, interpret: bool, q_ref, k_ref, v_ref,
            a_ref, tz_ref, c_ref, o_ref, lse_ref, smem, barriers):
    q_smem, a_smem, k_smem, v_smem, tz_smem, lse_smem, c_smem, *p_smem = smem
    q_bar, a_bar, k_bar, v_bar, tz_bar, k_free, v_free, tz_free, turn = barriers
    groups, bk, n_tz, n_v = geo.groups, geo.blocks.block_k, tz_smem.shape[0], v_smem.shape[0]
    b, g, wg = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("wg")
    cta = n_cta - 1 - lax.axis_index("q")  # longest causal rows first
    t0 = cta * 2 * n_tok
    p0 = geo.q_offset + t0
    lo, near, diag, end = (jnp.asarray(x, jnp.int32) for x in tiles.key_block_ranges(geo, p0))
    first_off = toeplitz.first_offset(geo.q_offset, n_tok)

    take_turn = functools.partial(parts.take_turn, turn)  # one warpgroup's matmuls against the other's softmax

    @pl.when(wg < 2)
    def _compute():
        tw = t0 + wg * n_tok
        c = parts.load_query_tile((q_ref, a_ref, c_ref), (q_smem.at[wg], a_smem.at[wg], c_smem.at[wg]),
                                  (q_bar.at[wg], a_bar.at[wg]), b, g, tw, groups, n_tok, interpret)

        def loop(start, stop, bias, masked, carry):
            def step(kb, carry):
                slot, v_slot = lax.rem(kb - lo, K_SLOTS), lax.rem(kb - lo, n_v)
                tz_slot = lax.rem(kb - near, n_tz) * 2 + wg
                offset = geo.q_offset + tw - kb * bk
                mask = functools.partial(parts.window_mask, geo, offset, interpret) if masked else None
                ready, consumed = [k_bar.at[slot]], [k_free.at[slot]]
                if bias:
                    ready.append(tz_bar.at[tz_slot])
                    consumed.append(tz_free.at[tz_slot])
                return parts.attend(carry, q_smem.at[wg], k_smem.at[slot], v_smem.at[v_slot], c, ready, consumed,
                                    v_bar.at[v_slot], v_free.at[v_slot], turn, mask, dtype,
                                    bias=(a_smem.at[wg], tz_smem.at[lax.div(tz_slot, 2), wg]) if bias else None,
                                    stage=p_smem[0].at[wg] if interpret else None)

            return lax.fori_loop(start, stop, step, carry)

        carry = parts.initial_carry(geo, interpret)
        pl.when(wg == 1)(take_turn)
        masked = geo.window is not None
        carry = loop(lo, near, False, masked, carry)
        carry = loop(near, diag, True, masked, carry)
        acc, m, l = loop(diag, end, True, True, carry)
        pl.when(wg == 0)(take_turn)

        parts.store(acc, m, l, q_smem.at[wg], lse_smem.at[wg], o_ref, lse_ref, b, tw, g, groups, n_tok)

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(mgpu.MEMORY_REGISTERS, action="decrease")

        @pl.loop(lo, end)
        def _load(kb):
            step = kb - lo
            slot, v_slot = lax.rem(step, K_SLOTS), lax.rem(step, n_v)

            @pl.when(step >= K_SLOTS)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[b, g, :, pl.ds(kb * bk, bk)], k_smem.at[slot], k_bar.at[slot])

            @pl.when(kb >= near)
            def _bias():
                j = kb - near
                for w in range(2):
                    tz_slot = lax.rem(j, n_tz) * 2 + w

                    @pl.when(j >= n_tz)
                    def _(tz_slot=tz_slot):
                        plgpu.barrier_wait(tz_free.at[tz_slot])

                    off = jnp.clip(lax.div(p0 + w * n_tok - kb * bk - first_off, n_tok), 0, n_off - 1)
                    plgpu.copy_gmem_to_smem(tz_ref.at[off], tz_smem.at[lax.div(tz_slot, 2), w], tz_bar.at[tz_slot])

            @pl.when(step >= n_v)
            def _():
                plgpu.barrier_wait(v_free.at[v_slot])

            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kb * bk, bk), g], v_smem.at[v_slot], v_bar.at[v_slot])

        parts.drain(k_free, lo, end, K_SLOTS)
        parts.drain(v_free, lo, end, n_v)
        parts.drain(tz_free, near, end, n_tz, per_slot=2)


def forward(geo: Geometry, q, k, v, r, p, tau, qseg, kseg):
    """Same operands and results as forward.forward (geo.blocks.block_q = 2 * n_tok tokens per CTA); qseg and
    kseg are ignored (no packed segments here)."""
    del qseg, kseg
    batch, seq_q, heads, dim = q.shape
    kv_heads, dtype, bk = k.shape[2], q.dtype, geo.blocks.block_k
    n_tok = toeplitz.tokens_per_tile(geo.groups)
    if not supports(geo, dtype):
        raise ValueError(f"the Mosaic GPU forward does not cover {geo} with {dtype}")
    n_tz, n_v = buffers(geo)
    paired = mgpu_window.applies(geo)
    if paired and seq_q % (2 * bk):  # a CTA's two warpgroups take tokens block_k apart in chunks of 2 * block_k
        pad = 2 * bk - seq_q % (2 * bk)
        q, r, tau = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
                     for x, fill in ((q, 0), (r, 0), (tau, 1)))
        out, lse = forward(geo, q, k, v, r, p, tau, None, None)
        return out[:, :seq_q], lse[:, :seq_q]
    tz_per_slot = _tz_per_slot(geo)
    rel_proj = p[:, geo.rel_left:geo.rel_left + geo.extent]
    # A from r / scale; the row factor c, rows head-major as in a tile: [B, T / n_tok, 64].
    a = toeplitz.block_diagonal_r(r, 1.0 / geo.scale, n_tok, kv_heads)
    c = jnp.tile((tau * (geo.scale * LOG2E)).reshape(batch, seq_q // n_tok, 1, n_tok), (1, 1, geo.groups, 1))
    c = c.reshape(batch, seq_q // n_tok, ROWS)
    tz = toeplitz.offset_table(rel_proj, q_offset=geo.q_offset, n_tok=n_tok, block_k=bk, dtype=dtype)
    bias_k = a.shape[-1]
    smem = [plgpu.SMEM((2, ROWS, dim), dtype, transforms=mgpu.tile_transforms(dim, dtype)),
            plgpu.SMEM((2, ROWS, bias_k), dtype, transforms=mgpu.tile_transforms(bias_k, dtype)),
            plgpu.SMEM((K_SLOTS, dim, bk), dtype, transforms=mgpu.tile_transforms(bk, dtype)),
            plgpu.SMEM((n_v, bk, dim), dtype, transforms=mgpu.tile_transforms(dim, dtype)),
            plgpu.SMEM((n_tz, tz_per_slot, bias_k, bk), dtype, transforms=mgpu.tile_transforms(bk, dtype)),
            plgpu.SMEM((2, ROWS), jnp.float32), plgpu.SMEM((2, ROWS), jnp.float32)]
    if geo.interpret:  # probabilities staged for the interpreter's wgmma (see mgpu_parts.accumulate)
        smem.append(plgpu.SMEM((2, ROWS, bk), dtype, transforms=mgpu.tile_transforms(bk, dtype)))
    barriers = [plgpu.Barrier(num_arrivals=geo.groups, num_barriers=2),
                plgpu.Barrier(num_arrivals=2, num_barriers=2),
                plgpu.Barrier(num_barriers=K_SLOTS), plgpu.Barrier(num_barriers=n_v),
                plgpu.Barrier(num_barriers=tz_per_slot * n_tz),
                plgpu.Barrier(num_arrivals=2, num_barriers=K_SLOTS),
                plgpu.Barrier(num_arrivals=2, num_barriers=n_v),
                plgpu.Barrier(num_arrivals=2 if paired else 1, num_barriers=tz_per_slot * n_tz),
                plgpu.Barrier(num_arrivals=2)]
    body = functools.partial(mgpu_window.kernel if paired else _kernel, geo, n_tok, tz.shape[0],
                             seq_q // (2 * n_tok), dtype, geo.interpret)

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped[:len(smem)], scoped[len(smem):]), *smem, *barriers,
                      collective_axes="wg")

    out, lse = plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype),
                  jax.ShapeDtypeStruct((batch, kv_heads, seq_q // n_tok, ROWS), jnp.float32)],
        grid=(seq_q // (2 * n_tok), kv_heads, batch), grid_names=("q", "g", "b"),
        num_threads=3, thread_name="wg",
        # Row maxima and sums stay within a warp in the WGMMA layout: no SMEM scratch for cross-warp reductions
        # (the default reserves 2 KB, which the sliding layer's double-buffered tiles need).
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=mgpu.interpret_params(geo.interpret),
    )(q, k.transpose(0, 2, 3, 1), v, a, tz, c)  # K^T tiles [D, block_k]: wgmma's B operand as stored
    # lse rows are (kv head, query tile, head in group, token) -> [B, T, Hq], the Triton forward's layout
    lse = lse.reshape(batch, kv_heads, seq_q // n_tok, geo.groups, n_tok).transpose(0, 2, 4, 1, 3)
    return out, lse.reshape(batch, seq_q, heads)
