"""Routing replay's record (`EngineConfig.record_experts`): every finished sequence carries the experts each MoE
layer chose at each of its positions, equal to the model's own forward over the whole sequence: through chunked
prefill, multi-step decode runs whose rows stop inside a run, and prefix-cache hits (whose positions carry the
choice of the computation that filled the pages). An engine that does not record keeps no record."""

import concurrent.futures

import numpy as np
import pytest
from flax import nnx

from inkling_jax import preset
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.serve.logprobs import padded

CONFIG = preset("tiny").replace(num_layers=3, local_layer_ids=(0,), dense_layer_ids=(0,))  # two MoE layers
RNG = np.random.default_rng(4)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (5, 37, 20)]


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=1, backend=REFERENCE)


def start(model):
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=80, page_size=8,
                                        chunk_buckets=(1, 16), row_buckets=(5,), decode_steps=4,
                                        record_experts=True), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    return engine


CHOICES = nnx.jit(lambda model, ids: model.hidden_states(ids)[1])  # one program (op by op: ~600 small ones)


def forward_choice(model, tokens):
    """[len(tokens), MoE layers, top_k]: the model's choice over the whole sequence at once (padded, so that
    sequences share a program)."""
    chosen = CHOICES(model, padded(tokens))
    return np.stack([np.asarray(ids)[:len(tokens)] for ids in chosen], axis=1)


def test_the_record_equals_the_forward_choice(model):
    engine = start(model)
    try:
        def one(i):
            params = SamplingParams(max_tokens=6 + 3 * i, temperature=1.0, seed=i, ignore_eos=True)
            return generate(engine, [PROMPTS[i]], params, n=2)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = [list(zip([PROMPTS[i]] * 2, out)) for i, out in enumerate(pool.map(one, range(len(PROMPTS))))]
        hits = lambda: engine.metrics.registry.get_sample_value("inkling_prefix_cache_hit_tokens_total")  # noqa: E731
        before = hits()
        again = generate(engine, [PROMPTS[1]], SamplingParams(max_tokens=3, seed=9, ignore_eos=True))[0]
        assert hits() > before  # its prompt's first pages came from the earlier requests' prefill
        # A stop id inside a decode run: the step queued behind it had its row (computed for nothing, not recorded).
        stop = results[2][0][1].token_ids[5]
        stopped = generate(engine, [PROMPTS[2]], SamplingParams(max_tokens=12, temperature=1.0, seed=2,
                                                                  stop_token_ids=(stop,)))[0]
        assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 12
        # (the stop id is not among the output's tokens, but the record covers the position that sampled it)
        for prompt, result in [pair for pairs in results for pair in pairs] + [(PROMPTS[1], again),
                                                                               (PROMPTS[2], stopped)]:
            tokens = prompt + result.token_ids + ([stop] if result.finish_reason == "stop" else [])
            recorded = result.routed_experts
            assert recorded.shape == (len(tokens) - 1, 2, CONFIG.text.num_experts_per_tok)
            assert recorded.dtype == np.int32
            np.testing.assert_array_equal(recorded, forward_choice(model, tokens)[:-1])
    finally:
        engine.shutdown(drain_seconds=0)


def test_an_engine_that_does_not_record_has_no_record(model):
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, page_size=8, chunk_buckets=(1, 16)),
                    eos_token_id=CONFIG.eos_token_id)  # not started: nothing compiles
    assert engine.runner.routing is None and engine.runner.programs.routing_page_size is None


def test_recording_needs_moe_layers_and_no_speculation():
    dense = CONFIG.replace(dense_layer_ids=(0, 1, 2))
    with pytest.raises(ValueError, match="no MoE layer"):
        Engine(random_model(dense, seed=0, backend=REFERENCE), EngineConfig(
            max_num_seqs=2, max_model_len=32, page_size=8, chunk_buckets=(1, 16), record_experts=True),
            eos_token_id=CONFIG.eos_token_id)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(record_experts=True, speculative=SpeculativeConfig("mtp", 2))
