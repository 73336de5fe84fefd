"""NVFP4 routed experts (nvfp4.py, kernel_w4.py, w4_codes.py): the layout and quantiser against
inkling_jax/checkpoint/nvfp4.py's, a checkpoint's packed tensors in the kernel layout, and the W4A16 kernels against
their jnp formula in the slab layouts. On CPU the Mosaic GPU kernels run in Pallas' GPU interpreter; on a GPU compiled.
Shapes: 3 output-row tiles and 3+ k steps, an empty group, a group spread over several slabs, rows past
sum(group_sizes), an expert width that needs padding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.checkpoint import nvfp4 as checkpoint_format
from pallas_kernels._common import interpret_default
from pallas_kernels.moe import epilogues
from pallas_kernels.moe.kernel_w4 import W4Config, config_for, k_splits_to_fill, w4_gmm
from pallas_kernels.moe.nvfp4 import (
    PREFILL_SLAB,
    dequantize,
    from_checkpoint,
    layout,
    moe_ffn_nvfp4,
    moe_ffn_nvfp4_reference,
    quantize_experts,
    quantize_matrices,
    slab_tokens,
)
from pallas_kernels.moe.test_fp8 import operands
from pallas_kernels.moe.test_moe import normal, rel_err
from pallas_kernels.moe.w4_codes import f16_planes, from_units, pack_codes, to_units, unpack_codes

WIDTH = 300  # pads to 384; it and HIDDEN (384): 3 tiles of 128 output rows and 6 k steps of 64 each
CFG = W4Config(block_k=64, stages=2)


def test_f16_planes_give_every_pair_of_e2m1_values_over_64():
    low, high = (a.reshape(-1).astype(np.uint8) for a in np.meshgrid(np.arange(16), np.arange(16)))
    packed = pack_codes(low, high)
    assert len(set(packed.tolist())) == 256
    np.testing.assert_array_equal(np.stack(unpack_codes(packed)), np.stack([low, high]))
    got_low, got_high = (np.asarray(p, np.float32) for p in f16_planes(jnp.asarray(packed)))
    table = np.concatenate([checkpoint_format.E2M1_VALUES, -checkpoint_format.E2M1_VALUES])
    np.testing.assert_array_equal(got_low * 64, table[low])
    np.testing.assert_array_equal(got_high * 64, table[high])
    np.testing.assert_array_equal(np.signbit(got_high), high >= 8)  # -0 included


def test_units_put_each_threads_wgmma_bytes_together():
    """Thread 32 w + 4 i + j holds rows 16 w + i and + 8, columns 2 j, 2 j + 1 of each 8-column half of a
    [64, 16] piece in the WGMMA layout; to_units must place those 8 bytes at 8 x its index of the piece's unit."""
    packed = np.random.default_rng(3).integers(0, 256, (2, 128, 48)).astype(np.uint8)
    units = to_units(packed)
    assert units.shape == (2, 2, 3, 8, 128)
    np.testing.assert_array_equal(from_units(units), packed)
    np.testing.assert_array_equal(np.asarray(to_units(jnp.asarray(packed))), units)
    for group, piece in ((0, 0), (1, 2)):
        unit = units[1, group, piece].reshape(-1)
        for thread in range(128):
            warp, lane = divmod(thread, 32)
            r, c = 64 * group + 16 * warp + lane // 4, 16 * piece + 2 * (lane % 4)
            want = [packed[1, row, c + 8 * half + b] for half in range(2) for row in (r, r + 8) for b in range(2)]
            np.testing.assert_array_equal(unit[8 * thread:8 * thread + 8], want)


def test_quantiser_and_layout_match_the_checkpoint_format():
    w = np.array(normal(jax.random.key(1), (3, 2, 128, 64), jnp.float32))
    w[1] = 0.0  # an all-zero expert
    codes, scale, scale2 = quantize_matrices(jnp.asarray(w))
    packed_ref, scale_ref, scale2_ref = checkpoint_format.quantize(w.reshape(3, 256, 64))
    np.testing.assert_allclose(np.asarray(scale2), scale2_ref, rtol=2e-7)  # XLA may divide by a reciprocal
    np.testing.assert_array_equal(np.asarray(scale, np.float32).reshape(3, 256, 4), scale_ref.astype(np.float32))
    np.testing.assert_array_equal(checkpoint_format.pack(np.asarray(codes).reshape(3, 256, 64)), packed_ref)
    packed, scales = layout(codes, scale)
    want = checkpoint_format.dequantize(packed_ref, scale_ref, scale2_ref).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(dequantize(packed, scales, scale2, 2)), want, rtol=2e-7)


def test_a_dequantised_checkpoint_quantises_back_to_its_values():
    """The loader dequantises an NVFP4 checkpoint's experts as it reads them; quantising those again must give
    the same weights (codes may differ only in the sign of zero)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 128, 96)) * np.exp(rng.standard_normal((3, 128, 1)))).astype(np.float32)
    values = checkpoint_format.dequantize(*checkpoint_format.quantize(w))
    codes, scale, scale2 = quantize_matrices(jnp.asarray(values)[:, None])
    again = dequantize(*layout(codes, scale), scale2, 1)[:, 0]
    np.testing.assert_array_equal(np.asarray(again), values)


def test_checkpoint_tensors_take_the_kernel_layout_with_their_own_values():
    """An NVFP4 checkpoint's w13 (gate/up rows interleaved) and w2, packed, in the kernel layout without
    requantising: the same values, the width (80) padded with zeros to 128."""
    rng = np.random.default_rng(2)
    w13, w2 = rng.standard_normal((3, 160, 128)), rng.standard_normal((3, 128, 80))
    stored13, stored2 = checkpoint_format.quantize(w13), checkpoint_format.quantize(w2)
    got13 = np.asarray(dequantize(*from_checkpoint(*stored13, gate_up=True), 2))
    got2 = np.asarray(dequantize(*from_checkpoint(*stored2, gate_up=False), 1))[:, 0]
    want13, want2 = checkpoint_format.dequantize(*stored13), checkpoint_format.dequantize(*stored2)
    np.testing.assert_array_equal(got13[:, 0, :80], want13[:, 0::2])
    np.testing.assert_array_equal(got13[:, 1, :80], want13[:, 1::2])
    np.testing.assert_array_equal(got2[:, :, :80], want2)
    assert not got13[:, :, 80:].any() and not got2[:, :, 80:].any()
    np.testing.assert_array_equal(from_checkpoint(*stored2, gate_up=False)[2], stored2[2])


def _operands(group_sizes, rows):
    x, weights, sizes, row_weights = operands(group_sizes, rows, width=WIDTH)
    return x, quantize_experts(*weights), sizes, row_weights


def _check(group_sizes, rows, max_group_rows, slab=None, cfg=CFG):
    x, experts, sizes, row_weights = _operands(group_sizes, rows)
    got = jax.jit(lambda *a: moe_ffn_nvfp4(*a, max_group_rows=max_group_rows, slab=slab, cfg=cfg))(
        x, experts, sizes, row_weights)
    want = moe_ffn_nvfp4_reference(x, experts, sizes, row_weights)
    used = int(sizes.sum())
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got[:used], want[:used]) < 1e-2
    assert np.all(np.asarray(got[used:], np.float32) == 0)


def test_nvfp4_ffn_matches_its_formula_in_decode_slabs():
    _check((3, 0, 9), 14, max_group_rows=9)


def test_nvfp4_ffn_matches_its_formula_in_prefill_slabs():
    _check((130, 0, 7), 150, max_group_rows=None, cfg=None)  # the tiles `config_for` gives wide slabs


def test_nvfp4_ffn_matches_its_formula_in_slabs_of_16_tokens_and_two_blocks_per_wgmma_call():
    _check((3, 0, 20, 1), 30, max_group_rows=20, slab=16, cfg=dataclasses.replace(CFG, blocks_per_wgmma=2))


def test_paired_row_blocks_split_along_k_give_the_formulas_products():
    """One matrix of 768 rows (3 tiles of 2 warpgroups x 2 paired 64-row blocks) and 3 k steps split in 3, three
    slabs of 16 tokens (two experts, one slab skipped): the partials sum to the formula's product."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((2, 1, 768, 192)), jnp.float32)
    codes, scale, _ = quantize_matrices(w)
    packed, scales = layout(codes, scale)
    x = jnp.asarray(rng.standard_normal((3, 16, 192)), jnp.float16)
    weights = dequantize(packed, scales, jnp.ones((2,), jnp.float32), 1)[:, 0]  # [G, rows, K]
    want = jnp.einsum("snk,srk->snr", x[:2].astype(jnp.float32), weights[jnp.asarray([0, 1])])
    parts = w4_gmm(x, packed, scales, slab_group=jnp.asarray([0, 1, 1]), slab_rows=jnp.asarray([16, 5, 0]),
                   col_vectors=(), matrices=1, epilogue=epilogues.plain, out_dtype=jnp.bfloat16, cfg=CFG,
                   interpret=interpret_default(), paired_rows=True, k_splits=3)
    parts = np.asarray(parts, np.float32)
    assert parts.shape == (3, 3, 16, 768)
    assert rel_err(parts.sum(0)[:2], want) < 1e-2
    assert rel_err(parts[0, :2], want) > 0.1  # each split holds only its part
    assert not parts[:, 2].any()  # the skipped slab's tiles multiply nothing


def test_k_splits_fill_the_sms_without_a_second_wave():
    # the bench preset's decode products: wo and the shared experts' down (48 tiles of 128 rows), q|k|v|r (88)
    decode = config_for(32)
    assert k_splits_to_fill(48, 8192, decode, interpret=False) == 2
    assert k_splits_to_fill(48, 6144, decode, interpret=False) == 2
    assert k_splits_to_fill(88, 6144, decode, interpret=False) == 1
    assert k_splits_to_fill(3, 6 * 256, decode, interpret=False) == 3  # 4 would not divide the 6 k steps


def test_the_all_rows_decode_step_of_a_128_sequence_server_takes_decode_slabs():
    # a server with 128 slots decodes 129 rows at once (a scratch row): those groups are decode-sized
    assert slab_tokens(129) < PREFILL_SLAB == slab_tokens(None)
