"""Loading for serving (`load_pretrained(quant=...)`): the MoE layers an NVFP4 checkpoint stores packed are held
in NVFP4 before they are read, and every other MoE layer's routed experts are quantised as soon as they are in,
so the devices never hold more than one layer's experts as loaded."""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from inkling_jax.checkpoint.hub_source import HubSource
from inkling_jax.nn.model import InklingModel
from inkling_jax.nn.moe import MoE
from inkling_jax.nn.moe_dispatch import ROUTED_BF16
from inkling_jax.quant.config import QuantConfig
from inkling_jax.quant.view import moe_view

Path = tuple  # a parameter's path in the module tree, e.g. ("layers", 3, "mlp", "w_gate")


def hold_in_nvfp4(model: InklingModel, layers: list[int]) -> None:
    """Gives those MoE layers of an abstract model NVFP4 routed experts, in place (shapes only: far cheaper than
    building the abstract model again)."""
    nvfp4 = QuantConfig(expert_precision="nvfp4")
    for i in layers:
        model.layers[i].mlp = nnx.eval_shape(lambda moe: moe_view(moe, nvfp4), model.layers[i].mlp)


def packed_moe_layers(checkpoint: HubSource, model: InklingModel) -> list[int]:
    """The MoE layers whose two routed-expert matrices the checkpoint stores packed in NVFP4."""
    def packed(i):
        prefix = f"model.llm.layers.{i}.mlp.experts"
        return {f"{prefix}.w13_weight", f"{prefix}.w2_weight"} <= checkpoint.groups.keys()
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE) and packed(i)]


def quantize_when_complete(model: InklingModel, variables: dict[Path, nnx.Variable],
                           quant: QuantConfig) -> Callable[[Path], None]:
    """A callback for each parameter set while loading, that gives a MoE layer its routed experts in `quant`'s
    precision once all three are set (`moe_view`, in place) and drops them as loaded."""
    pending: dict[int, set] = {}
    routed_only = QuantConfig(expert_precision=quant.expert_precision)  # its shared experts may not be in yet

    def filled(path: Path) -> None:
        if path[0] != "layers" or path[-1] not in ROUTED_BF16 or not isinstance(model.layers[path[1]].mlp, MoE):
            return
        pending.setdefault(path[1], set()).add(path[-1])
        if len(pending[path[1]]) == 3:
            model.layers[path[1]].mlp = moe_view(model.layers[path[1]].mlp, routed_only)
            for name in ROUTED_BF16:  # `variables` holds them until the load ends
                value = variables[path[:-1] + (name,)].get_value()
                variables[path[:-1] + (name,)].set_value(jax.ShapeDtypeStruct(value.shape, value.dtype))
    return filled
