"""Prompt logprobs from the engine's prefill equal the model's own full forward (`model(ids)`, float32): over
several chunks of a long prompt, with the prompt's prefix already in the prefix cache, beside generation
requests in the same steps, and with max_tokens 0 (only the prompt scored)."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner import prompt_logprobs
from tests.backends import REFERENCE
from tests.serve.logprobs import model_logprobs

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
RNG = np.random.default_rng(5)
TOP = 3


@pytest.fixture(scope="module")
def engine():
    engine = Engine(random_model(CONFIG, seed=0, backend=REFERENCE), EngineConfig(
        max_num_seqs=3, max_model_len=64, max_num_batched_tokens=32, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(2, 4), num_pages=24, num_snapshots=8), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    # The same weights, unfused (the engine fuses its projections).
    engine.reference = random_model(CONFIG, seed=0, backend=REFERENCE)
    yield engine
    engine.shutdown(drain_seconds=0)


def check(engine, prompt, scored):
    """The engine's prompt logprobs of `prompt` are the reference's: each token's logprob, rank and top ones."""
    expected = model_logprobs(engine.reference, prompt)
    assert [s.token_id for s in scored] == prompt[1:]
    got = np.array([s.logprob for s in scored])
    want = expected[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for position, s in enumerate(scored):
        row = expected[position]
        mine = row[s.token_id]
        assert 1 + np.sum(row > mine + 1e-5) <= s.rank <= 1 + np.sum(row > mine - 1e-5)  # (up to near-ties)
        ids, logprobs = zip(*s.top)
        np.testing.assert_allclose(logprobs, np.sort(row)[::-1][:TOP], rtol=0, atol=1e-5)
        np.testing.assert_allclose(row[list(ids)], logprobs, rtol=0, atol=1e-5)
        if s.token_id == s.top[0][0]:
            assert s.logprob == s.top[0][1]  # read from the same array: a greedy token's logprob is the best one


def scored(engine, prompts, max_tokens=0):
    params = SamplingParams(prompt_logprobs=TOP, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return generate(engine, prompts, params)


def test_prompt_logprobs_over_chunks_equal_the_models_forward(engine):
    prompts = [RNG.integers(0, 256, n).tolist() for n in (45, 17, 2)]  # 45: three chunks of a prefill
    for prompt, result in zip(prompts, scored(engine, prompts)):
        assert result.token_ids == [] and result.finish_reason == "length"
        check(engine, prompt, result.prompt_logprobs)
    one = scored(engine, [[7]])[0]
    assert one.prompt_logprobs == [] and one.finish_reason == "length"  # a first token has no logprob


def test_a_cached_prefix_is_recomputed_for_its_logprobs(engine):
    prompt = RNG.integers(0, 256, 41).tolist()
    generate(engine, [prompt], SamplingParams(max_tokens=2))  # leaves the prompt's pages and a snapshot cached
    hits = engine.metrics._hits
    generate(engine, [prompt], SamplingParams(max_tokens=2))
    assert engine.metrics._hits > hits  # the prefix really is cached
    hits = engine.metrics._hits
    result = scored(engine, [prompt], max_tokens=3)[0]
    assert engine.metrics._hits == hits and len(result.token_ids) == 3
    check(engine, prompt, result.prompt_logprobs)


def test_prompt_logprobs_beside_generation_requests(engine):
    prompts = [RNG.integers(0, 256, n).tolist() for n in (30, 12, 25, 9)]
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [generate(engine, [p], plain)[0].token_ids for p in prompts[1:]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        scoring = pool.submit(scored, engine, prompts[:1], 4)
        generating = [pool.submit(generate, engine, [p], plain) for p in prompts[1:]]
        result = scoring.result(timeout=300)[0]
        together = [g.result(timeout=300)[0].token_ids for g in generating]
    check(engine, prompts[0], result.prompt_logprobs)
    assert together == alone
    assert result.token_ids == generate(engine, prompts[:1], plain)[0].token_ids[:4]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_sequence_entering_a_used_slot_sees_nothing_of_its_previous_occupant(engine):
    """The slot's ShortConv states start at zero for each new sequence (they once carried the last inputs of the
    sequence before): the first token's logprob is the model's own."""
    first, second = (RNG.integers(0, 256, 3).tolist() for _ in range(2))
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=0, ignore_eos=True)
    generate(engine, [first], params)
    result = generate(engine, [second], params)[0]  # the slot the first one freed
    expected = model_logprobs(engine.reference, second)[-1]
    assert result.token_ids == [int(np.argmax(expected))]
    np.testing.assert_allclose(result.logprobs, [expected.max()], rtol=0, atol=1e-6)


def test_positions_are_scored_block_by_block_as_all_at_once():
    """`score_positions` over 6 blocks of 256 positions equals `score` of every position's logits at once."""
    hidden = jax.random.normal(jax.random.key(0), (3, 512, 8))
    weight = jax.random.normal(jax.random.key(1), (8, 50))
    targets = jnp.asarray(RNG.integers(-1, 50, (3, 512)), jnp.int32)
    head = lambda h: h @ weight  # noqa: E731
    np.testing.assert_array_equal(prompt_logprobs.score_positions(head, hidden, targets, TOP),
                                  prompt_logprobs.score(head(hidden), targets, TOP))
