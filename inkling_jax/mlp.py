"""The dense SwiGLU MLP (first layers, MTP blocks) and the sigmoid top-k MoE with the shared-expert sink.

Gate and up projections are stored apart (`w_gate`, `w_up`); the hub interleaves them by row and the loader
de-interleaves. The SwiGLU is computed in fp32 and cast back. How the routed tokens reach the experts' kernels:
moe_dispatch.py.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax import dense_fp8, dense_nvfp4
from inkling_jax.config import TextConfig
from inkling_jax.layers import normal, swiglu
from inkling_jax.moe_dispatch import expert_forms, experts


# Steps of at least this many tokens run NVFP4 routed experts' fp8 twin (`MoE.add_fp8_twin`). Not tuned: on the
# H200 the NVFP4 kernels took 517 us at 128 tokens against fp8's ~750, and 5.22 ms at 4096 against 3.04
# (bench/results/moe.md); the crossing lies between.
TWIN_TOKENS = 512


class DenseMLP(nnx.Module):
    def __init__(self, hidden: int, width: int, *, dtype, rngs: nnx.Rngs):
        self.w_gate = nnx.Param(normal(rngs, (hidden, width), dtype))
        self.w_up = nnx.Param(normal(rngs, (hidden, width), dtype))
        self.w_down = nnx.Param(normal(rngs, (width, hidden), dtype))
        self.global_scale = nnx.Param(jnp.ones((1,), dtype))

    @classmethod
    def from_weights(cls, w_gate, w_up, w_down) -> "DenseMLP":
        """A DenseMLP holding these matrices ([hidden, width] twice, [width, hidden]) and a global scale of 1."""
        mlp = nnx.eval_shape(lambda: cls(*w_gate.shape, dtype=w_gate.dtype, rngs=nnx.Rngs(0)))
        for name, value in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down),
                            ("global_scale", jnp.ones((1,), w_gate.dtype))):
            setattr(mlp, name, nnx.Param(value))
        return mlp

    @property
    def fp8(self) -> bool:
        return hasattr(self, "w_down_fp8")

    @property
    def nvfp4(self) -> bool:
        return hasattr(self, "w_down_nvfp4")

    @property
    def fused(self) -> bool:
        return any(hasattr(self, f"w_gate_up{suffix}") for suffix in ("", "_fp8", "_nvfp4"))

    @property
    def matrix_names(self) -> tuple[str, ...]:
        return (("w_gate_up",) if self.fused else ("w_gate", "w_up")) + ("w_down",)

    def quantize(self, precision: str = "fp8") -> int:
        """Replaces the matrices by fp8 ones (inkling_jax/dense_fp8.py: `<name>_fp8` values [out, in] and
        `<name>_out_scale`, one per output column) or NVFP4 ones (inkling_jax/dense_nvfp4.py: an Nvfp4Linear
        `<name>_nvfp4`), freeing the originals: for serving (forward only). Returns the number of matrices
        changed (0 if already quantised)."""
        if precision not in ("fp8", "nvfp4"):
            raise ValueError(f"dense MLPs are quantised to fp8 or nvfp4, not {precision!r}")
        if self.fp8 or self.nvfp4:
            return 0
        for name in self.matrix_names:
            w = getattr(self, name)[...]
            delattr(self, name)
            if precision == "nvfp4":
                setattr(self, f"{name}_nvfp4", dense_nvfp4.Nvfp4Linear.quantize(w))
                continue
            values, scale = dense_fp8.quantize(w, transpose=True)
            setattr(self, f"{name}_fp8", nnx.Param(values))
            setattr(self, f"{name}_out_scale", nnx.Param(scale))
        return len(self.matrix_names)

    def fuse_gate_up(self) -> None:
        """Inference only: gate and up become one matrix `w_gate_up` [hidden, gate | up] (or its fp8 or NVFP4
        form), so a call multiplies x once (a decode step's products are short and latency-bound as two). The two are
        deleted. Training, LoRA, checkpoints and the tensor-parallel rules name the two; the fused columns mix
        them, so the fused matrix must not be split over `tensor`."""
        if self.fused:
            return
        if self.nvfp4:  # the output columns of each, keeping their codes and scales
            self.w_gate_up_nvfp4 = dense_nvfp4.Nvfp4Linear.concatenate([self.w_gate_nvfp4, self.w_up_nvfp4])
            del self.w_gate_nvfp4, self.w_up_nvfp4
            return
        if self.fp8:  # [out, in] values, one scale per output column: gate's rows, then up's
            for suffix in ("_fp8", "_out_scale"):
                parts = [getattr(self, f"w_gate{suffix}")[...], getattr(self, f"w_up{suffix}")[...]]
                setattr(self, f"w_gate_up{suffix}", nnx.Param(jnp.concatenate(parts, axis=0)))
                delattr(self, f"w_gate{suffix}")
                delattr(self, f"w_up{suffix}")
            return
        self.w_gate_up = nnx.Param(jnp.concatenate([self.w_gate[...], self.w_up[...]], axis=1))
        del self.w_gate, self.w_up

    def _product(self, x, name):
        if self.nvfp4:
            return getattr(self, f"{name}_nvfp4")(x)
        if self.fp8:
            return dense_fp8.matmul(x, getattr(self, f"{name}_fp8")[...], getattr(self, f"{name}_out_scale")[...])
        return x @ getattr(self, name)[...]

    def __call__(self, x, expert_ids=None, *, unit_weights=None):
        """x [..., hidden] -> (y [..., hidden], None). unit_weights [..., units]: h's width is that many equal
        units, each scaled by its weight before the down projection (the widened shared experts of
        `MoE.widen_shared_experts`: one unit per expert, its sink weight)."""
        if self.fused:
            gate, up = jnp.split(self._product(x, "w_gate_up"), 2, axis=-1)
        else:
            gate, up = self._product(x, "w_gate"), self._product(x, "w_up")
        h = swiglu(gate, up)
        if unit_weights is None:
            return self._product(h, "w_down") * self.global_scale[...], None
        units = unit_weights.shape[-1]
        h = h.reshape(*h.shape[:-1], units, -1) * unit_weights[..., None].astype(h.dtype)
        if self.fp8 or self.nvfp4:
            y = self._product(h.reshape(*h.shape[:-2], -1), "w_down")
        else:  # a product per unit, summed in fp32: at 32 rows XLA's one [S I, hidden] product read at 0.33-0.41 of
            # the H200's bandwidth (44-56 us, bench/results/dense_matmuls.md); batched, 23 us a layer in the traced step
            w_down = self.w_down[...].reshape(units, -1, self.w_down.shape[-1])
            y = jnp.einsum("...ui,uih->u...h", h, w_down).astype(jnp.float32).sum(0).astype(h.dtype)
        return y * self.global_scale[...], None


class MoE(nnx.Module):
    """Router over E routed + S shared experts; top-k of the routed ones by sigmoid score plus a selection-only
    bias; the k chosen and the S shared experts share one normalisation, so shared experts draw weight away
    from routed ones (the "sink"); weights scaled by route_scale and a learned global scale.

    `shared_in_launch`: run the shared experts as S extra groups of the routed experts' grouped matmul (the
    "linearised" layout, every token visits them with its sink weight) instead of a separate dense einsum.
    One launch instead of two, but the launch needs one weight array, so every local expert's weights are
    copied (read and written) once per call: that costs more than it saves unless the matmuls dwarf the copy
    (see bench/moe.py), hence off by default.
    """

    shared_in_launch: bool = False
    ROUTED_BF16 = ("w_gate", "w_up", "w_down")
    ROUTED_FP8 = ("w_gate_fp8", "w_up_fp8", "w_down_fp8", "w_gate_scale", "w_up_scale", "w_down_scale")
    ROUTED_NVFP4 = ("w13_nvfp4", "w13_scale", "w13_scale2", "w2_nvfp4", "w2_scale", "w2_scale2")
    ROUTED_QUANTISED = {"fp8": ROUTED_FP8, "nvfp4": ROUTED_NVFP4}  # the parameters each format's experts are in
    SHARED = ("shared_gate", "shared_up", "shared_down")

    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs):
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
            out = experts(flat, routed, None, expert_ids, weights, shared_weights, mesh=self.mesh)
            out = out + self.shared_mlp(flat, unit_weights=shared_weights)[0].astype(jnp.float32)
        else:
            shared = (self.shared_gate[...], self.shared_up[...], self.shared_down[...])
            out = experts(flat, routed, shared, expert_ids, weights, shared_weights, mesh=self.mesh,
                          shared_in_launch=self.shared_in_launch)
        return out.astype(x.dtype).reshape(shape), expert_ids


@functools.cache
def _quantizer(precision: str):
    """The jitted quantiser of a precision, made once: compiled once per layer shape and placement, not once per
    layer."""
    if precision == "nvfp4":
        from pallas_kernels.moe.nvfp4 import quantize_experts
    else:
        from pallas_kernels.moe.fp8 import quantize_experts
    return jax.jit(quantize_experts)
