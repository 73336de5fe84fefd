"""The dense MLP as a server runs it: its matrices as linear modules (fp8, NVFP4), gate and up apart or fused."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from inkling_jax.nn.layers import Linear
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.quant.form import ServingForm


class _ServingMLP(ServingForm, DenseMLP):
    """A DenseMLP whose matrices are linear modules."""

    def _down(self, h):
        return self.w_down(h)


class SplitMLP(_ServingMLP):
    """`DenseMLP` whose w_gate, w_up and w_down are linear modules in a serving precision (`Fp8Linear`), gate
    and up kept apart: splittable over `tensor` like the model's matrices."""

    def __init__(self, w_gate: nnx.Module, w_up: nnx.Module, w_down: nnx.Module, global_scale: nnx.Param):
        self.w_gate, self.w_up, self.w_down, self.global_scale = w_gate, w_up, w_down, global_scale

    def _gate_up(self, x):
        return self.w_gate(x), self.w_up(x)

    def fused(self) -> FusedMLP:
        """gate and up as one matrix of their output columns, each part keeping its values and scales."""
        return FusedMLP(type(self.w_gate).concatenate([self.w_gate, self.w_up]), self.w_down, self.global_scale)


class FusedMLP(_ServingMLP):
    """`DenseMLP` whose gate and up are one linear `w_gate_up [hidden, gate | up]` (a `Linear`, or an fp8 or
    NVFP4 one), so a call multiplies x once: a decode step's products are short and latency-bound as two. The
    fused columns mix gate and up, so the matrix is never split over `tensor`."""

    def __init__(self, w_gate_up: nnx.Module, w_down: nnx.Module, global_scale: nnx.Param):
        self.w_gate_up, self.w_down, self.global_scale = w_gate_up, w_down, global_scale

    @classmethod
    def fuse(cls, mlp: DenseMLP) -> FusedMLP:
        """From the model's MLP: its gate and up kernels side by side."""
        gate_up = jnp.concatenate([mlp.w_gate[...], mlp.w_up[...]], axis=1)
        return cls(Linear.from_kernel(gate_up, mlp.backend), Linear.from_kernel(mlp.w_down[...], mlp.backend),
                   mlp.global_scale)

    def _gate_up(self, x):
        return jnp.split(self.w_gate_up(x), 2, axis=-1)
