"""Mixed steps (`EngineConfig.mixed_steps`): a step of decodes and one prompt chunk (or, with `mixed_prefill_rows`,
several) runs as one program, and the engine's outputs (greedy tokens, logprobs, the routing record) equal those of
the engine that runs such steps as a decode program and a prefill program."""

import collections
import logging
import re

import numpy as np
import pytest

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner import warm_up
from tests.backends import REFERENCE

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))  # sliding + dense, full + MoE
RNG = np.random.default_rng(5)
# Four slots for five prompts, a budget of two 16-token chunks beside the decodes: after the two short prompts, the
# long ones are prefilled chunk by chunk, side by side, while the others decode; the last one alone.
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (5, 9, 40, 23, 30)]


def sharp_model():
    """Random weights with the head 100 times larger: a random model's logits are nearly flat, which hides
    differences in the hidden states from the logprobs (a lost ShortConv state moved them by 5e-6)."""
    model = random_model(CONFIG, seed=3, backend=REFERENCE)
    model.unembed.set_value(model.unembed.get_value() * 100)
    return model


def run(mixed_steps: bool, **config):
    """The engine's outputs, its mixed steps (by shape: (decode rows, chunk rows) -> steps) and its metric."""
    engine = Engine(sharp_model(), EngineConfig(
        max_num_seqs=4, max_model_len=64, max_num_batched_tokens=48, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(1, 2, 5), num_pages=30, decode_steps=2, prefix_caching=False, full_sampler_only=True,
        score_prompts=False, record_experts=True, mixed_steps=mixed_steps, **config), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    shapes = collections.Counter()
    for (rows, chunk_rows, full), program in list(engine.runner._mixed.items()):
        engine.runner._mixed[rows, chunk_rows, full] = counted(program, shapes, (rows, chunk_rows))
    try:
        outputs = generate(engine, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True))
        metric = engine.metrics.registry.get_sample_value("inkling_mixed_steps_total")
        return outputs, shapes, metric
    finally:
        engine.shutdown(drain_seconds=0)


def counted(program, shapes: collections.Counter, shape):
    def call(*args):
        shapes[shape] += 1
        return program(*args)
    return call


def assert_same(outputs, expected):
    for got, want in zip(outputs, expected, strict=True):
        assert got.token_ids == want.token_ids and len(got.token_ids) == 8
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)


@pytest.fixture(scope="module")
def two_programs():
    return run(mixed_steps=False)


def test_mixed_steps_give_the_outputs_of_two_programs(two_programs):
    outputs, shapes, metric = run(mixed_steps=True, mixed_prefill_rows=(1,))
    assert sum(shapes.values()) >= 2 and metric == sum(shapes.values())  # chunks of long prompts rode along
    assert {chunk_rows for _, chunk_rows in shapes} == {1}  # one chunk a mixed step
    expected, none, _ = two_programs
    assert not none
    assert_same(outputs, expected)


def test_several_prompt_chunks_ride_along_in_the_program_of_the_fewest_rows_that_hold_them(two_programs,
                                                                                          monkeypatch, caplog):
    """With mixed programs of 1 and 2 chunk rows (the default here: the smallest row bucket and the most rows of
    the largest chunk that the budget holds), the two long prompts prefilled side by side beside the decodes run in
    the 2-row ones. Each mixed program compiles with the options of its decode rows and chunk tokens
    (`compile_options`' key). Told to report at every program, the warm-up logs each one traced, and at the end
    the slowest compilations."""
    compiled = []
    options = warm_up.compile_options
    monkeypatch.setattr(warm_up, "compile_options", lambda key: compiled.append(key) or options(key))
    monkeypatch.setattr(warm_up, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger=warm_up.__name__):
        outputs, shapes, metric = run(True)
    progress = [int(r.getMessage().split()[1]) for r in caplog.records if r.getMessage().startswith("warm-up: ")]
    assert progress == list(range(1, len(compiled) + 1))
    (slowest,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slowest to compile")]
    assert len(re.findall(r" \d+\.\ds(, |$)", slowest)) == warm_up.SLOWEST_LOGGED
    assert any(chunk_rows == 2 for _, chunk_rows in shapes) and metric == sum(shapes.values())
    assert_same(outputs, two_programs[0])
    assert {key[1:3] for key in compiled if key[0] == "mixed"} == {(r, t) for r in (1, 2, 5) for t in (16, 32)}
