"""Speculative decoding in the engine (greedy): outputs equal plain greedy decoding token for token, with the MTP
head's own drafts and with an oracle that proposes the target's greedy tokens with wrong ones at chosen output
positions (so rows accept different lengths, and rounds reject at chosen places); after such rounds every kind of
state in the cache (full-layer KV, sliding rings, ShortConv states, the MTP depths' KV and ShortConv states) equals
that of a plain prefill of the accepted tokens. Prompts and outputs cross the window (16) and the full layers'
relative extent (24)."""

import re

import numpy as np
import pytest

from inkling_jax import preset
from inkling_jax.generate import StepFunctions
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner.drafters import OracleDrafter
from tests.backends import REFERENCE
from tests.greedy import greedy_tokens

pytestmark = pytest.mark.heavy  # see conftest.py

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), sliding_window=16,
                                rel_extent=24)  # with the `tiny` MTP head: depth 0 sliding, depth 1 full
RNG = np.random.default_rng(5)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (5, 21, 11)]
NEW = 26  # output tokens: the longest prompt ends past position 40
WRONG_AT = frozenset({2, 3, 7, 11, 12, 17})  # output indices where the oracle proposes a wrong token
ENGINE = dict(max_num_seqs=3, max_model_len=80, max_num_batched_tokens=64, page_size=8, chunk_buckets=(1, 16),
              row_buckets=(4,))


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=0, backend=REFERENCE)


@pytest.fixture(scope="module")
def greedy(model):
    """prompt -> its plain greedy continuation (the model's full-sequence forward), a few tokens past NEW."""
    return {tuple(p): greedy_tokens(model, p, NEW + 8) for p in PROMPTS}


def start(model, method, k, oracle=None, draft_model=None, **changes):
    engine = Engine(model, EngineConfig(**{**ENGINE, **changes}, speculative=SpeculativeConfig(method, k)),
                    eos_token_id=CONFIG.eos_token_id, oracle=oracle, draft_model=draft_model)
    engine.start()
    return engine


def greedy_params(**changes):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, **changes})


@pytest.fixture(scope="module")
def forced(model, greedy):
    """The MTP head's state kept as usual, the drafts from an oracle that is wrong at WRONG_AT; few pages (so
    sequences are preempted) and no prefix cache (the state test compares with a fresh prefill)."""
    oracle = OracleDrafter(greedy, WRONG_AT, CONFIG.text.unpadded_vocab_size)
    engine = start(model, "mtp", 4, oracle, num_pages=14, prefix_caching=False)
    yield engine
    engine.shutdown(drain_seconds=0)


def test_mtp_drafts_give_the_greedy_tokens(model, greedy):
    engine = start(model, "mtp", 1)  # the head's own (random: mostly rejected) drafts
    try:
        # depth 0 alone, in the cache and the engine's view: a chain of one draft reads no other
        assert len(engine.runner.cache.layers) == CONFIG.text.num_layers + 1
        assert len(engine.runner.model.mtp.layers) == 1
        results = generate(engine, PROMPTS, greedy_params())
        assert [r.token_ids for r in results] == [greedy[tuple(p)][:NEW] for p in PROMPTS]
        rounds = [r for result in results for r in result.speculative_rounds]
        assert rounds and all(verified <= 1 for verified, _ in rounds)
        sampled = greedy_params(temperature=0.9, seed=3)  # several rounds per call, each drawn at its own index
        assert [r.token_ids for r in generate(engine, PROMPTS, sampled)] == \
            [r.token_ids for r in generate(engine, PROMPTS, sampled)]
        metrics = engine.metrics.render().decode()
        assert "inkling_spec_mean_acceptance_length" in metrics and 'position="1"' in metrics
    finally:
        engine.shutdown(drain_seconds=0)


@pytest.mark.parametrize("k", range(1, 9))
def test_oracle_drafts_give_the_greedy_tokens(model, greedy, k):
    oracle = OracleDrafter(greedy, WRONG_AT, CONFIG.text.unpadded_vocab_size)
    engine = start(model, "oracle", k, oracle)
    continued = []  # per run of rounds: whether it continued one still in flight (from its carry, on device)
    run_decode = engine.runner.run_decode
    engine.runner.run_decode = lambda *a, first=0, **kw: continued.append(first == 1) or run_decode(
        *a, first=first, **kw)
    try:
        results = generate(engine, PROMPTS, greedy_params())
    finally:
        engine.shutdown(drain_seconds=0)
    assert [r.token_ids for r in results] == [greedy[tuple(p)][:NEW] for p in PROMPTS]
    if k == 1:  # at most 2 tokens a round: the third and fourth runs continue runs still in flight, the fourth's
        # a continuation itself (its carry starts before the tokens the host applied meanwhile)
        assert continued == [False, False, True, True]
    accepted = {a for r in results for _, a in r.speculative_rounds}
    # Rounds rejecting at once, and rounds accepting every draft: after output 17 (wrong) no draft is wrong, and
    # the last round verifies at most 7 (8 outputs remain, one of them the round's own token).
    assert 0 in accepted and max(accepted) == min(k, 7)
    for r in results:  # each round keeps its drafts up to the first wrong one (the later rounds of a run too)
        assert r.speculative_rounds == oracle_rounds(k)
    for r in results:  # the first token comes from the prefill, each round's from its accepted drafts + 1
        assert r.acceptance.mean_length * r.acceptance.rounds == pytest.approx(NEW - 1)


def oracle_rounds(k: int) -> list[tuple[int, int]]:
    """(drafts verified, drafts accepted) of each round of a row that the oracle drafts for, wrong at WRONG_AT."""
    rounds, emitted = [], 1  # the prefill samples output 0
    while emitted < NEW:
        verified = min(k, NEW - emitted - 1)
        accepted = next((j for j in range(verified) if emitted + j in WRONG_AT), verified)
        rounds.append((verified, accepted))
        emitted += accepted + 1
    return rounds


def test_forced_rejections_with_the_head_state_and_preemption(forced, greedy):
    preempted = forced.metrics.preemptions._value.get()
    results = generate(forced, PROMPTS, greedy_params())
    assert [r.token_ids for r in results] == [greedy[tuple(p)][:NEW] for p in PROMPTS]
    assert forced.metrics.preemptions._value.get() > preempted  # 14 pages do not hold the three at once
    rounds = [r for result in results for r in result.speculative_rounds]
    assert {a for _, a in rounds} == set(range(5))  # rows accepted every length from 0 to K


def test_stops_max_tokens_n_and_logprobs_and_prompt_logprobs(forced, model, greedy):
    prompt = PROMPTS[2]
    expected = greedy[tuple(prompt)]
    stop_at = 5  # inside the round that accepts drafts 4 .. 6 (the oracle is wrong at 7)
    stopped = generate(forced, [prompt], greedy_params(stop_token_ids=[expected[stop_at]]))[0]
    assert stopped.token_ids == expected[:expected.index(expected[stop_at])]  # (a stop id is not output)
    assert stopped.finish_reason == "stop"
    short = generate(forced, [prompt], greedy_params(max_tokens=6, logprobs=2), n=2)
    assert [r.token_ids for r in short] == [expected[:6]] * 2 and all(r.finish_reason == "length" for r in short)
    logits = np.asarray(StepFunctions(model).forward([prompt + expected[:6]]))[0, len(prompt) - 1:-1]
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(short[0].logprobs, logprobs[np.arange(6), expected[:6]], rtol=1e-4, atol=1e-4)
    scored = generate(forced, [prompt], greedy_params(max_tokens=6, prompt_logprobs=1))[0]  # the scoring prefill
    assert scored.token_ids == expected[:6] and len(scored.prompt_logprobs) == len(prompt) - 1


def test_seeded_sampling_is_reproducible_and_accepts_likely_drafts(forced, greedy):
    """Rejection sampling in the engine (its distribution: tests/serve/runner/test_rejection.py): a seeded request
    gives the same tokens twice, penalties and filters included; at a temperature so low that the target's
    distribution is a point mass the oracle's drafts (the greedy tokens) are accepted, and the output is the
    greedy one."""
    params = greedy_params(temperature=0.9, top_p=0.95, frequency_penalty=0.2, seed=11, logprobs=1)
    first = generate(forced, PROMPTS[:2], params, n=2)
    again = generate(forced, PROMPTS[:2], params, n=2)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == NEW for r in first)
    cold = generate(forced, PROMPTS, greedy_params(temperature=1e-4, seed=5))
    assert [r.token_ids for r in cold] == [greedy[tuple(p)][:NEW] for p in PROMPTS]
    assert {a for r in cold for _, a in r.speculative_rounds} == set(range(5))


def _row_state(engine, slot: int, length: int) -> dict[str, np.ndarray]:
    """Every state the cache holds for a row of `length` tokens, by kind: the K/V of positions < length in
    full-attention pages, the ring slots of the window's positions, the ShortConv states; the drafter's (MTP
    depths', draft model's) apart."""
    runner = engine.runner
    cache, layout = runner.cache, runner.text
    trunk = CONFIG.text.num_layers
    pages = np.asarray(cache.page_table[slot])
    positions = np.arange(length)
    state = {}
    for i, layer in enumerate(cache.layers):
        owner = "drafter " if i >= trunk else ""
        for name in ("k", "v"):
            pool = np.asarray(getattr(layer, name))
            if layout.is_local(i):  # the rings hold K slots past the window (the model's, its twin's, the head's)
                kept = positions[-CONFIG.text.sliding_window:]
                state[f"{owner}ring {i} {name}"] = pool[slot, kept % pool.shape[1]]
            else:
                page_size = pool.shape[1]
                state[f"{owner}full kv {i} {name}"] = pool[pages[positions // page_size], positions % page_size]
        for name in ("k_conv", "v_conv", "attn_conv", "mlp_conv"):
            state[f"{owner}shortconv {i} {name}"] = np.asarray(getattr(layer, name))[slot]
    return state


def assert_cache_equals_a_plain_prefill(engine, prompt, expected):
    """After `prompt` decoded speculatively, the row's every state equals that of a prefill of its tokens."""
    slot = engine.scheduler.free_slots[-1]  # the slot the next admission takes (the engine is idle)
    generate(engine, [prompt], greedy_params())
    length = int(engine.runner.cache.lengths[slot])
    assert length == len(prompt) + NEW - 1  # every output but the last is in the cache
    spec = _row_state(engine, slot, length)
    # The same tokens prefilled (its one sample is the last output, which the MTP depths' last entry reads).
    assert engine.scheduler.free_slots[-1] == slot
    plain = generate(engine, [prompt + expected[:NEW - 1]], greedy_params(max_tokens=1))[0]
    assert plain.token_ids == [expected[NEW - 1]] and int(engine.runner.cache.lengths[slot]) == length
    reference = _row_state(engine, slot, length)
    assert {key.split()[0] for key in spec} == {"ring", "full", "shortconv", "drafter"}
    for key in spec:
        np.testing.assert_allclose(spec[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_a_round_updates_every_kv_pool_in_place(forced):
    """The compiled rounds hold no copy of a KV pool (ring or pages, the model's or the MTP depths'): the verify
    and the draft chain write them in place, each after every read of what it overwrites."""
    runner = forced.runner
    pools = set()
    for layer in runner.cache.layers:
        rows, slots, *rest = layer.k.shape
        pools |= {(rows, slots, *rest), (rows * slots, *rest)}  # as laid out, and flattened for the scatter
    rounds = [program for (_, tokens, _), program in runner._steps.items() if tokens == 1]
    assert rounds
    for program in rounds:
        copies = re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} copy\(", program.as_text())
        assert not {tuple(map(int, shape.split(","))) for shape in copies} & pools


def test_cache_after_forced_rejections_equals_a_plain_prefill(forced, greedy):
    assert_cache_equals_a_plain_prefill(forced, PROMPTS[1], greedy[tuple(PROMPTS[1])])


def test_a_draft_model_gives_the_greedy_tokens_and_keeps_its_cache_in_step(model, greedy):
    """The draft model is the target's twin (the same weights): its drafts are the greedy tokens, so rounds
    accept them, several rounds per device call; the prefix cache is on (the second pass hits it, snapshots
    holding the draft's state too)."""
    engine = start(model, "draft", 3, draft_model=random_model(CONFIG, seed=0, backend=REFERENCE))
    runs = []  # rounds per device call: up to the engine's decode steps (8), each fed the last one's drafts
    run_decode = engine.runner.run_decode
    engine.runner.run_decode = lambda program, rows, inputs, steps, *a, **kw: runs.append(steps) or run_decode(
        program, rows, inputs, steps, *a, **kw)
    try:
        for _ in range(2):
            results = generate(engine, PROMPTS, greedy_params())
            assert [r.token_ids for r in results] == [greedy[tuple(p)][:NEW] for p in PROMPTS]
        assert max(runs) > 1
        assert min(r.acceptance.mean_length for r in results) > 3.5
        assert engine.metrics.prefix_hits._value.get() > 0
        assert_cache_equals_a_plain_prefill(engine, PROMPTS[1], greedy[tuple(PROMPTS[1])])
        engine.update_params(list(engine.runner.params))  # new arrays (the same values) for target and draft
        assert [r.token_ids for r in generate(engine, PROMPTS, greedy_params())] == \
            [greedy[tuple(p)][:NEW] for p in PROMPTS]
    finally:
        engine.shutdown(drain_seconds=0)


@pytest.mark.parametrize("method,k", [("mtp", 2), ("mtp", 8), ("draft", 8)])  # (above: mtp 1 and 4, draft 3; the
# oracle at every K from 1 to 8 runs the same verify and rollback programs as these methods)
def test_every_number_of_drafts_gives_the_greedy_tokens(model, greedy, method, k):
    """The head's own drafts (random weights: mostly rejected, so rounds roll back) or a twin draft model's (the
    greedy tokens: accepted, up to the end of the output)."""
    twin = random_model(CONFIG, seed=0, backend=REFERENCE) if method == "draft" else None
    engine = start(model, method, k, draft_model=twin)
    try:
        results = generate(engine, PROMPTS, greedy_params())
    finally:
        engine.shutdown(drain_seconds=0)
    assert [r.token_ids for r in results] == [greedy[tuple(p)][:NEW] for p in PROMPTS]
    longest = max(a for r in results for _, a in r.speculative_rounds)
    assert longest == min(k, NEW - 2) if method == "draft" else longest <= k


def test_bad_settings_fail_at_start(model):
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig("mtp", 9)
    with pytest.raises(ValueError, match="sliding window"):
        Engine(random_model(preset("tiny"), seed=0, backend=REFERENCE),  # window 8: at most 7 drafts
               EngineConfig(**ENGINE, speculative=SpeculativeConfig("mtp", 8)), eos_token_id=CONFIG.eos_token_id)
    without_head = random_model(CONFIG.__class__(text=CONFIG.text, eos_token_id=CONFIG.eos_token_id), seed=0,
                                backend=REFERENCE)
    with pytest.raises(ValueError, match="MTP head"):
        Engine(without_head, EngineConfig(**ENGINE, speculative=SpeculativeConfig("mtp", 2)),
               eos_token_id=CONFIG.eos_token_id)
    other_vocabulary = random_model(CONFIG.replace(unpadded_vocab_size=300), seed=0, backend=REFERENCE)
    with pytest.raises(ValueError, match="draft model's vocabulary"):
        Engine(model, EngineConfig(**ENGINE, speculative=SpeculativeConfig("draft", 2)),
               eos_token_id=CONFIG.eos_token_id, draft_model=other_vocabulary)
    with pytest.raises(ValueError, match="need theirs"):
        Engine(model, EngineConfig(**ENGINE, speculative=SpeculativeConfig("draft", 2)),
               eos_token_id=CONFIG.eos_token_id)
