"""The dense SwiGLU MLP (first layers, MTP blocks, and the widened shared experts of the MoE).

Gate and up projections are stored apart (`w_gate`, `w_up`); the hub interleaves them by row and the loader
de-interleaves. The SwiGLU is computed in fp32 and cast back.
"""

import jax.numpy as jnp
from flax import nnx

from inkling_jax.nn.layers import normal, swiglu
from inkling_jax.quant import dense_fp8, dense_nvfp4


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
        """Replaces the matrices by fp8 ones (inkling_jax/quant/dense_fp8.py: `<name>_fp8` values [out, in] and
        `<name>_out_scale`, one per output column) or NVFP4 ones (inkling_jax/quant/dense_nvfp4.py: an Nvfp4Linear
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
