"""Grouped matmul and SwiGLU MoE FFN kernels (Mosaic GPU on Hopper; portable Pallas in interpret mode), and the
fp8 experts' forward (fp8.py). `MatmulKernels` swaps in jax's own Mosaic-GPU ragged dot (jax_mgpu.py) for the
forward or the backward matmuls."""

from pallas_kernels.moe.decode import moe_ffn_decode
from pallas_kernels.moe.ffn import DECODE_MAX_ROWS, block_tiles, moe_ffn, moe_ffn_in_blocks
from pallas_kernels.moe.fp8 import Fp8Experts, moe_ffn_fp8, quantize_experts
from pallas_kernels.moe.jax_mgpu import MatmulKernels
from pallas_kernels.moe.ops import grouped_matmul
from pallas_kernels.moe.tuning import GmmConfig, KernelConfigs, WgradConfig

__all__ = ["grouped_matmul", "moe_ffn", "moe_ffn_in_blocks", "block_tiles", "moe_ffn_decode", "DECODE_MAX_ROWS",
           "KernelConfigs", "GmmConfig", "WgradConfig", "MatmulKernels", "Fp8Experts", "moe_ffn_fp8",
           "quantize_experts"]
