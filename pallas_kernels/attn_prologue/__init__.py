"""Fused decode attention prologue: K/V ShortConv + state update, q/k RMSNorm, tau fold and the KV-cache write."""

from pallas_kernels.attn_prologue.kernel import attn_prologue
from pallas_kernels.attn_prologue.tuning import PrologueBlocks

__all__ = ["attn_prologue", "PrologueBlocks"]
