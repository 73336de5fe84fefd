"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (both streaming as
server-sent events, `serve.http.responses`), `/health` and `/metrics`; vLLM's tokenizer routes
(`serve.http.tokenize`).

Every malformed request gets a 4xx with an OpenAI-style error body: the schema's (`serve.http.protocol`), or a
limit of this server's, checked here, each before the work it bounds; anything else a 500 in the same shape
(`serve.http.guards`). Tokenizing, rendering and decoding media run on a few worker threads, off the event
loop, so that a large request never holds up the others or `/health`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from inkling_jax.config.generation import SAMPLING_FIELDS as GENERATION_DEFAULTS
from serve.engine.engine import Engine
from serve.engine.sampling_params import InvalidParams, SamplingParams
from serve.http.chat import ChatError, ChatFormat, ChatOutput
from serve.http.guards import BodyLimit, BodyTooLarge, CatchAll, HostCheck, error_response
from serve.http.lora_routes import lora_router
from serve.http.protocol import (ERROR_RESPONSES, GENERATION_RESPONSES, APIError, ChatRequest, CompletionRequest,
                                 SamplingFields, validation_message)
from serve.http.responses import ChatResponder, CompletionResponder, respond
from serve.http.text_stream import TextOutput
from serve.http.tokenize import check_model, tokenizer_router
from serve.http.tokenizer import Tokenizer, TooLong
from serve.lora.slots import AdapterSlots

MAX_BODY_BYTES = 16 << 20  # default of --max-body-mb
WORKER_THREADS = 4  # requests tokenized, rendered or decoded at once


@dataclasses.dataclass
class Service:
    """What the routes serve, and their limits."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    description: str
    vocab_size: int
    max_prompt_tokens: int
    max_tokens: int
    max_n: int = 16
    api_key: str | None = None
    chat: ChatFormat | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    allowed_hosts: frozenset[str] | None = None  # Host names answered (None: any; see guards.HostCheck)
    # What a request leaves unset (the checkpoint's generation_config.json, where it has one).
    sampling_defaults: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    lora: AdapterSlots | None = None  # the engine's LoRA adapters (`engine.runner.lora`), where it serves some
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))
    workers: concurrent.futures.Executor = dataclasses.field(default_factory=lambda: concurrent.futures.
                                                             ThreadPoolExecutor(WORKER_THREADS, "inkling-http"))

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters a request's `model` may name now."""
        return () if self.lora is None else tuple(self.lora.adapters)

    async def off_loop(self, fn, *args):
        """fn(*args) on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)


def create_app(service: Service, lifespan=None) -> FastAPI:
    app = FastAPI(title="inkling-jax", lifespan=lifespan)
    app.state.service = service
    if service.allowed_hosts is not None:
        app.add_middleware(HostCheck, names=service.allowed_hosts)
    app.add_middleware(BodyLimit, max_bytes=service.max_body_bytes)
    app.add_middleware(CatchAll)  # the outermost: it also answers for the two above
    expected_key = f"Bearer {service.api_key}".encode() if service.api_key else None

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return error_response(exc)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_, exc: BodyTooLarge):
        return error_response(exc.error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    def authorized(request: Request) -> None:
        # Headers arrive as latin-1 text; back to their bytes, compared in constant time.
        sent = request.headers.get("authorization", "").encode("latin-1")
        if expected_key is not None and not hmac.compare_digest(sent, expected_key):
            raise APIError(401, "invalid or missing API key (send `Authorization: Bearer <key>`)",
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not service.engine.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(service.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)], responses=ERROR_RESPONSES)
    async def models():
        base = {"object": "model", "created": service.started, "owned_by": "inkling-jax",
                "max_model_len": service.engine.config.max_model_len}
        return {"object": "list", "data": [{"id": service.model_name, "description": service.description, **base}]
                + [{"id": name, "parent": service.model_name, **base} for name in service.adapters]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)], responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        adapter = _adapter(service, body)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
        prompts = await _completion_prompts(service, body.prompt)
        params = _params(service, body, prompts)
        responder = CompletionResponder(f"cmpl-{uuid.uuid4().hex}", adapter or service.model_name, service.tokenizer,
                                        prompts, body.n, echo=body.echo,
                                        prompt_logprobs=body.prompt_logprobs is not None)
        return await respond(service.engine, request, body, prompts, params, responder,
                             lambda: TextOutput(service.tokenizer, params.stop, params.skip_special_tokens),
                             adapter=adapter)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatRequest, request: Request):
        adapter = _adapter(service, body)
        _check_no_tools(body)
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if service.chat is None:
            raise APIError(400, "this model's tokenizer has no chat format", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        with _as_api_errors(service, "messages"):
            prompt, items = await service.off_loop(service.chat.render_with_media, messages, body.reasoning_effort,
                                                   service.max_prompt_tokens)
        params = _params(service, body, [prompt])
        media = None
        if items:
            with _as_api_errors(service, "messages"):
                media = await service.off_loop(service.chat.media.encode, items)
        responder = ChatResponder(f"chatcmpl-{uuid.uuid4().hex}", adapter or service.model_name, service.tokenizer,
                                  prompt_logprobs=body.prompt_logprobs is not None)
        return await respond(service.engine, request, body, [prompt], params, responder,
                             lambda: ChatOutput(service.chat, params.stop, params.skip_special_tokens), media,
                             adapter)

    app.include_router(tokenizer_router(service, [Depends(authorized)]))
    if service.lora is not None and service.lora.config.root is not None:
        app.include_router(lora_router(service, [Depends(authorized)]))
    return app


def _adapter(service: Service, body: SamplingFields) -> str | None:
    """The LoRA adapter the request's `model` names; None for the base (named or not); 404 for any other."""
    check_model(body.model, service.model_name, service.adapters)
    return body.model if body.model in service.adapters else None


def _check_no_tools(body: ChatRequest) -> None:
    """This server calls no tools: a request that offers some, or asks for a call, is refused rather than
    answered as if it had not; `tool_choice: "none"` (no call) is what it does anyway."""
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise APIError(400, f"{name} are not supported by this server", param=name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise APIError(400, f"{name} must be \"none\": this server calls no tools", param=name)


@contextlib.contextmanager
def _as_api_errors(service: Service, param: str):
    """Rendering's and decoding's errors as the 400s they are."""
    try:
        yield
    except TooLong:
        raise APIError(400, f"the prompt is longer than this server's limit of {service.max_prompt_tokens} tokens",
                       param=param, code="context_length_exceeded") from None
    except ChatError as exc:
        raise APIError(400, str(exc), param=param) from None


async def _completion_prompts(service: Service, prompt) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or len(prompt) > service.max_n:
        raise APIError(400, f"prompt must hold 1 to {service.max_n} prompts", param="prompt")
    limit = service.max_prompt_tokens
    with _as_api_errors(service, "prompt"):
        prompts = [await service.off_loop(service.tokenizer.encode_at_most, p, limit) if isinstance(p, str)
                   else list(p) for p in prompt]
    if any(not 0 <= t < service.vocab_size for p in prompts for t in p):
        raise APIError(400, f"prompt token ids must be in [0, {service.vocab_size})", param="prompt")
    return prompts


def _params(service: Service, body: SamplingFields, prompts: list[list[int]]) -> SamplingParams:
    """Check a request against the server's limits; its sampling parameters, with this server's max_tokens where
    it sets none."""
    values = body.sampling_values()
    limit_model = service.engine.config.max_model_len
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise APIError(400, "the prompt is empty", param="prompt")
    if longest > service.max_prompt_tokens:
        raise APIError(400, f"the prompt has {longest} tokens; this server takes at most {service.max_prompt_tokens}",
                       param="prompt", code="context_length_exceeded")
    max_tokens = values.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(service.max_tokens, limit_model - longest)
    if max_tokens > service.max_tokens or longest + max_tokens > limit_model:
        raise APIError(400, f"max_tokens {max_tokens} with a {longest}-token prompt exceeds the limits (context "
                       f"{limit_model}, max_tokens {service.max_tokens})", param="max_tokens",
                       code="context_length_exceeded")
    if body.n * len(prompts) > service.max_n:
        raise APIError(400, f"n x prompts must be at most {service.max_n}", param="n")
    for name in ("logprobs", "prompt_logprobs"):
        if values.get(name) is not None and values[name] > service.engine.config.max_logprobs:
            raise APIError(400, f"at most {service.engine.config.max_logprobs} {name}", param=name)
    if values.get("prompt_logprobs") is not None and body.stream:
        raise APIError(400, "prompt logprobs (echo with logprobs, or prompt_logprobs) are not streamed: send "
                       "stream false", param="stream")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if any(not 0 <= t < service.vocab_size for t in values.get("stop_token_ids", ())):
        raise APIError(400, f"stop_token_ids must be in [0, {service.vocab_size})", param="stop_token_ids")
    # what the request leaves unset comes from the checkpoint's generation_config.json, where it has one
    values = {**{name: getattr(service.sampling_defaults, name) for name in GENERATION_DEFAULTS}, **values}
    values["top_k"] = min(values["top_k"], service.vocab_size)  # past the vocabulary: all of it
    try:
        return SamplingParams(**{**values, "max_tokens": max_tokens})
    except InvalidParams as exc:
        raise APIError(400, str(exc), param=exc.param) from None
