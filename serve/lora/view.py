"""The adapted serving view: a model whose attention projections and dense MLPs are `LoRALinear`s and whose MoEs
are `AdaptedMoE`s (`serve.lora.experts`), over a shared pool of `slots` adapter slots (slot 0: the base). Built
from a serving view (`inkling_jax.quant.serving_view`), which stays as it was; fused projections stay fused. The
MTP blocks are not adapted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from inkling_jax.nn.attention import Attention
from inkling_jax.nn.layers import Linear
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.nn.model import InklingModel
from inkling_jax.nn.moe import MoE
from inkling_jax.quant.attention import FusedAttention
from inkling_jax.quant.mlp import FusedMLP, SplitMLP
from serve.lora.adapters import Adapter
from serve.lora.experts import ProjectionAdapters, adapted_moe
from serve.lora.linear import AdapterPool, AdapterRows, LoRALinear

_ATTENTION = ("wq", "wk", "wv", "wr")


def lora_view(model: InklingModel, slots: int, rank: int, experts: bool = False,
              mesh: Mesh | None = None) -> InklingModel:
    """A copy of `model` whose adaptable projections add the adapter of their row's slot; `slots` counts the
    base's slot 0, `rank` is the largest rank a slot holds; with `experts`, the MoE layers' routed and shared experts
    are adaptable too. Every slot starts as the base. With `mesh` (the one `model` is placed on), every adapter
    array (factors, scales, the rows' slots) is whole on each of its devices: small beside the weights they
    adapt, so each device adds any row's product to whatever split of the base's output it holds."""
    view = nnx.clone(model)
    rows = AdapterRows(jnp.zeros((1,), jnp.int32))

    def adapted(linear, parts, fan_in, widths=None):
        """`linear` adapted; its parts' output widths are equal unless given (a fused projection's)."""
        out = jax.eval_shape(linear, jax.ShapeDtypeStruct((1, fan_in), model.dtype)).shape[-1]
        widths = widths or (out // len(parts),) * len(parts)
        return LoRALinear(linear, parts, widths, fan_in, slots, rank, rows, backend=model.backend)

    hidden = model.config.text.hidden_size
    for i, layer in enumerate(view.layers):
        p, attn = f"layers.{i}.", layer.attn
        if isinstance(attn, FusedAttention):
            q, kv, r = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim, attn.num_heads * attn.d_rel
            attn.wqkvr = adapted(attn.wqkvr, tuple(f"{p}attn.{n}.kernel" for n in _ATTENTION), hidden, (q, kv, kv, r))
        elif isinstance(attn, Attention):
            for name in _ATTENTION:
                setattr(attn, name, adapted(getattr(attn, name), (f"{p}attn.{name}.kernel",), hidden))
        attn.wo = adapted(attn.wo, (f"{p}attn.wo.kernel",), attn.num_heads * attn.head_dim)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            if experts:
                layer.mlp = adapted_moe(mlp, f"{p}mlp.", model.config.text, slots, rank, rows)
            continue
        if type(mlp) is DenseMLP:  # the model's own form: its matrices become linear modules to adapt
            mlp = SplitMLP(*(Linear.from_kernel(w[...], mlp.backend) for w in (mlp.w_gate, mlp.w_up, mlp.w_down)),
                           mlp.global_scale)
        if isinstance(mlp, SplitMLP):
            mlp.w_gate = adapted(mlp.w_gate, (f"{p}mlp.w_gate",), hidden)
            mlp.w_up = adapted(mlp.w_up, (f"{p}mlp.w_up",), hidden)
            mlp.w_down = adapted(mlp.w_down, (f"{p}mlp.w_down",), mlp.w_gate.widths[0])
        elif isinstance(mlp, FusedMLP):
            mlp.w_gate_up = adapted(mlp.w_gate_up, (f"{p}mlp.w_gate", f"{p}mlp.w_up"), hidden)
            mlp.w_down = adapted(mlp.w_down, (f"{p}mlp.w_down",), mlp.w_gate_up.widths[0])
        layer.mlp = mlp
    if mesh is not None:
        replicated = NamedSharding(mesh, PartitionSpec())
        for _, node in nnx.iter_graph(view):
            if isinstance(node, (AdapterPool, AdapterRows)):
                node.set_value(jax.device_put(node.get_value(), replicated))
    return view


def adapted_modules(view: InklingModel) -> list[LoRALinear]:
    return [node for _, node in nnx.iter_graph(view) if isinstance(node, LoRALinear)]


def expert_projections(view: InklingModel) -> list[ProjectionAdapters]:
    return [node for _, node in nnx.iter_graph(view) if isinstance(node, ProjectionAdapters)]


def adapted_shapes(view: InklingModel) -> dict[str, tuple[int, ...]]:
    """Base weight -> its shape ([in, out]; experts' [experts, in, out]) of every weight the view adapts (what
    `adapters.load_adapter` checks against)."""
    shapes = {part: (module.a.shape[1], width) for module in adapted_modules(view)
              for part, width in zip(module.parts, module.widths)}
    return shapes | {module.part: module.shape for module in expert_projections(view)}


def route(view: InklingModel, slots) -> None:
    """Sets the adapter slot of each row [rows] of the next call (inside a step, on the view it merged); a view
    without adapters has nothing to set."""
    for module in adapted_modules(view)[:1]:  # the rows Variable is shared by all
        module.rows.set_value(jnp.asarray(slots, jnp.int32))


def write_slot(view: InklingModel, slot: int, adapter: Adapter | None) -> None:
    """Puts `adapter` (None: the base's zeros) in `slot` of every adapted module of the view."""
    for module in adapted_modules(view):
        a, b = module.slot_factors({} if adapter is None else adapter.weights)
        module.a.write(slot, a)
        module.b.write(slot, b)
        module.scale.write(slot, 0.0 if adapter is None else adapter.scale)
    for projection in expert_projections(view):
        projection.write(slot, adapter)
