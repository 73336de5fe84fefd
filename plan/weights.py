"""The bytes of every kind of weight a model holds, whole and per device of a mesh, without making one array.

Decoder layers come in at most four kinds (sliding or full attention, dense MLP or MoE) and MTP depths in two
(sliding or full), and every layer of a kind holds the same shapes. So a probe model of one layer and one depth
per kind is built abstractly (`nnx.eval_shape`, in the serving form the server would run where asked), and each
of its parameters counts once per layer of its kind: a second for the 952B model, where the whole model takes
minutes. Per device, every parameter is split as `inkling_jax.parallel.rules` splits it over the mesh
(`spec_for` on an abstract mesh of the given axis sizes).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from inkling_jax.config import InklingConfig
from inkling_jax.nn.model import InklingModel
from inkling_jax.parallel.mesh import MESH_AXES
from inkling_jax.parallel.rules import logical_axes, spec_for
from inkling_jax.quant import QuantConfig, serving_view

GIB = 2**30  # the unit the plan's tables print
# The rows of the weights table, in the order printed.
KINDS = ("embedding", "attention", "dense MLPs", "routers", "shared experts", "routed experts",
         "norms and ShortConv taps", "LM head", "MTP head", "vision tower", "audio tower")


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter of the probe, standing for `count` parameters of the model."""

    path: tuple
    shape: tuple[int, ...]
    dtype: jnp.dtype
    count: int
    axes: tuple[str | None, ...] | None = None  # logical axes; None: the rules table's for `path`

    @property
    def kind(self) -> str:
        return kind_of(self.path, len(self.shape))

    def nbytes(self, mesh: AbstractMesh | None = None) -> int:
        """Bytes of all `count` parameters, whole or per device of `mesh`."""
        shape = self.shape
        if mesh is not None:
            axes = self.axes or logical_axes(self.path, len(shape))
            shape = NamedSharding(mesh, spec_for(axes, shape, mesh)).shard_shape(shape)
        return self.count * math.prod(shape) * self.dtype.itemsize


def kind_of(path: tuple, ndim: int) -> str:
    """The weights-table row of the parameter at `path` with `ndim` dimensions."""
    root = str(path[0])
    if root in ("vision", "audio"):
        return f"{root} tower"
    if root == "mtp":
        return "MTP head"
    if root in ("embed", "embed_norm"):
        return "embedding"
    if root != "layers":
        return "LM head"  # unembed, the final norm, an fp8 head's forms
    part = str(path[2])
    if part == "attn":
        return "attention"
    if part != "mlp":
        return "norms and ShortConv taps"
    sub = str(path[3])
    if sub == "experts" or sub in ("w_gate", "w_up", "w_down") and ndim == 3:  # a serving form, or stacked
        return "routed experts"
    if sub.startswith("shared"):
        return "shared experts"
    if sub.startswith("router"):
        return "routers"
    return "dense MLPs"


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of the four named axes (`inkling_jax.parallel.mesh`) that needs no devices."""
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


def probe(config: InklingConfig) -> tuple[InklingConfig, list[int], list[int]]:
    """(a config of one layer and one MTP depth per kind, how many layers each probe layer stands for, how many
    depths each probe depth stands for)."""
    text = config.text
    kinds = collections.Counter((text.is_local(i), text.is_dense(i)) for i in range(text.num_layers))
    order = sorted(kinds)
    small = config.replace(num_layers=len(order), local_layer_ids=tuple(i for i, k in enumerate(order) if k[0]),
                           dense_layer_ids=tuple(i for i, k in enumerate(order) if k[1]))
    depths: list[int] = []
    if config.mtp is not None:
        local = collections.Counter(k in config.mtp.local_layer_ids for k in range(config.mtp.num_layers))
        flags = sorted(local)
        depths = [local[f] for f in flags]
        small = dataclasses.replace(small, mtp=dataclasses.replace(
            config.mtp, num_layers=len(flags), local_layer_ids=tuple(i for i, f in enumerate(flags) if f)))
    return small, [kinds[k] for k in order], depths


def model_weights(config: InklingConfig, dtype, quant: QuantConfig | None = None, fuse: bool = False) -> list[Weight]:
    """Every parameter of `InklingModel(config, dtype=dtype)`, or of its serving view (`quant`, `fuse`), as probe
    weights with their counts."""
    small, layers, depths = probe(config)

    def build():
        model = InklingModel(small, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
        return model if quant is None else serving_view(model, quant, fuse=fuse)

    out = []
    for path, var in nnx.iter_graph(nnx.eval_shape(build)):
        if isinstance(var, nnx.Param):
            value = var.get_value()
            count = 1
            if path[0] == "layers":
                count = layers[path[1]]
            elif path[:2] == ("mtp", "layers"):
                count = depths[path[2]]
            out.append(Weight(tuple(path), tuple(value.shape), jnp.dtype(value.dtype), count))
    return out


def bytes_by_kind(weights: list[Weight], mesh: AbstractMesh | None = None, select=None) -> dict[str, int]:
    """{kind: bytes} over `weights` (those `select(weight)` keeps), whole or per device of `mesh`; kinds the
    model does not have are left out."""
    out = dict.fromkeys(KINDS, 0)
    for w in weights:
        if select is None or select(w):
            out[w.kind] += w.nbytes(mesh)
    return {k: v for k, v in out.items() if v}
