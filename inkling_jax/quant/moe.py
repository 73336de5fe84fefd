"""The MoE as a server runs it: its routed experts in a serving form (`inkling_jax.quant.experts`) and its shared
experts as stacks or widened into one MLP."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.nn.layers import Linear, swiglu
from inkling_jax.nn.moe import MoE
from inkling_jax.nn.moe_dispatch import ROUTED_BF16, SHARED_NAMES
from inkling_jax.quant.form import ServingForm, take_parts


class ServingMoE(ServingForm, MoE):
    """`MoE` whose routed experts are the module `experts` (its type is their form: `RoutedExperts`,
    `Fp8RoutedExperts`, `Nvfp4RoutedExperts`, with or without a twin) and whose shared experts are `shared`
    (`SharedExpertStacks`, run by the dispatch beside the routed ones, or `WidenedSharedExperts`, run apart)."""

    def __init__(self, moe: MoE, experts: nnx.Module, shared: nnx.Module):
        take_parts(self, moe, replaced=ROUTED_BF16 + SHARED_NAMES + ("experts", "shared"))
        self.experts, self.shared = experts, shared

    def routed_experts(self, num_tokens: int | None = None):
        return self.experts.form(num_tokens)

    def shared_experts(self):
        return self.shared.stacks()

    def shared_apart(self, x, shared_weights):
        return self.shared.apart(x, shared_weights)


class SharedExpertStacks(ServingForm):
    """The S shared experts' stacks `shared_gate`, `shared_up` [S, H, I] and `shared_down` [S, I, H] as the model
    holds them (the same Variables: a loader may fill them after the routed experts are quantised)."""

    def __init__(self, moe: MoE):
        for name in SHARED_NAMES:
            setattr(self, name, getattr(moe, name))

    def stacks(self):
        return tuple(getattr(self, name)[...] for name in SHARED_NAMES)

    def apart(self, x, shared_weights):
        return None


class WidenedSharedExperts(ServingForm):
    """The S shared experts as one MLP of width S x I whose h is weighted per expert by its sink weight before
    the down projection: `w_gate_up [H, gate | up]` (expert k's columns are unit k of each) and `w_down [S I, H]`,
    a `SummedUnitsLinear` or an NVFP4 linear. It runs beside the routed experts' dispatch under any mesh (XLA places
    it by the dense rules), as one gate|up product a layer instead of a product per stack."""

    def __init__(self, w_gate_up: nnx.Module, w_down: nnx.Module):
        self.w_gate_up, self.w_down = w_gate_up, w_down

    @classmethod
    def widen(cls, stacks: SharedExpertStacks, backend: Backend) -> WidenedSharedExperts:
        gate, up, down = stacks.stacks()
        s, h, i = gate.shape

        def wide(w):  # [S, H, I] -> [H, S I]: expert k's columns are unit k
            return w.transpose(1, 0, 2).reshape(h, s * i)

        gate_up = jnp.concatenate([wide(gate), wide(up)], axis=1)
        return cls(Linear.from_kernel(gate_up, backend), SummedUnitsLinear(down.reshape(s * i, h), units=s))

    def stacks(self):
        return None

    def apart(self, x, shared_weights):
        """x [N, hidden], shared_weights [N, S] -> the shared experts' weighted sum, fp32 [N, hidden]."""
        gate, up = jnp.split(self.w_gate_up(x), 2, axis=-1)
        h = swiglu(gate, up)
        units = shared_weights.shape[-1]
        h = h.reshape(*h.shape[:-1], units, -1) * shared_weights[..., None].astype(h.dtype)
        return self.w_down(h.reshape(*h.shape[:-2], -1)).astype(jnp.float32)


class SummedUnitsLinear(ServingForm, Linear):
    """A `Linear` [units x width, out] that multiplies each unit of its input by its own rows and sums the
    products in fp32: at a decode step's few rows XLA read one product's weights at a fraction of the bandwidth
    a batch of per-unit products reached (see docs/performance.md)."""

    def __init__(self, kernel, units: int):
        self.kernel = nnx.Param(kernel)
        self.units = units

    def __call__(self, x):
        w = self.kernel[...].reshape(self.units, -1, self.kernel.shape[-1])
        h = x.reshape(*x.shape[:-1], self.units, -1)
        return jnp.einsum("...ui,uih->u...h", h, w).astype(jnp.float32).sum(0).astype(x.dtype)
