"""Serving views (`inkling_jax.quant.serving_view`, the engine's `Placement.model_view`): serving a quantised model
leaves the `InklingModel` the caller passed bit for bit as it was (its graph, every Variable and every array);
views compose (quantised, then fused by the engine, as fusing and quantising at once); a view's kernel-calling
modules run the backend of the modules they were made from, and `with_backend` replaces it in a copy; a form
cannot be turned into another precision; training refuses serving forms by their type."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, preset, with_backend
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.attention import FusedAttention
from inkling_jax.quant.dense_nvfp4 import Nvfp4LinearWithTwin
from inkling_jax.quant.head import Fp8HeadModel
from inkling_jax.quant.moe import ServingMoE
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner.placement import Placement

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
QUANTS = [QuantConfig(), QuantConfig("fp8", "fp8"), QuantConfig("nvfp4", "nvfp4", fp8_twins=True)]
REFERENCE = Backend.parse("reference")  # the MoE and the NVFP4 products by XLA's ragged_dot and formula


def snapshot(model):
    """The graph (module types, static attributes such as `mesh`) and, per Variable, the object, its array and
    that array's bytes."""
    variables = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)]
    return nnx.graphdef(model), [(path, node, node.get_value(), np.asarray(node.get_value()).tobytes(),
                                  node.get_value().dtype, node.get_value().sharding) for path, node in variables]


def assert_unchanged(model, before):
    graph, variables = snapshot(model)
    assert graph == before[0]
    assert len(variables) == len(before[1])
    for (path, node, value, data, dtype, sharding), was in zip(variables, before[1]):
        assert path == was[0] and node is was[1] and value is was[2], path
        assert (data, dtype, sharding) == was[3:], path


@pytest.mark.parametrize("quant", QUANTS)
def test_a_view_leaves_its_model_as_it_was_and_shares_what_it_keeps(quant):
    model = random_model(CONFIG, seed=0, backend=REFERENCE)
    before = snapshot(model)
    view = serving_view(model, quant, fuse=True)
    assert_unchanged(model, before)
    assert view.embed is not model.embed and view.embed[...] is model.embed[...]  # own Variable, the same array
    view(jnp.asarray([[3, 1, 4, 1, 5]]))
    assert_unchanged(model, before)


def test_serving_a_quantised_model_leaves_it_as_it_was():
    """The engine fuses and places its own view of the model it is given (on a mesh where there are 4 devices)."""
    model = serving_view(random_model(CONFIG, seed=1, backend=REFERENCE), QuantConfig("nvfp4", "fp8", fp8_twins=True),
                         fuse=False)
    before = snapshot(model)
    placement = Placement.from_spec("fsdp=2,expert=2" if jax.device_count() >= 4 else None)
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=32, page_size=8,
                                        chunk_buckets=(1, 16), row_buckets=(2,), num_pages=8, decode_steps=2),
                    eos_token_id=CONFIG.eos_token_id, placement=placement)
    engine.start()
    try:
        out = generate(engine, [[3, 14, 15, 92, 65]], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3))
    finally:
        engine.shutdown(drain_seconds=0)
    assert len(out[0].token_ids) == 3
    assert type(engine.runner.model.layers[0].attn).__name__ == "FusedAttention"  # the engine's view is fused
    assert_unchanged(model, before)


def backends(model) -> dict[type, set]:
    """The backends held by the model's kernel-calling modules, by module type."""
    held = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "backend"):
            held.setdefault(type(node), set()).add(node.backend)
    return held


def test_a_view_runs_its_models_backend_and_with_backend_replaces_it_in_a_copy():
    model = random_model(CONFIG, seed=5, backend=REFERENCE)
    view = serving_view(model, QuantConfig("nvfp4", "nvfp4", fp8_twins=True), fuse=True)
    held = backends(view)
    assert {Fp8HeadModel, FusedAttention, ServingMoE, Nvfp4LinearWithTwin} <= held.keys()
    assert all(found == {REFERENCE} for found in held.values())
    before = snapshot(view)
    pallas = with_backend(view, Backend.parse("pallas"))
    assert_unchanged(view, before)
    assert type(pallas) is Fp8HeadModel and backends(pallas) == {kind: {Backend.parse("pallas")} for kind in held}


@pytest.mark.parametrize("quant", QUANTS[1:])
def test_quantising_then_fusing_gives_the_view_fused_at_once(quant):
    """What `load_pretrained(quant=...)` then the engine build equals one view with both (fp8 scales are per
    output column; NVFP4 dense weights are fused before they are quantised either way)."""
    model = random_model(CONFIG, seed=2)
    at_once = serving_view(model, quant, fuse=True)
    in_turn = serving_view(serving_view(model, quant, fuse=False), fuse=True)
    assert nnx.graphdef(in_turn) == nnx.graphdef(at_once)
    for a, b in zip(jax.tree.leaves(nnx.state(in_turn)), jax.tree.leaves(nnx.state(at_once))):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_quantised_form_is_not_quantised_again_to_another_precision():
    view = serving_view(random_model(CONFIG, seed=3), QuantConfig(expert_precision="fp8"), fuse=False)
    with pytest.raises(ValueError, match="routed experts held as Fp8RoutedExperts cannot be held in nvfp4"):
        serving_view(view, QuantConfig(expert_precision="nvfp4"))
    with pytest.raises(TypeError, match="quant must be an inkling_jax.quant.QuantConfig, not str"):
        serving_view(view, "fp8")


def test_training_refuses_serving_forms_by_type():
    from train.state import model_params

    model = random_model(CONFIG, seed=4)
    assert model_params(model)  # the model the view was made from trains
    with pytest.raises(ValueError, match=r"layers\.0\.attn: a FusedAttention, a serving form"):
        model_params(serving_view(model, fuse=True))
    with pytest.raises(ValueError, match=r"the model: a Fp8HeadModel, a serving form"):
        model_params(serving_view(model, QuantConfig(dense_precision="fp8"), fuse=False))
