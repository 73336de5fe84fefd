"""ShortConv (depthwise causal conv of width 4 with its residual): Pallas kernels and the pure-jnp reference."""

from pallas_kernels.shortconv.kernel import shortconv_decode, shortconv_prefill
from pallas_kernels.shortconv.tuning import DecodeBlocks, PrefillBlocks

__all__ = ["shortconv_prefill", "shortconv_decode", "PrefillBlocks", "DecodeBlocks"]
