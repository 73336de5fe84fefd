"""Steps queued before the step in flight is read (`serve.engine.steps_ahead`) change no output: the engine gives
the tokens, logprobs and finish reasons of the same engine reading every step before it schedules the next, with
prompt chunks and decodes in mixed steps, sequences ending on a stop id or EOS while the step behind holds their
rows, seeded sampling with penalties, and prefix-cache hits on snapshots saved behind a step applied ahead; and
every page comes back."""

import contextlib
from unittest import mock

import numpy as np
import pytest

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from tests.backends import REFERENCE

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
RNG = np.random.default_rng(11)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (5, 9, 40, 23, 30)]
SHARED = PROMPTS[2][:32]  # four pages of the 40-token prompt: a prefix hit on its snapshot
GREEDY = dict(temperature=0.0, logprobs=2)
SAMPLED = dict(temperature=0.9, top_k=40, frequency_penalty=0.5, presence_penalty=0.3, seed=5, logprobs=1)


def model():
    weights = random_model(CONFIG, seed=4, backend=REFERENCE)
    weights.unembed.set_value(weights.unembed.get_value() * 30)  # logits far from flat: a wrong state shows
    return weights


def run(ahead: bool):
    """Per load: the outputs, the device waits, and whether every page is free after it; and the prefix-cache hits.
    Not `ahead`: nothing is queued behind a step in flight."""
    engine = Engine(model(), EngineConfig(
        max_num_seqs=4, max_model_len=64, max_num_batched_tokens=48, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(1, 2, 5), num_pages=40, decode_steps=2, full_sampler_only=True, score_prompts=False,
        num_snapshots=8), eos_token_id=CONFIG.eos_token_id)
    waits = lambda: engine.metrics.registry.get_sample_value("inkling_device_wait_seconds_count")  # noqa: E731
    engine.start()
    results = []
    try:
        with contextlib.ExitStack() as stack:
            if not ahead:  # each step read before the next is scheduled
                stack.enter_context(mock.patch.object(Engine, "_apply_ahead", lambda self, chunks: False))
                stack.enter_context(mock.patch.object(Engine, "_queue_next", lambda self, *args: None))
            free = generate(engine, PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))
            stops = (free[1].token_ids[3], free[3].token_ids[6])  # end two sequences early, mid-step
            loads = [(PROMPTS, SamplingParams(max_tokens=10, stop_token_ids=stops, **GREEDY), 1),
                     (PROMPTS, SamplingParams(max_tokens=9, ignore_eos=True, **SAMPLED), 2),
                     ([SHARED + [1, 2, 3], SHARED + [4, 5]], SamplingParams(max_tokens=6, **GREEDY), 1)]
            for prompts, params, n in loads:
                before = waits()
                outputs = generate(engine, prompts, params, n=n)
                results.append((outputs, waits() - before, engine.blocks.num_free == engine.blocks.num_blocks))
            hits = engine.metrics.registry.get_sample_value("inkling_prefix_cache_hit_tokens_total")
    finally:
        engine.shutdown(drain_seconds=0)
    return results, hits


@pytest.fixture(scope="module")
def applied_once_read():
    return run(ahead=False)


def test_steps_queued_ahead_give_the_outputs_of_steps_applied_once_read(applied_once_read):
    (results, hits), (expected, expected_hits) = run(ahead=True), applied_once_read
    for (outputs, waits, pages_back), (want, want_waits, _) in zip(results, expected, strict=True):
        for got, ref in zip(outputs, want, strict=True):
            assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
            np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
        assert pages_back
        assert waits < want_waits  # the device waited for the host between fewer steps
    stopped = [o.finish_reason for o in results[0][0]]
    assert stopped.count("stop") >= 2 and "length" in stopped
    assert hits == expected_hits and hits >= 2 * len(SHARED)  # both shared prompts hit the snapshot
