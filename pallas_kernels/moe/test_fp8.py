"""fp8 routed experts (fp8.py): the quantisation's error bound, the kernels against their jnp formula (row-blocked
and decode layouts), and that formula against the bf16 FFN. On CPU the portable kernels run in interpret mode;
on a GPU the Mosaic-GPU kernels run compiled (fp8 wgmma). Shapes: 3 row blocks, 3+ n-blocks and k-steps, an empty
group, row blocks straddling groups, rows past sum(group_sizes), an expert width that needs padding."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import GmmConfig, KernelConfigs, reference
from pallas_kernels.moe.decode import in_slabs
from pallas_kernels.moe.fp8 import (dequantize_experts, moe_ffn_fp8, moe_ffn_fp8_reference, quantize_experts,
                                    quantize_rows)
from pallas_kernels.moe.groups import row_block_passes
from pallas_kernels.moe.test_moe import GROUP_SIZES, normal, rel_err

HIDDEN, WIDTH, ROWS = 384, 200, 300  # WIDTH pads to 256
CONFIGS = KernelConfigs(gmm=GmmConfig(block_n=128, block_k=128, stages=3),
                        swiglu=GmmConfig(block_n=64, block_k=128, stages=3))


def operands(group_sizes, rows, seed=0, width=WIDTH):
    """x [rows, HIDDEN], bf16 expert weights (gate, up, down) of the given width, group sizes, routing weights."""
    keys = jax.random.split(jax.random.key(seed), 5)
    g = len(group_sizes)
    x = normal(keys[0], (rows, HIDDEN), jnp.bfloat16)
    w_gate = normal(keys[1], (g, HIDDEN, width), jnp.bfloat16, HIDDEN ** -0.5)
    w_up = normal(keys[2], (g, HIDDEN, width), jnp.bfloat16, HIDDEN ** -0.5)
    w_down = normal(keys[3], (g, width, HIDDEN), jnp.bfloat16, width ** -0.5)
    row_weights = jax.random.uniform(keys[4], (rows,), jnp.float32)
    return x, (w_gate, w_up, w_down), jnp.asarray(group_sizes, jnp.int32), row_weights


def test_quantisation_error_is_within_e4m3_rounding():
    x, weights, _, _ = operands(GROUP_SIZES, ROWS)
    experts = quantize_experts(*weights)
    assert experts.gate.shape == (5, 256, HIDDEN) and experts.down.shape == (5, HIDDEN, 256)
    for w, deq, scale in zip(weights, dequantize_experts(experts), experts[3:]):
        w = np.asarray(w, np.float32)
        deq = np.asarray(deq)[:, :w.shape[1], :w.shape[2]]
        # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals: 2^-10 absolute, in units of the scale
        bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * np.asarray(scale)[:, None, None]
        assert np.all(np.abs(deq - w) <= bound)
    q, s = quantize_rows(x)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (ROWS,)
    assert np.allclose(np.asarray(q, np.float32) * np.asarray(s)[:, None], np.asarray(x, np.float32),
                       rtol=2.0 ** -4, atol=float(np.max(s)) * 2.0 ** -9)


def test_fp8_ffn_matches_its_formula_row_blocked():
    x, weights, sizes, row_weights = operands(GROUP_SIZES, ROWS)
    experts = quantize_experts(*weights)
    got = jax.jit(lambda *a: moe_ffn_fp8(*a, configs=CONFIGS))(x, experts, sizes, row_weights)
    want = moe_ffn_fp8_reference(x, experts, sizes, row_weights)
    used = int(sizes.sum())
    assert rel_err(got[:used], want[:used]) < 1e-2
    assert np.all(np.asarray(got[used:], np.float32) == 0)


def test_fp8_ffn_matches_its_formula_in_the_decode_layout():
    sizes = (3, 0, 9, 1, 5)  # 18 rows: a decode step's top-k copies
    x, weights, sizes, row_weights = operands(sizes, 20, seed=1)
    experts = quantize_experts(*weights)
    got = jax.jit(lambda *a: moe_ffn_fp8(*a, max_group_rows=20))(x, experts, sizes, row_weights)
    want = moe_ffn_fp8_reference(x, experts, sizes, row_weights)
    assert rel_err(got[:18], want[:18]) < 1e-2
    assert np.all(np.asarray(got[18:], np.float32) == 0)


def test_fp8_formula_stays_close_to_the_bf16_ffn():
    x, weights, sizes, row_weights = operands(GROUP_SIZES, ROWS)
    used = int(sizes.sum())
    fp8 = moe_ffn_fp8_reference(x, quantize_experts(*weights), sizes, row_weights)
    bf16 = reference.moe_ffn(x.astype(jnp.float32), *(w.astype(jnp.float32) for w in weights), sizes, row_weights)
    err = rel_err(fp8[:used], bf16[:used])
    assert 1e-3 < err < 0.08  # fp8 does change the result, by a few percent at most


def test_padded_layout_leaves_no_row_block_straddling_two_experts():
    """The fp8 kernels skip the masking of such blocks (no 8-bit select in Mosaic GPU): the layout must not make
    any, and the rows must come back in place."""
    x, _, sizes, row_weights = operands(GROUP_SIZES, ROWS)
    seen = {}

    def ffn(rows, slab_sizes, rws):
        passes = row_block_passes(slab_sizes, rows.shape[0], 128)
        seen["mixed"] = int((passes.mixed * (passes.num_passes > 0)).sum())  # blocks with no pass run nothing
        return rows * rws[:, None].astype(rows.dtype)

    got = in_slabs(x, sizes, row_weights, None, ffn, align=128)
    assert seen["mixed"] == 0
    used = int(sizes.sum())
    want = x[:used] * row_weights[:used, None].astype(x.dtype)
    assert np.array_equal(np.asarray(got[:used], np.float32), np.asarray(want, np.float32))
    assert np.all(np.asarray(got[used:], np.float32) == 0)
