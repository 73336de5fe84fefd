"""The forms an MoE's routed experts are served in (`ServingMoE.experts`): as loaded (`RoutedExperts`), fp8
(pallas_kernels/moe/fp8.py: one scale per expert and matrix, activations quantised per row on the fly), NVFP4
(pallas_kernels/moe/nvfp4.py: a scale per 16 values, f16 activations), and NVFP4 with an fp8 twin. Each gives the
dispatch (`nn.moe.experts`) its weights through `form(num_tokens)`: the (w_gate, w_up, w_down) stacks, an
Fp8Experts or an Nvfp4Experts. Forward only. The parameter names are the dispatch's (`nn.moe_dispatch`), which
shards them by name."""

from __future__ import annotations

import jax
from flax import nnx

from inkling_jax.nn.moe_dispatch import ROUTED_BF16, ROUTED_FP8, ROUTED_NVFP4
from inkling_jax.quant.form import ServingForm
from pallas_kernels.moe import fp8, nvfp4

# Steps of at least this many tokens run NVFP4 routed experts' fp8 twin. Not tuned: the crossing of the two
# kernels' times lies between decode and prefill sizes (see docs/performance.md).
TWIN_TOKENS = 512

_quantize_fp8 = jax.jit(fp8.quantize_experts)  # jitted once: compiled once per layer shape and placement
_quantize_nvfp4 = jax.jit(nvfp4.quantize_experts)
_dequantize_nvfp4 = jax.jit(nvfp4.dequantize_experts)


class _Stacks(ServingForm):
    """Routed experts as the parameters NAMES, handed to the dispatch as `form(*values)`."""

    NAMES: tuple[str, ...]

    def __init__(self, *arrays):
        for name, value in zip(self.NAMES, arrays, strict=True):
            setattr(self, name, nnx.Param(value))

    def arrays(self) -> tuple:
        return tuple(getattr(self, name)[...] for name in self.NAMES)

    def form(self, num_tokens: int | None = None):
        """The weights as `nn.moe.experts` takes them, for a step of `num_tokens` (static) tokens."""
        return self.FORM(*self.arrays())


class RoutedExperts(_Stacks):
    """The (w_gate, w_up, w_down) stacks as loaded, beside shared experts in a serving form."""

    NAMES = ROUTED_BF16

    def form(self, num_tokens: int | None = None):
        return self.arrays()


class Fp8RoutedExperts(_Stacks):
    NAMES, FORM = ROUTED_FP8, fp8.Fp8Experts

    @classmethod
    def quantize(cls, w_gate, w_up, w_down) -> Fp8RoutedExperts:
        return cls(*_quantize_fp8(w_gate, w_up, w_down))


class Nvfp4RoutedExperts(_Stacks):
    NAMES, FORM = ROUTED_NVFP4, nvfp4.Nvfp4Experts

    @classmethod
    def quantize(cls, w_gate, w_up, w_down) -> Nvfp4RoutedExperts:
        return cls(*_quantize_nvfp4(w_gate, w_up, w_down))

    def with_twin(self) -> Nvfp4RoutedExpertsWithTwin:
        """These experts with an fp8 twin, quantised from their NVFP4 values: steps of TWIN_TOKENS tokens or more
        are bound by the tensor cores, which multiply fp8 at twice the rate of the W4A16 kernels' f16, while
        decode steps read the NVFP4 bytes. Both forms carry the same quantised experts up to fp8's rounding; the
        twin costs one byte per weight."""
        twin = Fp8RoutedExperts.quantize(*_dequantize_nvfp4(self.form()))
        return Nvfp4RoutedExpertsWithTwin(*self.arrays(), twin=twin)


class Nvfp4RoutedExpertsWithTwin(Nvfp4RoutedExperts):
    """NVFP4 routed experts and their fp8 twin `twin` (`Nvfp4RoutedExperts.with_twin`)."""

    def __init__(self, *arrays, twin: Fp8RoutedExperts):
        super().__init__(*arrays)
        self.twin = twin

    def with_twin(self) -> Nvfp4RoutedExpertsWithTwin:
        return self

    def form(self, num_tokens: int | None = None):
        if num_tokens is not None and num_tokens >= TWIN_TOKENS:
            return self.twin.form(num_tokens)
        return super().form(num_tokens)


QUANTISED = {"fp8": Fp8RoutedExperts, "nvfp4": Nvfp4RoutedExperts}  # precision -> the form it holds


def quantised(experts: _Stacks, precision: str) -> _Stacks:
    """`experts` held in `precision` ("fp8" or "nvfp4"): quantised from the stacks as loaded, or as they are
    where already in that form."""
    kind = QUANTISED[precision]
    if isinstance(experts, kind):
        return experts
    if not isinstance(experts, RoutedExperts):
        raise ValueError(f"routed experts held as {type(experts).__name__} cannot be held in {precision}")
    return kind.quantize(*experts.arrays())
