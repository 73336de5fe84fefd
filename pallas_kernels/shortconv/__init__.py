"""ShortConv (depthwise causal conv of width 4 with its residual): Pallas kernels and the pure-jnp reference."""

from pallas_kernels.shortconv.kernel import shortconv_decode, shortconv_prefill
from pallas_kernels.shortconv.strip import shortconv_prefill_strip
from pallas_kernels.shortconv.tuning import DecodeBlocks, PrefillBlocks, StripBlocks

__all__ = ["shortconv_prefill", "shortconv_prefill_strip", "shortconv_decode", "PrefillBlocks", "StripBlocks",
           "DecodeBlocks"]
