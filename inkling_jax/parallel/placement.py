"""Placing a model on a mesh: every parameter by the rules table, and the mesh handed to the modules that split
their own work."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from inkling_jax.nn.attention import Attention
from inkling_jax.nn.layers import ShortConv
from inkling_jax.nn.model import InklingModel
from inkling_jax.nn.moe import MoE
from inkling_jax.parallel.rules import param_shardings


def shard_model(model: nnx.Module, mesh: Mesh, rules=None) -> nnx.Module:
    """A copy of `model` with every parameter placed on `mesh` by the table and its modules told the mesh
    (`use_mesh`); `model` is left as it was (parameters already so placed are shared, not copied)."""
    placed = nnx.clone(model)
    shardings = param_shardings(placed, mesh, rules)
    for path, node in nnx.iter_graph(placed):
        if isinstance(node, nnx.Param):
            node.set_value(jax.device_put(node.get_value(), shardings[path]))
    return use_mesh(placed, mesh)


def use_mesh(model: nnx.Module, mesh: Mesh | None) -> nnx.Module:
    """Tell the modules that split their own work the mesh, in place (for a model the caller has just built:
    `shard_model` places a copy): MoE layers run expert parallel over `expert` and split expert widths over
    `tensor`; attention and ShortConv kernels run per device; the model looks up its embedding per vocabulary
    slice. Returns the model."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, (MoE, Attention, ShortConv, InklingModel)):
            node.mesh = mesh
    return model
