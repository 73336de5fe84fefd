"""The OpenAI request schema (with the usual vLLM extensions) and OpenAI-style errors.

Schema violations become 400 responses naming the parameter; unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status (always 4xx for a client's mistake)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16 or any(not s or len(s) > 256 for s in stops):
            raise APIError(400, "stop takes up to 16 non-empty strings of up to 256 characters", param="stop")
        return tuple(stops)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: str | None = None


class InputAudio(BaseModel):
    model_config = ConfigDict(extra="ignore")
    data: str
    format: str = "wav"


class ContentPart(BaseModel):
    """A text, image_url (base64 data URL) or input_audio (base64 wav) part."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    reasoning_effort: Union[str, float, None] = None
    tools: list[dict] | None = None
    response_format: dict | None = None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of the first pydantic error, the way OpenAI phrases them."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return (f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")), param
