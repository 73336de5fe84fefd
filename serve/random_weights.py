"""A model with seeded random weights, for `--random-weights`, the tests and the benchmarks: matrices
N(0, 0.02^2), norm weights and scales 1, the router's selection bias 0.

`InklingModel(config, rngs=nnx.Rngs(seed))` compiles one random-number program per parameter shape, which on a
small CPU takes far longer than the model's own steps; numpy draws the weights in milliseconds (`random_model`).
On an accelerator numpy would take minutes for billions of weights; there one compiled draw per parameter shape
makes them on the device (`device_random_model`), a decoder layer at a time, so that a serving view in other
precisions is made layer by layer (`random_weights`).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import InklingConfig
from inkling_jax.nn.layers import INIT_STD
from inkling_jax.nn.model import InklingModel
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.view import into_serving_forms

ZERO_INIT = ("router_bias",)  # 1-D parameters that start at zero; every other 1-D one starts at one


def _abstract(config: InklingConfig, dtype, backend: Backend) -> InklingModel:
    return nnx.eval_shape(lambda: InklingModel(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0), backend=backend))


def _undrawn(module: nnx.Module) -> list[tuple[str, nnx.Param]]:
    """(path, parameter) of each parameter of `module` that holds no array yet."""
    return [("/".join(map(str, path)), var) for path, var in nnx.iter_graph(module)
            if isinstance(var, nnx.Param) and isinstance(var.get_value(), jax.ShapeDtypeStruct)]


def _one_d(path: str, shape, dtype):
    return np.full(shape, 0.0 if path.rsplit("/", 1)[-1] in ZERO_INIT else 1.0, dtype)


def random_model(config: InklingConfig, dtype=jnp.float32, seed: int = 0, backend: Backend = Backend()) -> InklingModel:
    """The model with weights drawn by numpy (on CPU)."""
    model = _abstract(config, dtype, backend)
    rng = np.random.default_rng(seed)
    for path, var in _undrawn(model):
        shape, kind = var.get_value().shape, var.get_value().dtype
        value = (INIT_STD * rng.standard_normal(shape, dtype=np.float32) if len(shape) >= 2
                 else _one_d(path, shape, np.float32))
        var.set_value(jax.device_put(value.astype(kind)))
    return model


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _draw_on_device(module: nnx.Module, key) -> None:
    """Fills `module`'s undrawn parameters, each from `key` folded with its path (the same weights whatever
    order the parameters are drawn in)."""
    for path, var in _undrawn(module):
        shape, kind = var.get_value().shape, var.get_value().dtype
        if len(shape) >= 2:
            var.set_value(_normal(jax.random.fold_in(key, zlib.crc32(path.encode())), shape, kind))
        else:
            var.set_value(jnp.asarray(_one_d(path, shape, kind)))


def device_random_model(config: InklingConfig, dtype=jnp.bfloat16, seed: int = 0, backend: Backend = Backend(),
                        quant: QuantConfig | None = None) -> InklingModel:
    """The model with weights drawn on the device, a decoder layer at a time. With `quant`,
    `serving_view(model, quant, fuse=False)`, each layer swapped into its serving forms before the next is drawn:
    the device never holds the whole model in float, and what a layer's float weights leave free is the room the
    next layer's take (a view of the whole model made at once leaves free memory in two blocks, the freed float
    weights and the tail, and the KV pool is sized by the larger)."""
    model = _abstract(config, dtype, backend)
    key = jax.random.key(seed)
    for i, layer in enumerate(model.layers):
        _draw_on_device(layer, jax.random.fold_in(key, i))
        if quant is not None:
            into_serving_forms(layer, quant, fuse=False)
    _draw_on_device(model, jax.random.fold_in(key, len(model.layers)))  # embedding, head, norms, towers, MTP
    return model if quant is None else serving_view(model, quant, fuse=False)


def random_weights(config: InklingConfig, dtype=jnp.float32, seed: int = 0, backend: Backend = Backend(),
                   quant: QuantConfig = QuantConfig()) -> InklingModel:
    """`serving_view(model, quant, fuse=False)` of a model with random weights, made where it is fastest: by
    numpy on CPU, on the device (layer by layer) on an accelerator."""
    if jax.default_backend() == "cpu":
        return serving_view(random_model(config, dtype, seed, backend), quant, fuse=False)
    return device_random_model(config, dtype, seed, backend, quant)
