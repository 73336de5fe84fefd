"""The OpenAI request schema (with the usual vLLM extensions) and OpenAI-style errors.

Schema violations become 400 responses naming the parameter; unknown fields are ignored, as vLLM does. Types
are strict, as in OpenAI's schema (`true` is no token id, `"2"` no count), and text must be text (a lone UTF-16
surrogate, which JSON can spell and UTF-8 cannot, is refused here rather than failing in the tokenizer). The
sampling fields are `SamplingParams`' own, under its names: typed here, checked by its constructor, which the
schema calls as it parses a body (`SamplingFields.sampling_values`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from serve.engine.sampling_params import InvalidParams, SamplingParams

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


class APIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status (always 4xx for a client's mistake)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error this server answers, whatever its status (`APIError.body`)."""

    error: ErrorDetail


ERROR_RESPONSES = {status: {"model": ErrorBody, "description": description} for status, description in (
    (400, "a malformed request, or one over this server's limits"),
    (401, "a missing or wrong API key"),
    (404, "an unknown model"),
    (413, "a request body over --max-body-mb"),
    (429, "too many requests waiting; see Retry-After"),
    ("default", "any other error (500: a server fault, 503: shutting down)"))}
GENERATION_RESPONSES = {200: {"description": "the completion; with `stream: true`, server-sent events of its chunks "
                              "ending with `data: [DONE]`", "content": {"text/event-stream": {}}}, **ERROR_RESPONSES}

_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str) -> str:
    if _SURROGATE.search(value):
        raise ValueError("holds a lone UTF-16 surrogate, which is not text")
    return value


Text = Annotated[str, AfterValidator(_text)]
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. A sampling field left out (or null) keeps `SamplingParams`' default."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: Text
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Union[Text, list[Text], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt tokens' logprobs and this many top ones
    logit_bias: dict[str, float] | None = None
    user: Text | None = None

    @model_validator(mode="after")
    def _valid_sampling(self):
        SamplingParams(**self.sampling_values())  # raises InvalidParams: a schema error naming the field
        return self

    def sampling_values(self) -> dict:
        """The `SamplingParams` fields this request sets, by name."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS
                  if name in type(self).model_fields and getattr(self, name) is not None}
        if "stop" in values:
            values["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        return values


class CompletionRequest(SamplingFields):
    prompt: Union[Text, list[int], list[Text], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: Text | None = None

    def sampling_values(self) -> dict:
        """`echo` with `logprobs` also asks for the prompt's logprobs, as many top ones (where `prompt_logprobs`
        does not say otherwise), as OpenAI's legacy API and vLLM read it."""
        values = super().sampling_values()
        if self.echo and self.logprobs is not None:
            values.setdefault("prompt_logprobs", self.logprobs)
        return values


class ImageURL(BaseModel):
    model_config = STRICT
    url: Text
    detail: Text | None = None


class InputAudio(BaseModel):
    model_config = STRICT
    data: Text
    format: Text = "wav"


class ContentPart(BaseModel):
    """A text, image_url (base64 data URL) or input_audio (base64 wav) part."""

    model_config = STRICT
    type: Text = Field(examples=["text", "image_url", "input_audio"])
    text: Text | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ContentPart], None] = None
    name: Text | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: Union[Text, float, None] = None
    tools: list[dict] | None = None
    tool_choice: Union[Text, dict, None] = None
    functions: list[dict] | None = None  # the older names of tools and tool_choice
    function_call: Union[Text, dict, None] = None
    response_format: dict | None = None

    def sampling_values(self) -> dict:
        """Chat's API names two of them its own way: max_completion_tokens (over the older max_tokens), and
        top_logprobs, the count of `logprobs`, which is a flag here."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParams("top_logprobs needs logprobs: true", "top_logprobs")
        values = super().sampling_values()
        values["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
        return values


UNION_MEMBERS = re.compile(r"\[|^(str|int|float|bool)$")  # a location part naming a union's alternative


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of the most telling pydantic error, the way OpenAI phrases them: one that our own checks
    raised, else the one that got furthest into the body (of a union's alternatives, the one that nearly fit)."""
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: (isinstance(e.get("ctx", {}).get("error"), ValueError), len(e.get("loc", ()))))
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, InvalidParams):  # `SamplingParams`' own check, run as the body was parsed
        return str(cause), cause.param
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not UNION_MEMBERS.search(str(part))]
    param = ".".join(location) or None
    message = str(cause) if isinstance(cause, ValueError) else first.get("msg", "invalid value")
    return (f"{param}: {message}" if param else message), param
