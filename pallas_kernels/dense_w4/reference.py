"""The pure-jnp dense W4A16 product: what the kernel computes, in float32."""

import jax
import jax.numpy as jnp

from pallas_kernels.moe.nvfp4 import dequantize


def dequantize_matrix(codes, block_scales):
    """code * block_scale of one matrix in kernel_w4's layout, as [in_pad, out_pad] fp32 (no global scale)."""
    return dequantize(codes, block_scales, jnp.ones((1,), jnp.float32), 1)[0, 0].T


def reference_product(rows, codes, block_scales):
    """f16(rows) @ (code * block_scale), fp32, [M, out_pad]: what the kernel computes before the global scale."""
    return jnp.dot(rows.astype(jnp.float16).astype(jnp.float32), dequantize_matrix(codes, block_scales),
                   precision=jax.lax.Precision.HIGHEST)
