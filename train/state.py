"""The training state and how it is sharded.

Parameters live in flat dicts, `"layers.3.attn.wq.kernel" -> array` (`Flat`), in three groups:
- `params`: what the optimizer updates, as fp32 master copies (all text weights; or only the LoRA adapters);
- `bias`: the MoE selection biases (`router_bias`), changed only by the load-balancing rule, never by gradients;
- `frozen`: the rest (LoRA base weights, media towers, MTP head), kept in the compute dtype, not in the state.
`ModelParts` turns such dicts back into an `InklingModel` in the compute dtype inside the jitted step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from inkling_jax.backend import Backend
from inkling_jax.config import InklingConfig
from inkling_jax.nn.model import InklingModel
from inkling_jax.parallel.rules import logical_axes, spec_for
from inkling_jax.quant.form import ServingForm

Flat = dict[str, Any]
BIAS_NAME = "router_bias"
# The text model; the media towers are not trained by the next-token loss, nor the MTP head unless its loss is on.
TEXT_ROOTS = ("embed", "embed_norm", "layers", "norm", "unembed")
TOWER_ROOTS = ("vision", "audio")  # trained only where asked (RL's --train-towers)


def name_of(path: tuple) -> str:
    return ".".join(str(p) for p in path)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Flat
    opt_state: Any
    bias: Flat
    rng: jax.Array  # a raw uint32 PRNG key, split once per step

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(**d)


class ModelParts:
    """The static structure of the model in the compute dtype: paths, shapes, dtypes and the graph to merge into.

    `parts.merge(flat)` builds the module from a complete flat dict (any float dtype; each entry is cast to the
    dtype the model keeps it in, so fp32-only tensors such as the ShortConv taps stay fp32).
    """

    def __init__(self, config: InklingConfig, compute_dtype, backend: Backend = Backend()):
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype)
        abstract = nnx.eval_shape(lambda: InklingModel(config, dtype=self.compute_dtype, rngs=nnx.Rngs(0),
                                                       backend=backend))
        self.graphdef, state = nnx.split(abstract)
        self.template = list(nnx.to_flat_state(state))
        self.paths = {name_of(p): p for p, _ in self.template}
        self.shapes = {name_of(p): tuple(v.get_value().shape) for p, v in self.template}
        self.dtypes = {name_of(p): jnp.dtype(v.get_value().dtype) for p, v in self.template}
        # MoE layers in layer order: their bias names line up with the expert ids `hidden_states` returns.
        self.bias_names = sorted((n for n in self.paths if n.endswith(BIAS_NAME)), key=lambda n: self.paths[n])

    def merge(self, flat: Flat) -> InklingModel:
        cast = self.cast({name: flat[name] for name in self.paths})
        values = [(p, v.replace(cast[name_of(p)])) for p, v in self.template]
        return nnx.merge(self.graphdef, nnx.from_flat_state(values))

    def cast(self, flat: Flat) -> Flat:
        """The entries of `flat` in the dtypes the model keeps them in, behind an optimization barrier: the
        rounding to the compute dtype is then real. Without it XLA:GPU may drop a cast pair fp32 -> bf16 -> fp32
        (excess precision), so that the MoE router, which reads its bf16 weight in fp32, would compute with the
        trainer's fp32 masters, and route otherwise than the rollout engine, which holds the rounded weights."""
        return jax.lax.optimization_barrier({name: x.astype(self.dtypes[name]) for name, x in flat.items()})

    def axes(self, name: str) -> tuple[str | None, ...]:
        return logical_axes(self.paths[name], len(self.shapes[name]))


def model_params(model: nnx.Module) -> Flat:
    """The parameters of a concrete model as a flat dict; a model holding serving forms (fused, fp8 or NVFP4
    weights: `inkling_jax.quant`) is refused, naming the outermost such module."""
    serving = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, ServingForm)]
    if serving:
        path, node = min(serving, key=lambda item: len(item[0]))
        raise ValueError(f"{name_of(path) or 'the model'}: a {type(node).__name__}, a serving form "
                         "(`inkling_jax.quant.serving_view`), which serves but does not train; train the model "
                         "it was made from")
    _, state = nnx.split(model)
    return {name_of(p): v.get_value() for p, v in nnx.to_flat_state(state)}


_SEEDED: dict = {}


def seeded_params(config: InklingConfig, seed: int, shardings: Flat | None = None,
                  compiler_options: dict | None = None) -> Flat:
    """The fp32 parameters of `InklingModel(config, rngs=nnx.Rngs(seed))` on `shardings` (default: the default
    device). On an accelerator one jitted program makes them directly there (compiled once per process and
    setup); on CPU the model's initialisers run op by op, whose small programs (one per shape) are cached across
    configurations and meshes, where compiling the one program took seconds for each (the same values, to float
    rounding), and each array is then placed."""
    if jax.default_backend() == "cpu":
        flat = model_params(InklingModel(config, dtype=jnp.float32, rngs=nnx.Rngs(seed)))
        if shardings is None:
            return flat
        # from host values, which every process of a job holds alike, onto shardings that may span them all
        host = {name: np.asarray(value) for name, value in flat.items()}
        return {name: jax.make_array_from_callback(v.shape, shardings[name], lambda index, v=v: v[index])
                for name, v in host.items()}
    key = (config, seed, None if shardings is None else tuple(sorted(shardings.items())),
           tuple(sorted((compiler_options or {}).items())))
    if key not in _SEEDED:
        build = lambda: model_params(InklingModel(config, dtype=jnp.float32, rngs=nnx.Rngs(seed)))  # noqa: E731
        _SEEDED[key] = jax.jit(build, out_shardings=shardings, compiler_options=compiler_options)
    return _SEEDED[key]()


def pretrained_params(path: str, config: InklingConfig, shardings: Flat, progress: bool = True) -> Flat:
    """The fp32 parameters of the model directory `path` (`load_pretrained`), each placed on its sharding as
    it is read."""
    from inkling_jax.checkpoint.loading import load_pretrained

    place = lambda p, x: jax.device_put(x, shardings[name_of(p)])  # noqa: E731
    return model_params(load_pretrained(path, "float32", config=config, place=place, progress=progress))


def trainable_names(parts: ModelParts, freeze: Iterable[str] = (), mtp: bool = False, text: bool = True,
                    towers: bool = False) -> list[str]:
    """Text weights the optimizer updates (none without `text`), the MTP head's with `mtp` and the media towers'
    with `towers`: all but the selection biases and names matching a `freeze` regex."""
    return [n for n in parts.paths if is_trainable(n, parts.dtypes[n], freeze, mtp, text, towers)]


def is_trainable(name: str, dtype, freeze: Iterable[str] = (), mtp: bool = False, text: bool = True,
                 towers: bool = False) -> bool:
    """Whether the optimizer updates the weight `name` of this dtype (`trainable_names`)."""
    roots = (TEXT_ROOTS if text else ()) + (("mtp",) if mtp else ()) + (TOWER_ROOTS if towers else ())
    return (name.split(".")[0] in roots and not name.endswith(BIAS_NAME) and jnp.issubdtype(dtype, jnp.floating)
            and not any(re.search(f, name) for f in freeze))


def partition(parts: ModelParts, flat: Flat, trainable: Iterable[str]) -> tuple[Flat, Flat, Flat]:
    """(params fp32, bias fp32, frozen in the compute dtypes) from a complete flat dict."""
    trainable = set(trainable)
    params = {n: flat[n].astype(jnp.float32) for n in parts.paths if n in trainable}
    bias = {n: flat[n].astype(jnp.float32) for n in parts.bias_names}
    frozen = {n: flat[n].astype(parts.dtypes[n]) for n in parts.paths if n not in trainable and n not in bias}
    return params, bias, frozen


class Shardings:
    """NamedShardings for flat dicts, the optimizer state and the whole TrainState, from the one rules table."""

    def __init__(self, mesh: Mesh, axes_of):
        """axes_of(name, ndim) -> logical axis names of that entry."""
        self.mesh, self.axes_of = mesh, axes_of
        self.replicated = NamedSharding(mesh, PartitionSpec())

    def flat(self, tree: Flat) -> Flat:
        return {n: NamedSharding(self.mesh, spec_for(self.axes_of(n, len(x.shape)), tuple(x.shape), self.mesh))
                for n, x in tree.items()}

    def opt_state(self, tx, abstract_opt_state, params: Flat):
        """Moments shaped like the parameters are sharded like them; counters and scalars are replicated."""
        import optax

        return optax.tree_map_params(tx, lambda _, s: s, abstract_opt_state, self.flat(params),
                                     transform_non_params=lambda _: self.replicated,
                                     is_leaf=lambda x: isinstance(x, NamedSharding))

    def state(self, tx, abstract: TrainState) -> TrainState:
        return TrainState(step=self.replicated, params=self.flat(abstract.params),
                          opt_state=self.opt_state(tx, abstract.opt_state, abstract.params),
                          bias=self.flat(abstract.bias), rng=self.replicated)


def abstract_like(tree, shardings):
    """ShapeDtypeStructs carrying shardings (a restore target)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def put(tree: Flat, shardings: Flat) -> Flat:
    """Place host or device arrays on their shardings (works multi-host: each process gives what it has)."""
    def one(x, sharding):
        if isinstance(x, jax.Array):
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return {n: one(x, shardings[n]) for n, x in tree.items()}
