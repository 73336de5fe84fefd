"""The NVFP4 format: nibble order, exact values, and the stated error bound of quantise-then-dequantise."""

import ml_dtypes
import numpy as np

from inkling_jax.checkpoint import nvfp4


def test_packing_order_and_exact_values():
    codes = np.array([[1, 15, 7, 0]], np.uint8)  # 0.5, -6, 6, 0
    packed = nvfp4.pack(codes)
    assert packed.tolist() == [[0xF1, 0x07]]  # even column in the low nibble
    np.testing.assert_array_equal(nvfp4.unpack(packed), [[0.5, -6.0, 6.0, 0.0]])
    # Weights already on the grid of their scales come back bit for bit.
    rng = np.random.default_rng(1)
    grid = nvfp4.E2M1_VALUES[rng.integers(0, 8, (2, 3, 32))] * rng.choice([-1, 1], (2, 3, 32))
    grid[..., ::16] = 6.0  # every block reaches the grid's top: its e4m3 scale is exactly 448
    weights = (grid * 448 * np.array([2.0 ** -10, 2.0 ** -6])[:, None, None]).astype(np.float32)  # exact scale2
    np.testing.assert_array_equal(nvfp4.dequantize(*nvfp4.quantize(weights)), weights)


def test_quantise_dequantise_within_the_stated_bound():
    rng = np.random.default_rng(0)
    experts, rows, cols = 4, 24, 96
    weights = rng.standard_normal((experts, rows, cols)).astype(np.float32)
    weights *= np.exp(rng.uniform(-6, 1, (experts, rows, cols // 16, 1))).repeat(16, -1).reshape(weights.shape)
    weights[0, 0, :16] = 0.0  # an all-zero block
    weights[1, 2, 5] = 40.0  # an outlier that sets its expert's scale2
    weights[1, 3, :16] *= 1e-7  # blocks whose e4m3 scale is subnormal or zero
    packed, scale, scale2 = nvfp4.quantize(weights)
    assert packed.shape == (experts, rows, cols // 2) and packed.dtype == np.uint8
    assert scale.shape == (experts, rows, cols // 16) and scale.dtype == ml_dtypes.float8_e4m3fn
    assert scale2.shape == (experts,) and scale2.dtype == np.float32
    error = np.abs(nvfp4.dequantize(packed, scale, scale2) - weights)
    bound = nvfp4.error_bound(weights, scale2)
    assert np.all(error <= bound * (1 + 1e-6)), float((error / bound).max())
    assert (error / bound).max() > 0.5  # the bound is not vacuous: some element comes close to it
    np.testing.assert_array_equal(nvfp4.dequantize(packed, scale, scale2)[0, 0, :16], 0.0)
