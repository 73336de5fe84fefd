"""The request schema: OpenAI's shapes parse, bad values do not, and the sampling fields reach `SamplingParams`
under its names (chat's own names mapped), checked once as the body is parsed."""

import pytest
from pydantic import ValidationError

from serve.engine.sampling_params import InvalidParams, SamplingParams
from serve.http.protocol import ChatRequest, CompletionRequest, validation_message

HI = [{"role": "user", "content": "hi"}]


def test_schema_rejects_bad_values_and_accepts_openai_shapes():
    CompletionRequest(model="m", prompt=[[1, 2], [3]], stop="x", stream_options={"include_usage": True})
    ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                reasoning_effort=0.5, unknown_field=1)
    for bad in (dict(temperature=3), dict(top_p=0), dict(n=0), dict(max_tokens=-1), dict(temperature=float("nan"))):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="x", **bad)
    with pytest.raises(ValidationError):
        ChatRequest(model="m", messages=[])
    with pytest.raises(InvalidParams):
        SamplingParams(stop=("",))


def test_a_bad_sampling_value_is_an_error_naming_its_field():
    for make, field in ((lambda: CompletionRequest(model="m", prompt="x", presence_penalty=2.5), "presence_penalty"),
                        (lambda: CompletionRequest(model="m", prompt="x", stop=[""]), "stop"),
                        (lambda: ChatRequest(model="m", messages=HI, top_logprobs=2), "top_logprobs")):
        with pytest.raises(ValidationError) as caught:
            make()
        message, param = validation_message(caught.value.errors())
        assert param == field and message.startswith(field), message


def test_sampling_values_are_the_fields_a_request_sets_under_their_names():
    body = CompletionRequest(model="m", prompt="x", top_k=5, stop="end", stop_token_ids=[3], logprobs=2)
    assert body.sampling_values() == dict(top_k=5, stop=("end",), stop_token_ids=(3,), logprobs=2, max_tokens=16,
                                          ignore_eos=False, skip_special_tokens=True)
    chat = ChatRequest(model="m", messages=HI, max_tokens=9, max_completion_tokens=4, logprobs=True, top_logprobs=3)
    assert chat.sampling_values() == dict(max_tokens=4, logprobs=3, ignore_eos=False, skip_special_tokens=True)
    assert ChatRequest(model="m", messages=HI, logprobs=True).sampling_values()["logprobs"] == 0
    assert ChatRequest(model="m", messages=HI).sampling_values()["logprobs"] is None
