"""The Mosaic GPU forward's CTA body for sliding-window layers: two warpgroups a key block apart share every Tz.

A sliding layer with a GQA group of 4 has 16 tokens per warpgroup tile, so its Tz (toeplitz.py) is [256, block_k],
twice the K tile. With one Tz per warpgroup per key tile (mgpu_forward._kernel) the CTA streams more bias operand
than K and V together, and shared memory holds only one Tz buffer per warpgroup. Here the second warpgroup's
tokens start block_k after the first's (CTA i of each 2 * block_k tokens takes tokens n_tok * i and
n_tok * i + block_k). At every step the first warpgroup meets key block kb and the second key block kb + 1, at the
same distance, so both multiply by the same Tz: one Tz stream for the CTA (half the bytes), double-buffered, as
are K and V. K/V stream entry s is key block base + s; the first warpgroup reads entry i at step i and the second
entry i + 1, so each entry's release waits for both. The two ends, read by one warpgroup only, are observed
(waited and released) by the other, so that both see every barrier phase.

Only for windows no longer than the relative extent (every visible key carries bias: there is no bias-free
tile). Every tile is masked; a step whose key block lies before the sequence (block -1 at its start, loaded as
block 0) or beyond the keys is masked entirely, which the online softmax absorbs.
"""

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.rel_attention import mgpu_parts as parts
from pallas_kernels.rel_attention import tiles, toeplitz
from pallas_kernels.rel_attention.tiles import Geometry


def applies(geo: Geometry) -> bool:
    """Sliding layers whose window lies within the relative extent."""
    return geo.window is not None and geo.window <= geo.extent


def key_stream(geo: Geometry, p0, n_tok: int):
    """(base, steps): the first warpgroup (tokens at positions p0 ...) meets key block base + i at step i, the
    second (p0 + block_k ...) block base + 1 + i, for i in [0, steps); each warpgroup's own blocks are among them."""
    bk = geo.blocks.block_k
    one_warpgroup = dataclasses.replace(geo, blocks=dataclasses.replace(geo.blocks, block_q=n_tok))
    (lo0, _, _, end0), (lo1, _, _, end1) = (tiles.key_block_ranges(one_warpgroup, p) for p in (p0, p0 + bk))
    base = jnp.minimum(lo0, lo1 - 1)
    return base, jnp.maximum(end0 - base, end1 - 1 - base)


def kernel(geo: Geometry, n_tok: int, n_off: int, n_cta: int, dtype, interpret: bool, q_ref, k_ref, v_ref,
           a_ref, tz_ref, c_ref, o_ref, lse_ref, smem, barriers):
    del n_cta  # every CTA of a sliding layer meets the same number of key blocks
    q_smem, a_smem, k_smem, v_smem, tz_smem, lse_smem, c_smem, *p_smem = smem
    q_bar, a_bar, k_bar, v_bar, tz_bar, k_free, v_free, tz_free, turn = barriers
    groups, bk, n_k, n_tz, n_v = geo.groups, geo.blocks.block_k, k_smem.shape[0], tz_smem.shape[0], v_smem.shape[0]
    b, g, wg = lax.axis_index("b"), lax.axis_index("g"), lax.axis_index("wg")
    per_chunk = bk // n_tok  # CTAs per 2 * block_k tokens
    cta = lax.axis_index("q")
    t0 = lax.div(cta, per_chunk) * 2 * bk + lax.rem(cta, per_chunk) * n_tok
    p0 = geo.q_offset + t0
    base, steps = key_stream(geo, p0, n_tok)
    first_off = toeplitz.first_offset(geo.q_offset, n_tok)

    def observe(ready, free, entry, slots):
        slot = lax.rem(entry, slots)
        plgpu.barrier_wait(ready.at[slot])
        plgpu.barrier_arrive(free.at[slot])

    @pl.when(wg < 2)
    def _compute():
        tw = t0 + wg * bk
        c = parts.load_query_tile((q_ref, a_ref, c_ref), (q_smem.at[wg], a_smem.at[wg], c_smem.at[wg]),
                                  (q_bar.at[wg], a_bar.at[wg]), b, g, tw, groups, n_tok, interpret)

        @pl.when(wg == 1)
        def _():  # entry 0 is the first warpgroup's alone
            observe(k_bar, k_free, 0, n_k)
            observe(v_bar, v_free, 0, n_v)

        def step(i, carry):
            entry = i + wg
            slot, v_slot, tz_slot = lax.rem(entry, n_k), lax.rem(entry, n_v), lax.rem(i, n_tz)
            kb = base + entry

            # block -1 (before the sequence) is masked whole: any offset below -n_tok puts every key in the future
            offset = jnp.where(kb >= 0, geo.q_offset + tw - kb * bk, -2 * bk)
            mask = functools.partial(parts.window_mask, geo, offset, interpret)
            return parts.attend(carry, q_smem.at[wg], k_smem.at[slot], v_smem.at[v_slot], c,
                                [k_bar.at[slot], tz_bar.at[tz_slot]], [k_free.at[slot], tz_free.at[tz_slot]],
                                v_bar.at[v_slot], v_free.at[v_slot], turn, mask, dtype,
                                bias=(a_smem.at[wg], tz_smem.at[tz_slot, 0]),
                                stage=p_smem[0].at[wg] if interpret else None)

        take_turn = functools.partial(parts.take_turn, turn)  # one's matmuls against the other's softmax
        pl.when(wg == 1)(take_turn)
        acc, m, l = lax.fori_loop(0, steps, step, parts.initial_carry(geo, interpret))
        pl.when(wg == 0)(take_turn)

        @pl.when(wg == 0)
        def _():  # the last entry is the second warpgroup's alone
            observe(k_bar, k_free, steps, n_k)
            observe(v_bar, v_free, steps, n_v)

        parts.store(acc, m, l, q_smem.at[wg], lse_smem.at[wg], o_ref, lse_ref, b, tw, g, groups, n_tok)

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(mgpu.MEMORY_REGISTERS, action="decrease")
        last_block = geo.seq_k // bk - 1

        @pl.loop(0, steps + 1)
        def _load(entry):
            slot, v_slot = lax.rem(entry, n_k), lax.rem(entry, n_v)
            kb = jnp.clip(base + entry, 0, last_block)  # blocks outside the keys: masked, any block will do

            @pl.when(entry >= n_k)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[b, g, :, pl.ds(kb * bk, bk)], k_smem.at[slot], k_bar.at[slot])

            @pl.when(entry < steps)
            def _bias():
                tz_slot = lax.rem(entry, n_tz)

                @pl.when(entry >= n_tz)
                def _():
                    plgpu.barrier_wait(tz_free.at[tz_slot])

                off = jnp.clip(lax.div(p0 - (base + entry) * bk - first_off, n_tok), 0, n_off - 1)
                plgpu.copy_gmem_to_smem(tz_ref.at[off], tz_smem.at[tz_slot, 0], tz_bar.at[tz_slot])

            @pl.when(entry >= n_v)
            def _():
                plgpu.barrier_wait(v_free.at[v_slot])

            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kb * bk, bk), g], v_smem.at[v_slot], v_bar.at[v_slot])

        parts.drain(k_free, 0, steps + 1, n_k)
        parts.drain(v_free, 0, steps + 1, n_v)
        parts.drain(tz_free, 0, steps, n_tz)
