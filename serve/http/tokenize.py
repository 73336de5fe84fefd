"""vLLM's tokenizer endpoints, through which evaluation harnesses tokenize (lm-evaluation-harness's
`local-completions` uses them rather than download a tokenizer): `GET /tokenizer_info`, `POST /tokenize` (a
`prompt`, or chat `messages` rendered as `/v1/chat/completions` renders them) and `POST /detokenize`, behind the
API key like `/v1`.

`/tokenize` gives the ids that `/v1/completions` makes of the same text: text that spells a control token (say
"<|endoftext|>") stays text, as everywhere in this server, so that an application tokenizing untrusted text here
cannot forge one. The stop token's id is in `/tokenizer_info` (`eos_token_id`).
"""

from __future__ import annotations

from typing import Union

from fastapi import APIRouter
from pydantic import BaseModel, model_validator

from serve.http.chat import ChatError
from serve.http.protocol import ERROR_RESPONSES, STRICT, APIError, ChatMessage, Text


class TokenizeRequest(BaseModel):
    """vLLM's two shapes in one: a `prompt`, or chat `messages` (with this server's `reasoning_effort`).
    `add_special_tokens` (default true, as vLLM's) applies the tokenizer's post-processor to a prompt; Inkling's
    adds nothing, and the chat format inserts its own control tokens. vLLM's template options
    (`add_generation_prompt`, ...) do not apply: the prompt ends where the model writes its own turn. A prompt is
    tokenized whole, however long (a harness tokenizes whole documents and cuts its windows itself): the body
    size limit bounds the work."""

    model_config = STRICT
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    reasoning_effort: Union[Text, float, None] = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def check_model(requested: str | None, served: str, adapters: tuple[str, ...] = ()) -> None:
    """A request that names a model must name the one served or one of its LoRA `adapters` (None: any)."""
    if requested is not None and requested != served and requested not in adapters:
        names = ", ".join(repr(n) for n in (served, *adapters))
        raise APIError(404, f"model {requested!r} does not exist; this server serves {names}", param="model",
                       code="model_not_found")


def tokenizer_router(service, dependencies: list) -> APIRouter:
    """The three routes for `service` (the app's `serve.http.routes.Service`), with `dependencies` (the API key
    check)."""
    router = APIRouter(dependencies=dependencies, responses=ERROR_RESPONSES)
    tokenizer = service.tokenizer

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        eos = service.engine.eos_token_id
        named = {key: _token_name(tokenizer.config.get(key)) for key in ("bos_token", "pad_token")}
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.token_text(eos),
                "eos_token_id": eos, **named, "chat_template": tokenizer.config.get("chat_template"),
                "model_max_length": service.engine.config.max_model_len}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model, service.model_name, service.adapters)
        if body.prompt is not None:
            ids = await service.off_loop(tokenizer.encode, body.prompt, body.add_special_tokens)
        elif service.chat is None:
            raise APIError(400, "this model's tokenizer has no chat format", param="messages")
        else:
            try:  # media parts become their placeholder tokens, as in a chat request
                ids, _ = await service.off_loop(service.chat.render_with_media,
                                                [m.model_dump(exclude_none=True) for m in body.messages],
                                                body.reasoning_effort)
            except ChatError as exc:
                raise APIError(400, str(exc), param="messages") from None
        reply = {"count": len(ids), "max_model_len": service.engine.config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = [tokenizer.token_text(i) for i in ids]
        return reply

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model, service.model_name, service.adapters)
        if any(not 0 <= t < service.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {service.vocab_size})", param="tokens")
        return {"prompt": await service.off_loop(tokenizer.decode, body.tokens, False)}

    return router


def _token_name(value) -> str | None:
    """A named token of tokenizer_config.json: a string, or an added-token record with its `content`."""
    return value.get("content") if isinstance(value, dict) else value
