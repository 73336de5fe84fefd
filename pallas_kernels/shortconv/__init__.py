"""ShortConv (depthwise causal conv of width 4 with its residual): Pallas kernels and the pure-jnp reference."""

from pallas_kernels.shortconv.kernel import shortconv_decode
from pallas_kernels.shortconv.strip import shortconv_prefill
from pallas_kernels.shortconv.tuning import DecodeBlocks, StripBlocks

__all__ = ["shortconv_prefill", "shortconv_decode", "StripBlocks", "DecodeBlocks"]
