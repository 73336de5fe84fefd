"""Relative flash attention (Inkling's query-conditioned relative bias), Pallas forward and backward."""

from pallas_kernels.rel_attention.kernel import rel_flash_attention
from pallas_kernels.rel_attention.reference import attention_mask, rel_attention, relative_bias

__all__ = ["rel_flash_attention", "rel_attention", "relative_bias", "attention_mask"]
