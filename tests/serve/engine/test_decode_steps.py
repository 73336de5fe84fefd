"""Several decode steps per device call (the engine's `decode_steps`) give exactly the tokens of one step per
call: greedy, seeded sampling with filters and penalties, rows with different remaining budgets, and stop
tokens that land inside a multi-step call (the tokens after them are discarded)."""

import concurrent.futures
import gc
import re
import time

import numpy as np
import pytest

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate, generate_each
from serve.random_weights import random_model
from tests.backends import REFERENCE

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (5, 21, 11)]
SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=40, frequency_penalty=0.4, seed=7)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(random_model(CONFIG, seed=0, backend=REFERENCE), EngineConfig(
        max_num_seqs=3, max_model_len=64, max_num_batched_tokens=64, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(4,), num_pages=12, decode_steps=4), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    calls = []
    dispatch = engine.runner.dispatch
    engine.runner.dispatch = lambda chunks, **kw: calls.append(max(c.steps for c in chunks)) or dispatch(chunks, **kw)
    engine.calls = calls
    yield engine
    engine.shutdown(drain_seconds=0)


def both(engine, fn, **params):
    """fn's results with one token per device call, then with up to four (same compiled programs)."""
    engine.decode_steps = 1
    single = fn(engine, **params)
    engine.decode_steps = 4
    engine.calls.clear()
    multi = fn(engine, **params)
    assert max(engine.calls) == 4  # several tokens per call really happened
    return single, multi


def run(engine, **params):
    """One request per prompt, submitted at once, with different budgets: rows of one call stop at different
    steps."""
    def one(i):
        params_i = SamplingParams(ignore_eos=True, logprobs=0, max_tokens=9 + i, **params)
        return generate(engine, [PROMPTS[i]], params_i)[0]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def run_together(engine, **params):
    """All prompts in one request (one sequence each, decoded in the same steps)."""
    return generate(engine, PROMPTS, SamplingParams(ignore_eos=True, logprobs=0, max_tokens=10, **params))


@pytest.mark.parametrize("params", [dict(temperature=0.0), SAMPLED], ids=["greedy", "seeded"])
def test_multi_step_decode_equals_single_steps(engine, params):
    expected, got = both(engine, run_together, **params)
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids and len(a.token_ids) == 10 and b.finish_reason == "length"
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=1e-5, atol=1e-5)
    expected, got = both(engine, run, **params)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [len(g.token_ids) for g in got] == [9, 10, 11]


def test_stop_token_inside_a_multi_step_call_discards_the_rest(engine):
    engine.decode_steps = 1
    free = run_together(engine, temperature=0.0)
    stop = free[1].token_ids[5]  # sampled at output index 5: inside the second call of four tokens
    expected, got = both(engine, run_together, temperature=0.0, stop_token_ids=(stop,))
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert got[1].finish_reason == "stop" and len(got[1].token_ids) <= 5
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every page came back


def test_a_request_arriving_during_a_decode_run_is_admitted_after_it(engine):
    """A decode run that could go on is not continued while a new request waits: the device call after the
    run in flight prefills the newcomer (continuing would make it wait a whole further run)."""
    engine.decode_steps = 4
    calls = []  # per device call: (continued?, requests admitted)
    dispatch = engine.runner.dispatch
    newcomer = {}

    def watch(chunks, **kw):
        calls.append((any(c.ahead for c in chunks), [c.seq.request_id for c in chunks if c.admitted]))
        if not newcomer and max(c.steps for c in chunks) == 4:  # the first multi-step decode run
            newcomer["call"] = len(calls) - 1
            newcomer["pool"] = pool = concurrent.futures.ThreadPoolExecutor(1)
            newcomer["result"] = pool.submit(generate, engine, [PROMPTS[2]], SamplingParams(max_tokens=3))
            while not engine._inbox:  # submitted, not yet taken by the engine thread
                pass
        return dispatch(chunks, **kw)

    engine.runner.dispatch = watch
    try:
        first = generate(engine, [PROMPTS[0]], SamplingParams(ignore_eos=True, max_tokens=24))[0]
        second = newcomer["result"].result(timeout=60)[0]
    finally:
        engine.runner.dispatch = dispatch
        newcomer["pool"].shutdown()
    assert len(first.token_ids) == 24 and second.finish_reason
    continued, admitted = calls[newcomer["call"] + 1]
    assert not continued and len(admitted) == 1 and admitted != calls[0][1]


def test_requests_submitted_back_to_back_sample_what_each_would_alone_and_time_out_together(engine):
    """`generate_each`: requests with their own seeds and n, in the order given, each choice's tokens those of the
    request generated alone; when time runs out, every request is aborted and its pages come back."""
    engine.decode_steps = 4
    requests = [([prompt], SamplingParams(ignore_eos=True, max_tokens=5, temperature=0.9, seed=seed), None)
                for seed, prompt in zip((1, 2), PROMPTS)]
    together = generate_each(engine, requests, n=2)
    alone = [generate(engine, prompts, params, n=2) for prompts, params, _ in requests]
    assert [[c.token_ids for c in r] for r in together] == [[c.token_ids for c in r] for r in alone]
    assert all(len(c.token_ids) == 5 for r in together for c in r)
    long = [([prompt], SamplingParams(ignore_eos=True, max_tokens=40), None) for prompt in PROMPTS[:2]]
    aborted = []
    abort = engine.abort
    engine.abort = lambda request_id: aborted.append(request_id) or abort(request_id)
    try:
        with pytest.raises(TimeoutError):
            generate_each(engine, long, timeout=0.0)  # (40 tokens cannot be done as they are submitted)
    finally:
        engine.abort = abort
    assert len(set(aborted)) == 2
    deadline = time.monotonic() + 30
    while engine.num_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_requests == 0 and engine.blocks.num_free == engine.blocks.num_blocks


def test_prefill_writes_the_rings_in_place(engine):
    """A prefill chunk reads each sliding layer's ring before it writes the chunk there; XLA must not copy the
    whole ring pool to do that (it did, twice per array and layer: 0.5 ms per sliding layer of the H200's
    32-prompt prefill). Checked in the compiled programs' HLO."""
    ring = engine.runner.cache.layers[0].k  # layer 0 is the sliding one
    rows, window, *rest = ring.shape
    shapes = [",".join(map(str, s)) for s in (ring.shape, (rows * window, *rest))]
    copies = re.compile(r"= \w+\[(" + "|".join(shapes) + r")\]\S* copy\(")
    programs = {key: p for key, p in engine.runner._steps.items() if isinstance(key, tuple) and key[1] > 1}
    assert programs
    for key, program in programs.items():
        assert not copies.findall(program.as_text()), f"the prefill program {key} copies a ring pool"


def test_a_started_engine_keeps_its_warm_objects_out_of_full_collections(engine):
    assert gc.get_freeze_count() > 10_000  # the model, programs and caches alive at the end of warm-up


def test_decode_buckets_compile_both_samplers_and_prefill_buckets_the_full_one(engine):
    assert set(engine.runner._steps) == {(4, 1, False), (4, 1, True), (4, 16, True)}
    engine.decode_steps = 4
    plain = generate(engine, PROMPTS, SamplingParams(ignore_eos=True, max_tokens=6, temperature=0.8, seed=3))
    full = generate(engine, PROMPTS, SamplingParams(ignore_eos=True, max_tokens=6, temperature=0.8, seed=3,
                                                    logprobs=0))
    assert [p.token_ids for p in plain] == [f.token_ids for f in full]


def test_the_device_waits_for_the_host_only_between_steps_not_queued_ahead(engine):
    engine.decode_steps = 4
    count = lambda: engine.metrics.registry.get_sample_value("inkling_device_wait_seconds_count")  # noqa: E731
    prompt = RNG.integers(0, 256, 40).tolist()  # chunks of 16, 16 and 8, then decode runs of 4 tokens
    before = count()
    generate(engine, [prompt], SamplingParams(ignore_eos=True, max_tokens=9))
    # Each chunk after the first and each decode run were queued before the step before them was read.
    assert count() - before == 0
    before = count()
    generate(engine, [prompt], SamplingParams(ignore_eos=True, max_tokens=9, prompt_logprobs=0))
    # Chunks that compute prompt logprobs are applied once read: the second and third chunks and the first decode
    # run waited for the host to read the step before.
    assert count() - before == 3
