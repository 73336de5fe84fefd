"""The model with its Pallas kernels (`Backend.parse("pallas,moe=ragged")`, interpreted on CPU) equals the
reference path: prefill in ragged chunks over the cache, decode steps (the fused decode prologue and decode
attention kernels), a decode step with an idle row, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, InklingModel, preset, with_backend
from inkling_jax.generate import StepFunctions
from tests.hf_oracle import relative_error

BACKENDS = {name: Backend.parse(f"{name},moe=ragged") for name in ("reference", "pallas")}


@pytest.fixture(scope="module")
def model():
    # head_dim 16 and a window of 16: the smallest shapes the GPU kernels accept. Two layers, one of each kind: a
    # sliding layer with the dense MLP, a full-attention layer with the MoE.
    config = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), sliding_window=16,
                                    rel_extent=24)
    return InklingModel(config, rngs=nnx.Rngs(5))


def _run(model, ids):
    """Logits of the whole sequences, of a prefill then decode steps over them, and (first row's logits, cache
    before, cache after) of one more decode step in which the second row is idle."""
    steps = StepFunctions(model)
    full = np.asarray(steps.forward(ids))
    cache = model.init_cache(ids.shape[0], 48)
    # Prefill past the window (16) and the extent (24) in two ragged chunks (13 | 15 and 9 | 19 tokens: the
    # second chunk attends to cached keys, right-padded on row 0); the decode steps then cross the ring's wrap
    # at 32.
    first = np.array([13, 9])
    logits, cache = steps.extend(ids[:, :13], cache, n_new=first)
    chunk = np.zeros((2, 19), np.int32)
    for row, n in enumerate(first):
        chunk[row, :28 - n] = ids[row, n:28]
    rest, cache = steps.extend(chunk, cache, n_new=28 - first)
    outs = [np.stack([np.concatenate([logits[row, :n], rest[row, :28 - n]]) for row, n in enumerate(first)])]
    for t in range(28, ids.shape[1]):
        logits, cache = steps.extend(ids[:, t:t + 1], cache)
        outs.append(np.asarray(logits))
    before = jax.tree.map(np.asarray, cache)
    logits, cache = steps.extend(ids[:, :1], cache, n_new=[1, 0])
    idle_step = (np.asarray(logits)[0], before, jax.tree.map(np.asarray, cache))
    return full, np.concatenate(outs, axis=1), idle_step


@pytest.fixture(scope="module")
def runs(model):
    ids = np.random.default_rng(0).integers(0, 256, (2, 36)).astype(np.int32)
    return {name: _run(with_backend(model, backend), ids) for name, backend in BACKENDS.items()}


def test_pallas_path_equals_reference_path(runs):
    (ref_full, ref_steps, _), (full, steps, _) = runs["reference"], runs["pallas"]
    assert relative_error(full, ref_full) < 1e-5
    assert relative_error(steps, ref_steps) < 1e-5
    assert relative_error(steps, ref_full) < 1e-5


def test_idle_row_of_a_decode_step_changes_nothing(runs, model):
    """The fused prologue skips rows with no new token: their caches and conv states stay, as on the reference
    path."""
    (ref_logits, _, ref_after), (logits, before, after) = runs["reference"][2], runs["pallas"][2]
    assert relative_error(logits, ref_logits) < 1e-5
    for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(ref_after), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    pages = before.page_table[1]
    for layer, old, new in zip(range(len(after.layers)), before.layers, after.layers):
        for name in ("k_conv", "v_conv"):
            np.testing.assert_array_equal(getattr(new, name)[1], getattr(old, name)[1])
            assert not np.array_equal(getattr(new, name)[0], getattr(old, name)[0])
        rows = 1 if model.config.text.is_local(layer) else pages  # the ring of row 1, or its pages
        np.testing.assert_array_equal(new.k[rows], old.k[rows])
        np.testing.assert_array_equal(new.v[rows], old.v[rows])


def test_gradients_through_the_kernels_match(model):
    """Training on GPU differentiates through the flash attention and ShortConv kernels."""
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 24)).astype(np.int32))

    def loss(m):
        return jnp.sum(m(ids)[0, :, :64] ** 2)

    grads = {name: nnx.jit(nnx.grad(loss))(with_backend(model, backend)) for name, backend in BACKENDS.items()}
    pairs = list(zip(jax.tree.leaves(grads["pallas"]), jax.tree.leaves(grads["reference"])))
    assert len(pairs) > 50
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
