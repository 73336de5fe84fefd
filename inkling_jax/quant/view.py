"""Serving views: the model a server runs, built from the model it is given, which stays as it was.

A view swaps modules for their serving forms (gpt-fast's way: the model knows nothing of quantisation):
attention for `FusedAttention`, a dense MLP for `SplitMLP` / `FusedMLP`, an MoE for `ServingMoE`, the model for
`Fp8HeadModel` where its head is quantised. The builders below take any form a module may already be in (a model
loaded with `load_pretrained(quant=...)`, then fused by the engine) and never change the module they are given.
"""

from __future__ import annotations

from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.nn.decoder import DecoderLayer
from inkling_jax.nn.layers import Linear
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.nn.model import InklingModel
from inkling_jax.nn.moe import MoE
from inkling_jax.quant.attention import FusedAttention
from inkling_jax.quant.config import QuantConfig
from inkling_jax.quant.dense_fp8 import Fp8Linear
from inkling_jax.quant.dense_nvfp4 import Nvfp4Linear
from inkling_jax.quant.experts import Nvfp4RoutedExperts, RoutedExperts, quantised
from inkling_jax.quant.head import Fp8HeadModel
from inkling_jax.quant.mlp import FusedMLP, SplitMLP
from inkling_jax.quant.moe import ServingMoE, SharedExpertStacks, WidenedSharedExperts


def serving_view(model: InklingModel, quant: QuantConfig = QuantConfig(), *, fuse: bool = True) -> InklingModel:
    """A new model computing what `model` does, its weights held as `quant` says; with `fuse`, every attention's
    q|k|v|r, every dense MLP's gate|up and every MoE's shared experts each as one product (a decode step's small
    products are latency-bound; not for a tensor-parallel mesh, whose rules split them by heads or width). NVFP4
    dense weights are fused matrices, whatever `fuse` says. Forward only.

    `model` is left bit for bit as it was: the view has modules and Variables of its own, sharing the arrays it
    does not change (jax arrays are immutable), so a trainer and a server can hold the same parameters."""
    if not isinstance(quant, QuantConfig):
        raise TypeError(f"quant must be an inkling_jax.quant.QuantConfig, not {type(quant).__name__}")
    view = nnx.clone(model)
    for layer in view.layers:
        into_serving_forms(layer, quant, fuse=fuse)
    for depth in () if view.mtp is None else view.mtp.layers:
        into_serving_forms(depth.block, quant, fuse=fuse, mtp=True)
    return view if quant.dense_precision == "bf16" else Fp8HeadModel.quantize(view)


def into_serving_forms(layer: DecoderLayer, quant: QuantConfig, *, fuse: bool, mtp: bool = False) -> None:
    """Swaps the attention and MLP of `layer` for their serving forms, in place: a layer of a view (or of a model
    being built, `serve.random_weights`), never the caller's. An MTP block's (`mtp`) MLP stays in the model's
    dtype."""
    fuse = fuse or quant.dense_precision == "nvfp4"
    fp8_mlp = quant.dense_precision != "bf16" and not mtp
    layer.attn = attention_view(layer.attn, quant, fuse=fuse)
    if isinstance(layer.mlp, MoE):
        layer.mlp = moe_view(layer.mlp, quant, fuse=fuse)
    else:
        layer.mlp = dense_mlp_view(layer.mlp, fp8=fp8_mlp, fuse=fuse)


def attention_view(attention, quant: QuantConfig = QuantConfig(), *, fuse: bool = False):
    """The attention fused (`FusedAttention`) where `fuse` or NVFP4 dense weights ask for it, its q|k|v|r and wo
    in NVFP4 where `quant` says so; else the attention as it is."""
    if not isinstance(attention, FusedAttention):
        if not (fuse or quant.dense_precision == "nvfp4"):
            return attention
        attention = FusedAttention.fuse(attention)
    return FusedAttention(attention, _held(attention.wqkvr, quant, attention.backend),
                          _held(attention.wo, quant, attention.backend))


def dense_mlp_view(mlp: DenseMLP, *, fp8: bool = False, fuse: bool = False) -> DenseMLP:
    """The dense MLP with gate and up as one matrix (`fuse`) and its matrices in fp8 (`fp8`). Fusing first gives
    the same fp8 values as fusing fp8 matrices: their scales are per output column."""
    if fuse and not isinstance(mlp, FusedMLP):
        mlp = mlp.fused() if isinstance(mlp, SplitMLP) else FusedMLP.fuse(mlp)
    if not fp8:
        return mlp
    if isinstance(mlp, FusedMLP):
        return FusedMLP(_fp8(mlp.w_gate_up), _fp8(mlp.w_down), mlp.global_scale)
    if isinstance(mlp, SplitMLP):
        return SplitMLP(_fp8(mlp.w_gate), _fp8(mlp.w_up), _fp8(mlp.w_down), mlp.global_scale)
    return SplitMLP(*(Fp8Linear.quantize(w[...]) for w in (mlp.w_gate, mlp.w_up, mlp.w_down)), mlp.global_scale)


def moe_view(moe: MoE, quant: QuantConfig = QuantConfig(), *, fuse: bool = False) -> MoE:
    """The MoE with its routed experts in `quant`'s precision (with their fp8 twin where asked) and, with `fuse` or
    NVFP4 dense weights, its shared experts widened into one MLP (in NVFP4 with those); else the MoE as it is.
    The view shares the MoE's router and shared-expert Variables (`load_pretrained` fills them later)."""
    fuse = fuse or quant.dense_precision == "nvfp4"
    if isinstance(moe, ServingMoE):
        experts, shared = moe.experts, moe.shared
    elif quant.expert_precision == "bf16" and not fuse:
        return moe
    else:
        experts, shared = RoutedExperts(*moe.routed_experts()), SharedExpertStacks(moe)
    if quant.expert_precision != "bf16":
        experts = quantised(experts, quant.expert_precision)
    if quant.fp8_twins and isinstance(experts, Nvfp4RoutedExperts):
        experts = experts.with_twin()
    if fuse and isinstance(shared, SharedExpertStacks):
        shared = WidenedSharedExperts.widen(shared, moe.backend)
    if isinstance(shared, WidenedSharedExperts):
        shared = WidenedSharedExperts(_held(shared.w_gate_up, quant, moe.backend),
                                      _held(shared.w_down, quant, moe.backend))
    return ServingMoE(moe, experts, shared)


def _held(linear: nnx.Module, quant: QuantConfig, backend: Backend) -> nnx.Module:
    """A fused attention's or the widened shared experts' matrix as `quant` holds it: in NVFP4 with NVFP4 dense
    weights (running `backend`, that of the module holding it), and with its fp8 twin where asked; else as it
    is."""
    if quant.dense_precision == "nvfp4" and not isinstance(linear, Nvfp4Linear):
        linear = Nvfp4Linear.quantize(_kernel(linear, "nvfp4"), backend=backend)
    return linear.with_twin() if quant.fp8_twins and isinstance(linear, Nvfp4Linear) else linear


def _fp8(linear: nnx.Module) -> Fp8Linear:
    return linear if isinstance(linear, Fp8Linear) else Fp8Linear.quantize(_kernel(linear, "fp8"))


def _kernel(linear: nnx.Module, precision: str):
    """The float kernel of a linear to be quantised to `precision`; a clear error for one already quantised."""
    if not isinstance(linear, Linear):
        raise ValueError(f"a matrix held as {type(linear).__name__} cannot be held in {precision}")
    return linear.kernel[...]
