"""Decode attention (one new token per sequence) with Inkling's relative bias: paged cache for full-attention
layers, ring cache for sliding-window layers. Split-K Pallas kernels (Triton backend on GPU) and jnp references."""

from pallas_kernels.decode_attention.paged import contiguous_as_pages, paged_decode_attention
from pallas_kernels.decode_attention.reference import paged_decode_reference, ring_decode_reference
from pallas_kernels.decode_attention.ring import ring_decode_attention

__all__ = [
    "contiguous_as_pages",
    "paged_decode_attention",
    "paged_decode_reference",
    "ring_decode_attention",
    "ring_decode_reference",
]
