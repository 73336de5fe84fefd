"""Attention as a server runs it: q, k, v and r from one product."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from inkling_jax.nn.attention import Attention
from inkling_jax.nn.layers import Linear
from inkling_jax.quant.form import ServingForm, take_parts

PROJECTIONS = ("wq", "wk", "wv", "wr")


class FusedAttention(ServingForm, Attention):
    """`Attention` whose q, k, v and r maps are one linear `wqkvr [hidden, q | k | v | r widths]` (a `Linear`, or
    an NVFP4 one), so a call multiplies u once: a decode step's small projections are latency-bound as four
    products. `wo` is a `Linear` or an NVFP4 one. The fused columns mix heads, so `wqkvr` is never split over
    `tensor` (checkpoints, LoRA and the tensor-parallel rules name the four maps)."""

    def __init__(self, attention: Attention, wqkvr: nnx.Module, wo: nnx.Module):
        take_parts(self, attention, replaced=PROJECTIONS + ("wqkvr", "wo"))
        self.wqkvr, self.wo = wqkvr, wo

    @classmethod
    def fuse(cls, attention: Attention) -> FusedAttention:
        """From an attention with the four maps: their kernels side by side."""
        kernels = [getattr(attention, name).kernel[...] for name in PROJECTIONS]
        return cls(attention, Linear.from_kernel(jnp.concatenate(kernels, axis=1), attention.wq.backend), attention.wo)

    def project(self, u):
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return jnp.split(self.wqkvr(u), [q_width, q_width + kv_width, q_width + 2 * kv_width], axis=-1)
