"""Sampling parameters: a bad value names its field; what sends a request to the full sampler; per-choice seeds;
what an engine that compiles less refuses."""

import pytest

from serve.engine.config import EngineConfig
from serve.engine.sampling_params import InvalidParams, SamplingParams


def test_a_bad_value_names_its_field():
    for field, value in (("temperature", 2.5), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                         ("presence_penalty", -3.0), ("repetition_penalty", 0.0), ("max_tokens", -1),
                         ("logprobs", -1), ("stop", ("x",) * 17), ("stop", ("y" * 257,))):
        with pytest.raises(InvalidParams) as caught:
            SamplingParams(**{field: value})
        assert caught.value.param == field and str(caught.value).startswith(field)


def test_only_filters_penalties_and_logprobs_need_the_full_sampler():
    assert not SamplingParams(temperature=0.7, seed=3).needs_full_sampler
    for extra in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(presence_penalty=0.1),
                  dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1), dict(logprobs=0)):
        assert SamplingParams(**extra).needs_full_sampler, extra


def test_each_choice_draws_from_its_own_seed():
    assert [SamplingParams(seed=2**32 - 1).for_choice(i, 5).seed for i in range(3)] == [2**32 - 1, 0, 1]
    assert [SamplingParams().for_choice(i, 5).seed for i in range(2)] == [5, 6]  # unseeded: the engine's draw


def test_an_engine_without_filters_or_prompt_scoring_refuses_requests_that_need_them():
    lean = EngineConfig(sampling_filters=False, score_prompts=False)
    for field, value in (("top_k", 5), ("top_p", 0.9), ("min_p", 0.1), ("prompt_logprobs", 1)):
        with pytest.raises(InvalidParams) as caught:
            lean.check_request(SamplingParams(**{field: value}))
        assert caught.value.param == field
        EngineConfig().check_request(SamplingParams(**{field: value}))  # the default engine takes them
    lean.check_request(SamplingParams(temperature=0.9, seed=1, logprobs=0, presence_penalty=0.2))


def test_prefill_steps_and_full_sampler_engines_run_the_full_sampler_only():
    plain, rollouts = EngineConfig(), EngineConfig(full_sampler_only=True)
    assert plain.samplers(1) == (False, True) and plain.samplers(16) == rollouts.samplers(1) == (True,)
    assert not plain.full_sampler(1, asked=False) and plain.full_sampler(1, asked=True)
    assert plain.full_sampler(16, asked=False) and rollouts.full_sampler(1, asked=False)
