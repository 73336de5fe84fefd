"""A request's run on the engine as its HTTP response (`respond`): server-sent events as the engine's outputs come,
or one body once every choice has finished, for `/v1/completions` and `/v1/chat/completions`.

A `Choice` accumulates one choice's text and samples; a responder turns an engine `Output` into stream chunks, and
the finished choices into a whole response (with the prompt's logprobs where asked: in a completion's `logprobs`
with `echo`, OpenAI's legacy way, and as vLLM's `prompt_logprobs`). A client that goes away aborts its request
(the engine frees its pages): streaming or not, `respond` watches the connection while it waits. A request the
server ends (a failed step, the end of a shutdown's drain) gets an error: the status of a whole response, or a
last `{"error": ...}` event before `[DONE]` in a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.engine.engine import Engine
from serve.engine.outputs import Output, Sample
from serve.engine.request import EngineStopped, OutputParser, QueueFull
from serve.engine.sampling_params import SamplingParams
from serve.http.outbox import outbox_of
from serve.http.protocol import APIError, SamplingFields
from serve.http.text_stream import prompt_text
from serve.http.tokenizer import Tokenizer

log = logging.getLogger("serve.http")
RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait


@dataclasses.dataclass
class Choice:
    text: dict[str, str] = dataclasses.field(default_factory=dict)  # channel -> text so far
    samples: dict[str, list[tuple[int, Sample]]] = dataclasses.field(default_factory=dict)  # (text offset, sample)
    finish_reason: str | None = None
    num_output: int = 0
    prompt_logprobs: list[Sample] | None = None

    def add(self, output: Output) -> None:
        for delta in output.deltas:
            start = len(self.text.get(delta.channel, ""))
            self.samples.setdefault(delta.channel, []).extend((start, s) for s in delta.samples)
            self.text[delta.channel] = self.text.get(delta.channel, "") + delta.text
        self.finish_reason = output.finish_reason or self.finish_reason
        self.num_output = output.num_output
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responder:
    object_name = ""
    chunk_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer):
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.created = int(time.time())

    def envelope(self, name: str, choices: list, **extra) -> dict:
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def usage_chunk(self, usage_body: dict) -> dict:
        return self.envelope(self.chunk_name, [], usage=usage_body)

    def prompt_logprobs(self, scored: list[Sample] | None) -> list | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself and the most likely ones."""
        if scored is None:
            return None

        def entry(token_id: int, logprob: float, rank: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.tokenizer.token_text(token_id)}

        out: list = [None]
        for s in scored:
            ranked = {str(s.token_id): entry(s.token_id, s.logprob, s.rank)}
            for rank, (token_id, logprob) in enumerate(s.top, 1):
                ranked.setdefault(str(token_id), entry(token_id, logprob, rank))
            out.append(ranked)
        return out


class CompletionResponder(Responder):
    object_name = chunk_name = "text_completion"

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, prompts: list[list[int]], n: int, *,
                 echo: bool = False, prompt_logprobs: bool = False):
        """`echo`: each choice's text (and logprobs) begins with its prompt's; `prompt_logprobs`: each choice
        carries vLLM's `prompt_logprobs`."""
        super().__init__(request_id, model, tokenizer)
        self.prompts, self.n, self.with_prompt_logprobs = prompts, n, prompt_logprobs
        # prompt i's (text, where each of its tokens' text begins), when the request asked for echo
        self.echo = [prompt_text(tokenizer, p) for p in prompts] if echo else None

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.n][0] if self.echo else ""

    def first_chunks(self, num_choices: int) -> list[dict]:
        return [self.envelope(self.chunk_name, [self._choice(i, self.echo_text(i), None, None)])
                for i in range(num_choices) if self.echo_text(i)]

    def chunks(self, output: Output, logprobs: bool, before: Choice) -> list[dict]:
        """Stream chunks of one output; `before` is the choice as it was before this output. Every output is
        one (a token whose text is held back or none gives a chunk of no text: clients time tokens by chunks)."""
        text = "".join(d.text for d in output.deltas)
        samples = [(0, s) for d in output.deltas for s in d.samples]
        start = len(self.echo_text(output.index)) + len(before.text.get("text", ""))
        lp = self._logprobs(samples, start) if logprobs else None
        return [self.envelope(self.chunk_name, [self._choice(output.index, text, lp, output.finish_reason)])]

    def response(self, choices: list[Choice], logprobs: bool, usage_body: dict) -> dict:
        body = []
        for i, c in enumerate(choices):
            echo = self.echo_text(i)
            lp = self._logprobs(c.samples.get("text", []), len(echo)) if logprobs else None
            if lp is not None and self.echo:
                lp = {key: values + lp[key] for key, values in self._echo_logprobs(i, c.prompt_logprobs).items()}
            body.append(self._choice(i, echo + c.text.get("text", ""), lp, c.finish_reason))
            if self.with_prompt_logprobs:
                body[-1]["prompt_logprobs"] = self.prompt_logprobs(c.prompt_logprobs)
        return self.envelope(self.object_name, body, usage=usage_body)

    def _echo_logprobs(self, index: int, scored: list[Sample]) -> dict:
        """The legacy `logprobs` of choice `index`'s echoed prompt: its first token has none."""
        ids, (_, offsets) = self.prompts[index // self.n], self.echo[index // self.n]
        text = self.tokenizer.token_text
        return {"tokens": [text(i) for i in ids], "token_logprobs": [None] + [s.logprob for s in scored],
                "top_logprobs": [None] + [{text(i): lp for i, lp in s.top} for s in scored], "text_offset": offsets}

    @staticmethod
    def _choice(index: int, text: str, logprobs, finish_reason) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, samples: list[tuple[int, Sample]], shift: int) -> dict:
        text = self.tokenizer.token_text
        return {"tokens": [text(s.token_id) for _, s in samples], "token_logprobs": [s.logprob for _, s in samples],
                "top_logprobs": [{text(i): lp for i, lp in s.top} for _, s in samples],
                "text_offset": [shift + offset for offset, _ in samples]}


class ChatResponder(Responder):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, prompt_logprobs: bool = False):
        """`prompt_logprobs`: the response carries vLLM's `prompt_logprobs` (of the rendered conversation)."""
        super().__init__(request_id, model, tokenizer)
        self.with_prompt_logprobs = prompt_logprobs

    def first_chunks(self, num_choices: int) -> list[dict]:
        return [self.envelope(self.chunk_name, [self._delta(i, {"role": "assistant", "content": ""}, None, None)])
                for i in range(num_choices)]

    def chunks(self, output: Output, logprobs: bool, before: Choice) -> list[dict]:
        out = []
        for d in output.deltas:
            key = "reasoning_content" if d.channel == "reasoning" else "content"
            lp = {"content": self._logprobs(d.samples)} if logprobs and d.channel == "content" else None
            if d.text or lp:
                out.append(self.envelope(self.chunk_name, [self._delta(output.index, {key: d.text}, lp, None)]))
        if not out:  # a token whose text is held back or none: a chunk all the same, one per token
            out.append(self.envelope(self.chunk_name, [self._delta(output.index, {"content": ""}, None, None)]))
        if output.finish_reason is not None:
            out.append(self.envelope(self.chunk_name, [self._delta(output.index, {}, None, output.finish_reason)]))
        return out

    def response(self, choices: list[Choice], logprobs: bool, usage_body: dict) -> dict:
        body = []
        for i, c in enumerate(choices):
            message = {"role": "assistant", "content": c.text.get("content", ""),
                       "reasoning_content": c.text.get("reasoning")}
            lp = {"content": self._logprobs([s for _, s in c.samples.get("content", [])])} if logprobs else None
            body.append({"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
        extra = {"prompt_logprobs": self.prompt_logprobs(choices[0].prompt_logprobs)} if self.with_prompt_logprobs \
            else {}
        return self.envelope(self.object_name, body, usage=usage_body, **extra)

    @staticmethod
    def _delta(index: int, delta: dict, logprobs, finish_reason) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, samples: list[Sample]) -> list[dict]:
        def one(token_id: int, logprob: float) -> dict:
            return {"token": self.tokenizer.token_text(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}

        return [{**one(s.token_id, s.logprob), "top_logprobs": [one(i, lp) for i, lp in s.top]} for s in samples]


CLIENT_GONE = None  # put into a request's queue of outputs when its client disconnects
ENDED_BY_SERVER = {  # finish reasons that are no answer (the request failed): its error's status, message, code
    "abort": (503, "the server shut down before this request finished", "server_shutdown"),
    "error": (500, "the engine failed while running this request", None)}


def _ended_by_server(reason: str) -> APIError:
    status, message, code = ENDED_BY_SERVER[reason]
    return APIError(status, message, kind="server_error", code=code)


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Wait for the client to go away (the messages after the body are only that, or the response's end), then
    tell the request's queue."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(CLIENT_GONE)


async def respond(engine: Engine, request: Request, body: SamplingFields, prompts: list[list[int]],
                  params: SamplingParams, responder: Responder, make_parser: Callable[[], OutputParser],
                  media=None, adapter: str | None = None) -> Response:
    """Run the request's choices on the engine (with the LoRA `adapter`, None: the base); its response, streamed
    if the body asks for it. A client that goes away aborts the request at once, streaming or not."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    request_id = responder.request_id
    try:
        engine.submit(request_id, prompts, params, body.n, make_parser,
                      functools.partial(outbox_of(loop).put, queue), media=media, adapter=adapter)
    except QueueFull as exc:
        raise APIError(429, f"the server is busy: {exc}; retry later", kind="rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineStopped as exc:
        raise APIError(503, str(exc), kind="server_error") from None
    choices = [Choice() for _ in range(len(prompts) * body.n)]
    pending = [len(choices)]
    logprobs = params.logprobs is not None

    def record(output) -> None:
        choices[output.index].add(output)
        pending[0] -= output.finish_reason is not None

    @contextlib.contextmanager
    def watched():
        """Watch the client meanwhile; afterwards abort the request unless it has finished (the client left, the
        server failed it, or the handler ended early)."""
        watcher = asyncio.ensure_future(_watch_disconnect(request, queue))
        try:
            yield
        finally:
            watcher.cancel()
            if pending[0]:
                engine.abort(request_id)

    def total() -> dict:
        return usage(sum(map(len, prompts)), sum(c.num_output for c in choices))

    if body.stream:
        async def events():
            with watched():
                try:
                    for chunk in responder.first_chunks(len(choices)):
                        yield _sse(chunk)
                    while pending[0]:
                        # Every output already queued (a decode run's tokens come together) goes out in one
                        # write: an event per token still, but not a send and a socket write per token.
                        outputs = [await queue.get()]
                        while not queue.empty():
                            outputs.append(queue.get_nowait())
                        events, failed = [], False
                        for output in outputs:
                            if output is CLIENT_GONE:
                                return
                            if failed := output.finish_reason in ENDED_BY_SERVER:
                                events.append(_sse(_ended_by_server(output.finish_reason).body()))
                                break
                            events.extend(map(_sse, responder.chunks(output, logprobs, choices[output.index])))
                            record(output)
                        if events:
                            yield "".join(events)
                        if failed:
                            break
                    else:
                        if body.stream_options and body.stream_options.include_usage:
                            yield _sse(responder.usage_chunk(total()))
                except Exception:  # the status line is out: the stream itself has to say it failed
                    log.exception("stream %s failed", request_id)
                    yield _sse(APIError(500, "the server failed on this stream (its log says why)",
                                        kind="server_error").body())
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    with watched():
        while pending[0]:
            output = await queue.get()
            if output is CLIENT_GONE:
                return Response(status_code=499)  # nobody is listening; the request is aborted
            if output.finish_reason in ENDED_BY_SERVER:
                raise _ended_by_server(output.finish_reason)
            record(output)
    return JSONResponse(responder.response(choices, logprobs, total()))


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
