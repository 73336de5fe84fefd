"""A model with seeded random weights, for `--random-weights`, the tests and the benchmarks.

`InklingModel(config, rngs=nnx.Rngs(seed))` compiles one random-number program per parameter shape, which on a
small CPU takes far longer than the model's own steps; numpy draws the same kind of weights (matrices
N(0, 0.02^2); norm weights and scales 1, the router's selection bias 0) in milliseconds (`random_model`). On an
accelerator the model's own initialisers, in one jitted program, make billions of weights in seconds, where numpy
would take minutes (`device_random_model`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import InklingConfig
from inkling_jax.nn.layers import INIT_STD
from inkling_jax.nn.model import InklingModel

ZERO_INIT = ("router_bias",)  # 1-D parameters that start at zero; every other 1-D one starts at one


def random_model(config: InklingConfig, dtype=jnp.float32, seed: int = 0, backend: Backend = Backend()) -> InklingModel:
    model = nnx.eval_shape(lambda: InklingModel(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0), backend=backend))
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        shape, kind = var.get_value().shape, var.get_value().dtype
        if len(shape) >= 2:
            value = INIT_STD * rng.standard_normal(shape, dtype=np.float32)
        else:
            value = np.full(shape, 0.0 if str(path[-1]) in ZERO_INIT else 1.0, np.float32)
        var.set_value(jax.device_put(value.astype(kind)))
    return model


def device_random_model(config: InklingConfig, dtype=jnp.bfloat16, seed: int = 0,
                        backend: Backend = Backend()) -> InklingModel:
    """The model's own initialisers, run on the device in one jitted program (not parameter by parameter)."""
    build = lambda: InklingModel(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed), backend=backend)  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(build))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(build())[1])())


def random_weights(config: InklingConfig, dtype=jnp.float32, seed: int = 0,
                   backend: Backend = Backend()) -> InklingModel:
    """Random weights made where it is fastest: on the device on an accelerator, by numpy on CPU."""
    make = random_model if jax.default_backend() == "cpu" else device_random_model
    return make(config, dtype, seed, backend)
