"""Grouped matmul and SwiGLU MoE FFN kernels (Mosaic GPU on Hopper; portable Pallas in interpret mode)."""

from pallas_kernels.moe.decode import moe_ffn_decode
from pallas_kernels.moe.ffn import DECODE_MAX_ROWS, moe_ffn
from pallas_kernels.moe.ops import grouped_matmul
from pallas_kernels.moe.tuning import GmmConfig, KernelConfigs, WgradConfig

__all__ = ["grouped_matmul", "moe_ffn", "moe_ffn_decode", "DECODE_MAX_ROWS", "KernelConfigs", "GmmConfig",
           "WgradConfig"]
