"""The model with its Pallas kernels switched on (interpret mode on CPU) equals the jnp path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import InklingModel, kernels, preset
from inkling_jax.generate import StepFunctions
from tests.hf_oracle import relative_error


@pytest.fixture(scope="module")
def model():
    # head_dim 16 and a window of 16: the smallest shapes the GPU kernels accept.
    config = preset("tiny").replace(sliding_window=16, rel_extent=24)
    return InklingModel(config, rngs=nnx.Rngs(5))


def _run(model, ids, backend):
    with kernels.use(backend, moe="ragged"):
        steps = StepFunctions(model)
        full = np.asarray(steps.forward(ids))
        cache = model.init_cache(ids.shape[0], 48)
        logits, cache = steps.extend(ids[:, :20], cache)
        outs = [np.asarray(logits)]
        for t in range(20, ids.shape[1]):
            logits, cache = steps.extend(ids[:, t:t + 1], cache)
            outs.append(np.asarray(logits))
    return full, np.concatenate(outs, axis=1)


def test_pallas_path_equals_jnp_path(model):
    ids = np.random.default_rng(0).integers(0, 256, (2, 36)).astype(np.int32)
    ref_full, ref_steps = _run(model, ids, "jnp")
    full, steps = _run(model, ids, "pallas")
    assert relative_error(full, ref_full) < 1e-5
    assert relative_error(steps, ref_steps) < 1e-5
    assert relative_error(steps, ref_full) < 1e-5


def test_gradients_through_the_kernels_match(model):
    """Training on GPU differentiates through the flash attention and ShortConv kernels."""
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 24)).astype(np.int32))

    def loss(m):
        return jnp.sum(m(ids)[0, :, :64] ** 2)

    grads = {}
    for backend in ("jnp", "pallas"):
        with kernels.use(backend, moe="ragged"):
            grads[backend] = nnx.grad(loss)(model)
    pairs = list(zip(jax.tree.leaves(grads["pallas"]), jax.tree.leaves(grads["jnp"])))
    assert len(pairs) > 50
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
