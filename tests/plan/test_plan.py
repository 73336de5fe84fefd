"""The memory plan against the arrays it describes: its weights (one probe layer per kind, counted per layer)
equal a real model's parameter bytes, whole and per device of a mesh of the 8 simulated CPU devices, in plain and
serving forms; its KV pages, rings and ShortConv states equal an allocated cache's, as the server places them; a
training plan's masters, moments, frozen weights and biases equal a real `Trainer` state's; the command says
whether a plan fits and refuses a mesh that does not use the devices; the step compiled ahead of time takes as
arguments exactly the state the plan counts."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from inkling_jax import preset
from inkling_jax.nn.model import InklingModel
from inkling_jax.parallel.mesh import make_mesh
from inkling_jax.parallel.placement import shard_model
from plan.__main__ import main
from plan.aot import compare
from plan.serving import served_config, serving_plan
from plan.training import training_plan
from plan.weights import abstract_mesh, bytes_by_kind, kind_of, model_weights
from inkling_jax.quant import QuantConfig, serving_view
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.runner.placement import Placement
from serve.runner.speculative import cache_layout, drafter_layers, init_serving_cache
from train.state import seeded_params
from train.step import StepConfig, Trainer

SIZES = {"fsdp": 2, "tensor": 2, "expert": 2}


def device0_bytes(tree) -> int:
    """Bytes of the shards of `tree`'s arrays that the first device holds."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def real_by_kind(model, per_device: bool) -> dict[str, int]:
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            x = var.get_value()
            kind = kind_of(path, x.ndim)
            out[kind] = out.get(kind, 0) + (device0_bytes(x) if per_device else x.nbytes)
    return out


@pytest.mark.parametrize("name,quant", [("tiny", None), ("inkling-tiny", QuantConfig("fp8", "fp8"))])
def test_weights_equal_a_real_models_whole_and_per_device(name, quant):
    config = preset(name)
    model = InklingModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if quant is not None:
        model = serving_view(model, quant, fuse=False)
    weights = model_weights(config, jnp.bfloat16, quant)
    assert bytes_by_kind(weights) == real_by_kind(model, per_device=False)
    assert any(w.count > 1 for w in weights)  # the probe stands for several layers of a kind
    placed = shard_model(model, make_mesh(SIZES))
    assert bytes_by_kind(weights, abstract_mesh(SIZES)) == real_by_kind(placed, per_device=True)


@pytest.mark.parametrize("speculative, depths", [(None, 0), (SpeculativeConfig("draft", 3), 0),
                                                 (SpeculativeConfig("mtp", 1), 1), (SpeculativeConfig("mtp", 4), 2)])
def test_the_engine_view_holds_and_the_plan_counts_only_the_mtp_depths_it_drafts_with(speculative, depths):
    """`tiny` has 2 MTP depths: an engine that does not draft with the head holds none of it, K drafts read the
    first min(K, 2); the model it was given keeps all of them."""
    config = preset("tiny")
    model = InklingModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    engine = EngineConfig(max_num_seqs=3, max_model_len=64, max_num_batched_tokens=64, chunk_buckets=(1, 16),
                          speculative=speculative)
    view = Placement().model_view(model, engine)
    assert (0 if view.mtp is None else len(view.mtp.layers)) == depths
    assert (0 if view.config.mtp is None else view.config.mtp.num_layers) == depths
    assert len(model.mtp.layers) == config.mtp.num_layers == 2
    held = real_by_kind(view, per_device=False)
    assert ("MTP head" in held) == (depths > 0)
    weights = model_weights(served_config(config, engine), jnp.bfloat16, QuantConfig(), fuse=True)
    assert bytes_by_kind(weights) == held


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("mtp", 2)])
def test_kv_rings_and_states_equal_an_allocated_cache_as_the_server_places_it(speculative):
    """With the MTP head drafting 2 tokens, its depths 0 (sliding) and 1 (full) are in the cache too, and the
    rings hold 2 slots past the window."""
    config = preset("tiny")  # sliding layers' 2 KV heads split over tensor=2, the full layer's 1 does not
    engine = EngineConfig(max_num_seqs=3, max_model_len=64, max_num_batched_tokens=64, chunk_buckets=(1, 16),
                          speculative=speculative)
    mesh = make_mesh({"tensor": 2}, jax.devices()[:2])
    plan = serving_plan(config, abstract_mesh({"tensor": 2}), engine, QuantConfig(), allocator_bytes=2**30,
                        dtype=jnp.float32)
    pages = 7
    placement = Placement(mesh)
    drafter = drafter_layers(config, speculative)
    texts = (config.text,) if drafter is None else (config.text, drafter)
    make = lambda: init_serving_cache(config.text, drafter, engine.num_rows,  # noqa: E731  (as the engine does)
                                      engine.max_model_len + engine.lookahead, jnp.float32,
                                      page_size=engine.page_size, num_pages=pages, ring_slack=engine.ring_slack)
    cache = placement.create(make, placement.cache_shardings(texts, jax.eval_shape(make)))
    layout = cache_layout(config.text, drafter)
    assert len(cache.layers) == layout.num_layers == config.text.num_layers + (0 if speculative is None else 2)
    full = [layer for i, layer in enumerate(cache.layers) if not layout.is_local(i)]
    local = [layer for i, layer in enumerate(cache.layers) if layout.is_local(i)]
    assert device0_bytes([(x.k, x.v) for x in full]) == pages * plan.page_bytes
    assert plan.kv_per_token * engine.page_size == plan.page_bytes
    assert device0_bytes([(x.k, x.v) for x in local]) == plan.state["sliding rings"]
    states = [(x.k_conv, x.v_conv, x.attn_conv, x.mlp_conv) for x in cache.layers]
    assert device0_bytes(states) == plan.state["ShortConv states"]
    assert device0_bytes((cache.lengths, cache.page_table)) == plan.state["lengths and page table"]


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_training_state_equals_a_real_trainers(lora_rank):
    config = preset("tiny")
    mesh = make_mesh(SIZES)
    trainer = Trainer(config, mesh, StepConfig(compute_dtype="bfloat16", lora_rank=lora_rank),
                      compiler_options={"xla_backend_optimization_level": 0})
    state, frozen = trainer.init(seeded_params(config, 0, trainer.param_shardings(), trainer.compiler_options))
    plan = training_plan(config, abstract_mesh(SIZES), dtype=jnp.bfloat16, lora_rank=lora_rank)
    assert plan["trained weights: fp32 masters"] == device0_bytes(state.params)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]  # not the step counters
    assert plan["AdamW moments (2 x fp32)"] == device0_bytes(moments)
    assert plan["frozen weights"] == device0_bytes(frozen)
    assert plan["MoE selection biases (fp32)"] == device0_bytes(state.bias)


def test_the_command_says_whether_it_fits_and_refuses_bad_meshes(capsys):
    serve = ["--preset", "bench", "--devices", "1", "--max-num-seqs", "8", "--max-model-len", "4096"]
    assert main([*serve, "--device-memory-gib", "140"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "| routed experts |" in out
    assert main([*serve, "--device-memory-gib", "24"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    train = ["--preset", "inkling", "--device-memory-gib", "140", "--train", "--seq-len", "4096"]
    assert main([*train, "--devices", "8"]) == 1
    assert main([*train, "--devices", "512", "--mesh", "fsdp=64,expert=8"]) == 0
    with pytest.raises(SystemExit):
        main([*serve, "--device-memory-gib", "140", "--devices", "8", "--mesh", "tensor=2,expert=2"])
    with pytest.raises(SystemExit):  # `bench` has no MTP head to draft with
        main([*serve, "--device-memory-gib", "140", "--speculative-num-draft-tokens", "3"])
    assert "needs a model with an MTP head" in capsys.readouterr().err
    tiny = ["--preset", "tiny", "--devices", "1", "--max-num-seqs", "2", "--max-model-len", "64",
            "--device-memory-gib", "1"]
    assert main(tiny) == 0 and "| MTP head |" not in capsys.readouterr().out
    assert main([*tiny, "--speculative-num-draft-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "| MTP head |" in out and "full-attention layers (2)" in out  # the model's 1 and depth 1


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_compiled_steps_arguments_are_the_plans_state(lora_rank):
    """The AOT cross-check (`plan.aot`) on the tiny preset: what XLA's step takes as arguments, to the
    byte, is what the plan counts as the trainer's state (the towers and MTP head left out: jit drops them)."""
    config = dataclasses.replace(preset("tiny"), vision=None, audio=None, mtp=None)
    rows = compare(config, "fsdp=2,tensor=2,expert=2", lora_rank=lora_rank, micro_batch=8, seq_len=16)
    plan, xla = rows["arguments"]
    assert plan == xla > 0
