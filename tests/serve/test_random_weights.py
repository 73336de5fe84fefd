"""Random weights as the server and the benchmarks make them (`serve.random_weights`): the device path's draws
follow the stated rule, are seeded, and its layer-by-layer serving view is the whole-model view of the same
weights, made without holding the whole float model at once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import serve.random_weights as rw
from inkling_jax import preset
from inkling_jax.nn.layers import INIT_STD
from inkling_jax.quant import QuantConfig, serving_view

CONFIG = preset("tiny")


def params(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in nnx.iter_graph(model)
            if isinstance(var, nnx.Param)}


def test_device_draws_follow_the_rule_and_the_seed():
    drawn = params(rw.device_random_model(CONFIG, jnp.float32, seed=3))
    again = params(rw.device_random_model(CONFIG, jnp.float32, seed=3))
    other = params(rw.device_random_model(CONFIG, jnp.float32, seed=4))
    assert drawn.keys() == again.keys() and all(np.array_equal(drawn[k], again[k]) for k in drawn)
    matrices = [k for k, x in drawn.items() if x.ndim >= 2]
    assert all(not np.array_equal(drawn[k], other[k]) for k in matrices)
    for name, x in drawn.items():
        if x.ndim < 2:
            assert np.all(x == (0.0 if name.endswith("router_bias") else 1.0)), name
    every = np.concatenate([drawn[k].ravel() for k in matrices])
    assert abs(every.std() / INIT_STD - 1) < 0.01 and abs(every.mean()) < 0.01 * INIT_STD
    # each layer its own weights, not one draw repeated
    q0, q1 = (drawn[f"layers/{i}/attn/wq/kernel"] for i in (0, 1))
    assert not np.array_equal(q0, q1)


def nbytes(module) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(module)))


@pytest.mark.parametrize("quant", [QuantConfig(), QuantConfig("fp8", "fp8"), QuantConfig("nvfp4", "nvfp4", True)])
def test_the_layer_by_layer_view_is_the_whole_models_view(quant):
    whole = serving_view(rw.device_random_model(CONFIG, jnp.float32, seed=1), quant, fuse=False)
    by_layer = rw.device_random_model(CONFIG, jnp.float32, seed=1, quant=quant)
    graph_whole, state_whole = nnx.split(whole)
    graph_layers, state_layers = nnx.split(by_layer)
    assert graph_layers == graph_whole
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state_layers, state_whole))


def test_each_float_layer_is_freed_before_the_next_is_drawn(monkeypatch):
    """After layer i is drawn the device holds the views of the layers before it and layer i in float (NVFP4
    without twins: each view smaller than the layer in float)."""
    quant = QuantConfig("nvfp4", "nvfp4")
    floats = rw.device_random_model(CONFIG, jnp.float32, seed=1)
    views = serving_view(floats, quant, fuse=False).layers
    float_layers, view_layers = [nbytes(x) for x in floats.layers], [nbytes(x) for x in views]
    del floats, views

    base = sum(x.nbytes for x in jax.live_arrays())
    held = []
    draw = rw._draw_on_device

    def measured(module, key):
        draw(module, key)
        held.append(sum(x.nbytes for x in jax.live_arrays()) - base)

    monkeypatch.setattr(rw, "_draw_on_device", measured)
    rw.device_random_model(CONFIG, jnp.float32, seed=1, quant=quant)
    slack = 64  # the PRNG keys
    for i in range(1, CONFIG.text.num_layers):
        assert sum(view_layers[:i]) < sum(float_layers[:i])
        assert held[i] <= sum(view_layers[:i]) + float_layers[i] + slack, (i, held, float_layers, view_layers)
