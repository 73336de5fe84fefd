"""The sigmoid top-k MoE with the shared-expert sink. How the routed tokens reach the experts' kernels:
moe_dispatch.py (one device) and inkling_jax/parallel/expert_parallel.py (a mesh)."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import TextConfig
from inkling_jax.nn.layers import normal
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.nn.moe_dispatch import (
    ROUTED_BF16,
    ROUTED_FP8,
    ROUTED_NVFP4,
    ROUTED_QUANTISED,
    SHARED_NAMES,
    expert_forms,
    local_experts,
)
from inkling_jax.parallel import expert_parallel as parallel

# Steps of at least this many tokens run NVFP4 routed experts' fp8 twin (`MoE.add_fp8_twin`). Not tuned: on the
# H200 the NVFP4 kernels took 517 us at 128 tokens against fp8's ~750, and 5.22 ms at 4096 against 3.04
# (bench/results/moe.md); the crossing lies between.
TWIN_TOKENS = 512


class MoE(nnx.Module):
    """Router over E routed + S shared experts; top-k of the routed ones by sigmoid score plus a selection-only
    bias; the k chosen and the S shared experts share one normalisation, so shared experts draw weight away
    from routed ones (the "sink"); weights scaled by route_scale and a learned global scale. The routed experts
    run by the backend's `moe` (`inkling_jax.backend`).
    """

    ROUTED_BF16, ROUTED_FP8, ROUTED_NVFP4 = ROUTED_BF16, ROUTED_FP8, ROUTED_NVFP4
    ROUTED_QUANTISED = ROUTED_QUANTISED
    SHARED = SHARED_NAMES

    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        e, s, h, i = cfg.num_experts, cfg.num_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.route_scale = cfg.num_experts_per_tok, cfg.route_scale
        self.router = nnx.Param(normal(rngs, (h, e + s), dtype))
        self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32))  # selection only, never a weight
        self.router_scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.w_gate = nnx.Param(normal(rngs, (e, h, i), dtype))
        self.w_up = nnx.Param(normal(rngs, (e, h, i), dtype))
        self.w_down = nnx.Param(normal(rngs, (e, i, h), dtype))
        self.shared_gate = nnx.Param(normal(rngs, (s, h, i), dtype))
        self.shared_up = nnx.Param(normal(rngs, (s, h, i), dtype))
        self.shared_down = nnx.Param(normal(rngs, (s, i, h), dtype))
        self.mesh = None  # set by `sharding.shard_model`; an `expert` axis > 1 turns on expert parallelism
        self.backend = backend  # which kernels run (`inkling_jax.backend`)

    @property
    def num_experts(self) -> int:
        return self.router_bias.shape[0]

    @property
    def precision(self) -> str:
        """How the routed experts are held: "bf16" (as built or loaded), "fp8" or "nvfp4"
        (`quantize_routed_experts`; "nvfp4" also when it has an fp8 twin)."""
        return next((p for p in ("nvfp4", "fp8") if hasattr(self, self.ROUTED_QUANTISED[p][0])), "bf16")

    @property
    def has_twin(self) -> bool:
        """NVFP4 routed experts with an fp8 copy for wide steps (`add_fp8_twin`)."""
        return self.precision == "nvfp4" and hasattr(self, self.ROUTED_FP8[0])

    @property
    def fp8(self) -> bool:
        """Whether the routed experts are held in fp8 (as `DenseMLP.fp8` tells of its matrices)."""
        return self.precision == "fp8"

    def quantize_routed_experts(self, precision: str = "fp8") -> None:
        """Replaces the routed experts' weights by fp8 ones (pallas_kernels/moe/fp8.py: one scale per expert and
        matrix, activations quantised per row on the fly) or NVFP4 ones (pallas_kernels/moe/nvfp4.py: a scale
        per 16 values, f16 activations), freeing the originals: for serving (forward only)."""
        if precision not in self.ROUTED_QUANTISED:
            raise ValueError(f"routed experts are quantised to fp8 or nvfp4, not {precision!r}")
        experts = _quantizer(precision)(self.w_gate[...], self.w_up[...], self.w_down[...])
        del self.w_gate, self.w_up, self.w_down
        for name, value in zip(self.ROUTED_QUANTISED[precision], experts):
            setattr(self, name, nnx.Param(value))

    def add_fp8_twin(self) -> None:
        """Keeps an fp8 copy (pallas_kernels/moe/fp8.py's format) of the NVFP4 routed experts, which steps of
        TWIN_TOKENS tokens or more run instead: a prefill's products are bound by the tensor cores, which multiply
        fp8 at twice the rate of the W4A16 kernels' f16 (on the H200 a 4096-token step's FFN took 3.04 ms in fp8
        and 5.22 in NVFP4, bench/results/moe.md), while decode steps read the NVFP4 bytes. Built from the NVFP4
        values, so both forms carry the same quantised experts up to fp8's rounding; it costs one byte per
        weight."""
        if self.precision != "nvfp4":
            raise ValueError(f"an fp8 twin is kept for NVFP4 routed experts, not {self.precision}")
        if self.has_twin:
            return
        from pallas_kernels.moe.nvfp4 import dequantize_experts

        twin = _quantizer("fp8")(*jax.jit(dequantize_experts)(self.routed_experts()))
        for name, value in zip(self.ROUTED_FP8, twin):
            setattr(self, name, nnx.Param(value))

    def routed_experts(self, num_tokens: int | None = None):
        """(w_gate, w_up, w_down), or an Fp8Experts / Nvfp4Experts when quantised: the fp8 twin for a step of
        `num_tokens` (static) >= TWIN_TOKENS where there is one."""
        precision = self.precision
        if self.has_twin and num_tokens is not None and num_tokens >= TWIN_TOKENS:
            precision = "fp8"
        if precision == "bf16":
            return self.w_gate[...], self.w_up[...], self.w_down[...]
        return expert_forms()[precision](*(getattr(self, name)[...] for name in self.ROUTED_QUANTISED[precision]))

    @property
    def widened(self) -> bool:
        return hasattr(self, "shared_mlp")

    def widen_shared_experts(self) -> None:
        """Inference only: the S shared experts become one DenseMLP `shared_mlp` of width S x I whose h is
        weighted per expert by its sink weight (DenseMLP's unit_weights), run beside the routed experts under any
        mesh (XLA places it by the dense MLP's rules). So it takes the dense MLP's fused gate|up: on the H200 the
        traced 33-row decode step ran the stacked shared gate and up as two split-K dots a layer, 207 us in all,
        and the widened gate|up as one product a layer, 168 us (bench/results/serve.md). The three stacks are
        deleted."""
        if self.widened:
            return
        gate, up, down = self.shared_gate[...], self.shared_up[...], self.shared_down[...]
        s, h, i = gate.shape

        def wide(w):  # [S, H, I] -> [H, S I]: expert k's columns are unit k
            return w.transpose(1, 0, 2).reshape(h, s * i)

        self.shared_mlp = DenseMLP.from_weights(wide(gate), wide(up), down.reshape(s * i, h))
        del self.shared_gate, self.shared_up, self.shared_down

    def route(self, x, expert_ids=None):
        """x [N, hidden] -> (routed weights [N, k], expert ids [N, k], shared weights [N, S]), all fp32.

        Given `expert_ids` (routing replay: the choice recorded at rollout time) only the weights are
        recomputed, so gradients reach the router while the choice stays the recorded one.
        """
        logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        routed, shared = logits[:, : self.num_experts], logits[:, self.num_experts:]
        if expert_ids is None:
            choice = jax.nn.sigmoid(routed) + self.router_bias[...]
            _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(choice), self.top_k)
        active = jnp.concatenate([jnp.take_along_axis(routed, expert_ids, axis=-1), shared], axis=-1)
        weights = jax.nn.softmax(jax.nn.log_sigmoid(active), axis=-1)  # = sigmoid / sum(sigmoid)
        weights = weights * self.route_scale * self.router_scale[...]
        return weights[:, : self.top_k], expert_ids, weights[:, self.top_k:]

    def __call__(self, x, expert_ids=None):
        """x [..., hidden] -> (y [..., hidden], expert ids [N, k] chosen for the N flattened tokens)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if expert_ids is not None:
            expert_ids = expert_ids.reshape(flat.shape[0], self.top_k)
        weights, expert_ids, shared_weights = self.route(flat, expert_ids)
        routed = self.routed_experts(flat.shape[0])
        if self.widened:
            out = experts(flat, routed, None, expert_ids, weights, shared_weights, backend=self.backend,
                          mesh=self.mesh)
            out = out + self.shared_mlp(flat, unit_weights=shared_weights)[0].astype(jnp.float32)
        else:
            shared = (self.shared_gate[...], self.shared_up[...], self.shared_down[...])
            out = experts(flat, routed, shared, expert_ids, weights, shared_weights, backend=self.backend,
                          mesh=self.mesh)
        return out.astype(x.dtype).reshape(shape), expert_ids


def experts(x, routed, shared, expert_ids, weights, shared_weights, *, backend: Backend, mesh=None):
    """sum_k weights[n, k] * E_{ids[n, k]}(x[n]) + sum_s shared_weights[n, s] * E^sh_s(x[n]), in fp32 (the
    second sum left out for shared None).

    x [N, H]; routed / shared: (w_gate, w_up, w_down) of the E routed / S shared experts (routed may be an
    Fp8Experts or Nvfp4Experts: `MoE.quantize_routed_experts`; the dense backend then runs its ragged formula);
    weights [N, k] and shared_weights [N, S] fp32. By the backend's `moe`; with a mesh whose `expert` axis
    is larger than 1, by expert parallelism (all-to-all dispatch and combine); with a `tensor` axis that divides
    the experts' width, every tensor shard runs its slice of the width and the partial outputs are summed (both
    in `inkling_jax.parallel.expert_parallel`).
    """
    backend = backend.resolve()
    if mesh is not None:
        if mesh.shape[parallel.AXIS] > 1:
            return parallel.experts_ep(x, routed, shared, expert_ids, weights, shared_weights, mesh, backend)
        if parallel.width_axis(mesh, routed, shared):
            return parallel.experts_tp(x, routed, shared, expert_ids, weights, shared_weights, mesh, backend)
    return local_experts(x, routed, shared, expert_ids, weights, shared_weights, backend)



@functools.cache
def _quantizer(precision: str):
    """The jitted quantiser of a precision, made once: compiled once per layer shape and placement, not once per
    layer."""
    if precision == "nvfp4":
        from pallas_kernels.moe.nvfp4 import quantize_experts
    else:
        from pallas_kernels.moe.fp8 import quantize_experts
    return jax.jit(quantize_experts)
