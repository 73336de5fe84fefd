"""Relative flash attention (Inkling's query-conditioned relative bias), Pallas forward and backward, and the
prefill-chunk forward over a paged cache."""

from pallas_kernels.rel_attention.chunk import rel_chunk_attention
from pallas_kernels.rel_attention.kernel import rel_flash_attention
from pallas_kernels.rel_attention.reference import attention_mask, chunk_attention, rel_attention, relative_bias

__all__ = ["rel_flash_attention", "rel_chunk_attention", "rel_attention", "chunk_attention", "relative_bias",
           "attention_mask"]
