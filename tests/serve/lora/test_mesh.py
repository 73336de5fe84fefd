"""LoRA adapters served on a device mesh of 8 simulated CPU devices (tensor=2, expert=4): rows of the base and of
three adapters in one batch of the engine each get the greedy tokens of the one-device model with its adapter merged
in, the adapters' products by the jnp reference (partitioned by XLA); the adapter arrays are whole on all 8
devices, and putting adapters in slots after warm-up builds no program. The Pallas kernels (interpreted; XLA
gathers their operands) give the merged models' logits on the same mesh. Adapters on the routed experts are
refused on a mesh with an `expert` axis, and served on one without (tensor=2: checked on the adapted view)."""

import concurrent.futures
import time

import jax
import numpy as np
import pytest

from inkling_jax import Backend, with_backend
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.lora.config import LoRAConfig
from serve.lora.adapters import load_adapter
from serve.lora.view import adapted_modules, adapted_shapes, expert_projections, lora_view, route, write_slot
from serve.offline import generate
from serve.runner.placement import MeshError, Placement
from tests.serve.lora.adapters import CONFIG, base_model, forward, greedy, merged_model, random_adapters, save

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

ALPHA = 16.0
RANKS = {"a": 2, "b": 8, "c": 4}
PROMPT = np.random.default_rng(5).integers(0, 256, 11).tolist()
TOKENS = 5
MESH = "tensor=2,expert=4"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(the base model, adapter name -> (its factors, its path), adapter name (None: the base) -> its greedy
    tokens)."""
    model = base_model()
    factors = {name: random_adapters(model, rank, seed=rank, experts=False) for name, rank in RANKS.items()}
    root = tmp_path_factory.mktemp("lora")
    saved = {name: (f, save(root / f"{name}.safetensors", f, ALPHA)) for name, f in factors.items()}
    expected = {None: greedy(model, PROMPT, TOKENS)}
    expected.update({name: greedy(merged_model(model, f, ALPHA), PROMPT, TOKENS) for name, f in factors.items()})
    assert len({tuple(t) for t in expected.values()}) == len(expected)  # a row with another's adapter would show
    return model, saved, expected


def padded_prompt() -> np.ndarray:
    """PROMPT in the [1, tokens] shape `greedy` compiled the models' forward for."""
    ids = np.zeros((1, len(PROMPT) + TOKENS), np.int32)
    ids[0, :len(PROMPT)] = PROMPT
    return ids


def mesh_engine(model, paths: dict[str, str], experts: bool = False) -> Engine:
    lora = LoRAConfig(modules=tuple(paths.items()), max_loras=len(paths), max_rank=8, experts=experts)
    return Engine(model, EngineConfig(max_num_seqs=4, max_model_len=32, max_num_batched_tokens=80, page_size=8,
                                      chunk_buckets=(1, 16), row_buckets=(5,), decode_steps=2,
                                      prefix_caching=False, lora=lora),  # no snapshot programs to build
                  eos_token_id=CONFIG.eos_token_id, placement=Placement.from_spec(MESH))


def run_one_batch(engine: Engine, order: list) -> list[list[int]]:
    """Each adapter of `order` on PROMPT, all submitted before the engine thread starts: one batch."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
        futures = [pool.submit(generate, engine, [PROMPT], params, adapter=a) for a in order]
        while engine.num_requests < len(order):
            time.sleep(0.01)
        engine.start()
        return [f.result()[0].token_ids for f in futures]


def test_mixed_adapters_on_a_mesh_match_merged_models(adapters):
    model, saved, expected = adapters
    engine = mesh_engine(model, {name: path for name, (_, path) in saved.items()})
    order = [None, "a", "b", "c"]
    try:
        results = run_one_batch(engine, order)
    finally:
        engine.shutdown(drain_seconds=0)
    for adapter, tokens in zip(order, results):
        assert tokens == expected[adapter], adapter
    assert engine.runner.lora.loads == len(RANKS)  # put in their slots after warm-up ...
    built = engine.metrics.registry.get_sample_value("inkling_compilations_after_warmup_total")
    assert built == 0  # ... which built no program: the slots' arrays kept their shardings
    for module in adapted_modules(engine.runner.model):
        for pool in (module.a, module.b, module.scale, module.rows):
            assert len(pool[...].sharding.device_set) == 8 and pool[...].sharding.is_fully_replicated


def test_the_lora_kernels_on_a_mesh_give_the_merged_models_logits(adapters):
    """The adapters' products by the Pallas kernels (interpreted) in the placed view: rows of the base and of the
    three adapters, each the logits of its merged model on one device."""
    model, saved, _ = adapters
    placement = Placement.from_spec(MESH)
    kernels = with_backend(model, Backend.parse("reference,moe=dense,lora=pallas"))
    view = lora_view(placement.model_view(kernels), slots=len(RANKS) + 1, rank=8, mesh=placement.mesh)
    for slot, (name, (_, path)) in enumerate(saved.items(), 1):
        write_slot(view, slot, load_adapter(name, path, adapted_shapes(view), 8))
    route(view, np.arange(len(RANKS) + 1))
    ids = padded_prompt()
    logits = np.asarray(forward(view, np.repeat(ids, len(RANKS) + 1, axis=0)))
    merged = [model] + [merged_model(model, f, ALPHA) for f, _ in saved.values()]
    for row, want in enumerate(merged):
        np.testing.assert_allclose(logits[row], np.asarray(forward(want, ids))[0], rtol=2e-4, atol=2e-4,
                                   err_msg=f"row {row}")


def test_expert_adapters_are_refused_on_an_expert_axis(adapters):
    model, saved, _ = adapters
    with pytest.raises(MeshError, match="--lora-experts is not served on a mesh with an expert axis"):
        mesh_engine(model, {name: path for name, (_, path) in saved.items()}, experts=True)


def test_expert_adapters_on_a_tensor_mesh_match_the_merged_model(adapters, tmp_path):
    """tensor=2 splits the experts' width (and the heads); the adapted MoE runs its routed experts' products and
    their adapters' as XLA partitions them. A row of the base, one of an adapter on every weight."""
    model = adapters[0]
    factors = random_adapters(model, 4, seed=4)
    placement = Placement.from_spec("tensor=2")
    view = lora_view(placement.model_view(model), slots=2, rank=4, experts=True, mesh=placement.mesh)
    write_slot(view, 1, load_adapter("a", save(tmp_path / "a.safetensors", factors, ALPHA), adapted_shapes(view), 4))
    assert not view.layers[1].mlp.moe.w_gate[...].sharding.is_fully_replicated
    assert all(p.a[...].sharding.is_fully_replicated and len(p.a[...].sharding.device_set) == 2
               for p in expert_projections(view))
    ids = padded_prompt()
    route(view, np.array([0, 1]))
    logits = np.asarray(forward(view, np.concatenate([ids, ids])))
    assert np.abs(logits[1] - logits[0]).max() > 1e-2  # the adapter changes the output
    np.testing.assert_allclose(logits[0], np.asarray(forward(model, ids))[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[1], np.asarray(forward(merged_model(model, factors, ALPHA), ids))[0],
                               rtol=2e-4, atol=2e-4)
