"""The dense W4A16 kernel against its formula: a decode slab with K split in two, and prefill slabs with padding;
in Pallas's interpreter on CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense_w4 import kernel_product, reference_product
from pallas_kernels.moe.kernel_w4 import W4Config
from pallas_kernels.moe.nvfp4 import layout, quantize_matrices

CFG = W4Config(block_k=64, stages=2)  # 384 inputs: 6 k steps; 384 outputs: 3 tiles of 128 rows


def _matrix_codes(features=384, seed=0):
    w = 0.05 * jax.random.normal(jax.random.key(seed), (features, features), jnp.float32)  # [out, in]
    codes, block_scale, _ = quantize_matrices(w[None, None])
    return layout(codes, block_scale)


@pytest.mark.parametrize("rows, k_splits", [(20, 2), (200, None)])
def test_kernel_products_equal_their_formula(rows, k_splits):
    """20 rows in one decode slab of 32, K split in two (partials summed), and 200 in two prefill slabs of 128
    (the second part padding)."""
    codes, scales = _matrix_codes()
    x = jax.random.normal(jax.random.key(1), (rows, 384), jnp.bfloat16)
    got = kernel_product(x, codes, scales, cfg=CFG, k_splits=k_splits)
    want = reference_product(x, codes, scales)
    assert got.shape == want.shape == (rows, 384)
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64)) / np.linalg.norm(want)
    assert err < 1e-2  # the kernel's outputs are bf16
