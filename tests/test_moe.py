"""MoE: backends agree (values and gradients), expert parallelism equals the single-device layer, routing
replay keeps the recorded choice while gradients reach the router."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import kernels, preset
from inkling_jax.mlp import MoE
from inkling_jax.sharding import make_mesh, shard_model


def _moe(seed=0, skew=False):
    moe = MoE(preset("tiny").text, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    if skew:  # uneven routing: experts 0 and 1 favoured, expert 7 never chosen
        moe.router_bias.set_value(jnp.array([4.0, 4.0, 0, 0, 0, 0, 0, -50.0]))
    return moe


def _run(moe, x):
    def loss(model, x):
        y, ids = model(x)
        return (y * jnp.cos(jnp.arange(y.size).reshape(y.shape))).sum(), (y, ids)

    (_, (y, ids)), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(moe, x)
    return y, ids, grads


@pytest.mark.parametrize("backend", ["dense", "ragged"])
def test_backends_agree_in_value_and_gradient(backend):
    x = jax.random.normal(jax.random.key(0), (2, 9, 64))
    with kernels.use("jnp", moe="dense"):
        ref_y, ref_ids, ref_g = _run(_moe(), x)
    with kernels.use("jnp", moe=backend):
        y, ids, g = _run(_moe(), x)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("spec", ["expert=8", "data=2,expert=4", "fsdp=2,tensor=2,expert=2"])
def test_expert_parallel_equals_single_device(spec):
    x = jax.random.normal(jax.random.key(1), (4, 6, 64))
    with kernels.use("jnp", moe="ragged"):
        ref_y, ref_ids, ref_g = _run(_moe(skew=True), x)
        assert 7 not in np.asarray(ref_ids) and np.bincount(np.asarray(ref_ids).ravel())[0] > 10
        moe = shard_model(_moe(skew=True), make_mesh(spec))
        y, ids, g = nnx.jit(_run)(moe, x)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_routing_replay_keeps_the_choice_and_gives_reference_gradients():
    moe = _moe(seed=2)
    x = jax.random.normal(jax.random.key(2), (16, 64))
    _, recorded = moe(x)
    # After an update the router would choose differently; replay must keep the recorded experts.
    moe.router.set_value(moe.router[...] + 0.5 * jax.random.normal(jax.random.key(3), moe.router.shape))
    _, fresh = moe(x)
    assert (np.asarray(fresh) != np.asarray(recorded)).any()
    _, replayed = moe(x, expert_ids=recorded)
    np.testing.assert_array_equal(replayed, recorded)

    def replay_weights(router):
        logits = x @ router
        routed = jnp.take_along_axis(logits[:, :8], recorded, axis=-1)
        active = jax.nn.sigmoid(jnp.concatenate([routed, logits[:, 8:]], axis=-1))
        return (8.0 * active / active.sum(-1, keepdims=True) * jnp.arange(1, 5)).sum()

    def ours(model):
        w, _, shared = model.route(x, recorded)
        return (jnp.concatenate([w, shared], axis=-1) * jnp.arange(1, 5)).sum()

    got = nnx.grad(ours)(moe)["router"][...]
    np.testing.assert_allclose(got, jax.grad(replay_weights)(moe.router[...]), rtol=1e-4, atol=1e-5)
