"""The dense W4A16 product: f16 rows times one NVFP4-held matrix, by the routed experts' W4A16 kernel
(pallas_kernels/moe/kernel_w4.py) run as a single expert. The serving form that holds such matrices is
inkling_jax/quant/dense_nvfp4.py."""

from pallas_kernels.dense_w4.kernel import kernel_product
from pallas_kernels.dense_w4.reference import dequantize_matrix, reference_product
from pallas_kernels.dense_w4.tuning import DECODE_TOKENS

__all__ = ["kernel_product", "reference_product", "dequantize_matrix", "DECODE_TOKENS"]
