"""One call of the adapted view over rows of different adapters (on attention, the dense MLP, and the routed and
shared experts) gives each row what the model with that adapter merged in gives it, and base rows what the plain
serving view gives them; fused and separate projections alike; with the adapters' products by the jnp reference
(what `tests.backends.REFERENCE` picks) and by the Pallas kernels (interpreted). A call none of whose rows has
adapters on the experts runs the MoE as the plain view does: base rows bit for bit."""

import numpy as np
import pytest

from inkling_jax import Backend, with_backend
from inkling_jax.quant.view import serving_view
from serve.lora.adapters import load_adapter
from serve.lora.view import adapted_shapes, lora_view, route, write_slot
from tests.serve.lora.adapters import base_model, merged_model, random_adapters, save, without_experts

ALPHA = 16.0
RANKS = (2, 8, 4)
IDS = np.random.default_rng(0).integers(0, 256, (5, 9))
KERNELS = Backend.parse("reference,moe=dense,lora=pallas")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = base_model()
    adapters = [random_adapters(model, r, seed=r) for r in RANKS]
    paths = [save(tmp_path_factory.mktemp("lora") / "adapters.safetensors", a, ALPHA) for a in adapters]
    merged = [np.asarray(merged_model(model, a, ALPHA)(IDS)) for a in adapters]
    no_experts = without_experts(adapters[0])  # adapter 0 without its experts' factors
    no_experts_path = save(tmp_path_factory.mktemp("lora") / "adapters.safetensors", no_experts, ALPHA)
    return model, paths, merged, no_experts_path, np.asarray(merged_model(model, no_experts, ALPHA)(IDS))


@pytest.mark.parametrize("fuse", [True, False])
def test_rows_of_different_adapters_match_merged_models(setup, fuse):
    model, paths, merged, no_experts_path, no_experts = setup
    plain = serving_view(model, fuse=fuse)
    view = lora_view(plain, slots=4, rank=8, experts=True)
    shapes = adapted_shapes(view)
    for slot, i in ((1, 2), (2, 1), (3, 0)):  # slot s holds adapter 3 - s: the slot, not the order, decides
        write_slot(view, slot, load_adapter(f"a{i}", paths[i], shapes, max_rank=8))
    route(view, np.array([0, 3, 2, 1, 0]))
    logits = np.asarray(view(IDS))
    base = np.asarray(plain(IDS))
    for row in (1, 2, 3):
        expected = merged[row - 1][row]
        assert np.abs(expected - base[row]).max() > 1e-2  # the adapter changes the output
        np.testing.assert_allclose(logits[row], expected, rtol=2e-4, atol=2e-4, err_msg=f"row {row}")
    assert np.abs(merged[0][1] - no_experts[1]).max() > 1e-2  # so do its experts' factors
    # base rows: the base, their experts computed beside the adapted rows' (the same products, other kernels)
    np.testing.assert_allclose(logits[[0, 4]], base[[0, 4]], rtol=1e-5, atol=1e-5)

    write_slot(view, 3, load_adapter("a0-", no_experts_path, shapes, max_rank=8))  # no row adapts the experts
    route(view, np.array([3, 0, 3, 0, 0]))
    logits = np.asarray(view(IDS))
    np.testing.assert_allclose(logits[[0, 2]], no_experts[[0, 2]], rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(logits[[1, 3, 4]], base[[1, 3, 4]])

    write_slot(view, 3, None)  # the slot emptied serves the base
    route(view, np.full(5, 3))
    np.testing.assert_array_equal(np.asarray(view(IDS)), base)


@pytest.mark.parametrize("tokens", [1, 20])  # the kernels' gathered form (a decode step's shape), the segmented
def test_the_lora_kernels_give_the_references_logits(setup, tokens):
    model, paths, *_ = setup
    plain = serving_view(model, fuse=True)
    view = lora_view(plain, slots=4, rank=8, experts=True)
    shapes = adapted_shapes(view)
    for slot, i in ((1, 2), (2, 1), (3, 0)):
        write_slot(view, slot, load_adapter(f"a{i}", paths[i], shapes, max_rank=8))
    route(view, np.array([0, 3, 2, 1, 3]))
    ids = np.random.default_rng(1).integers(0, 256, (5, tokens))
    logits, reference = np.asarray(with_backend(view, KERNELS)(ids)), np.asarray(view(ids))
    assert np.abs(reference[1:] - np.asarray(plain(ids))[1:]).max() > 1e-2  # the adapters change the output
    np.testing.assert_allclose(logits, reference, rtol=2e-4, atol=2e-4)
    # the base row: the base (its experts computed beside the adapted rows', as in the test above)
    np.testing.assert_allclose(logits[0], np.asarray(plain(ids))[0], rtol=1e-5, atol=1e-5)
