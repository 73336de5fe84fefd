"""Engine outputs -> OpenAI response bodies and stream chunks, for `/v1/completions` and `/v1/chat/completions`.

A `Choice` accumulates one choice's text and logprob entries; a responder turns an engine `Output` into stream
chunks, and the finished choices into a whole response.
"""

from __future__ import annotations

import dataclasses
import time

from serve.engine.request import Output
from serve.http.text_stream import TokenEntry
from serve.http.tokenizer import Tokenizer


@dataclasses.dataclass
class Choice:
    text: dict[str, str] = dataclasses.field(default_factory=dict)  # channel -> text so far
    entries: dict[str, list[tuple[int, TokenEntry]]] = dataclasses.field(default_factory=dict)  # (offset, entry)
    finish_reason: str | None = None
    num_output: int = 0

    def add(self, output: Output) -> None:
        for delta in output.deltas:
            start = len(self.text.get(delta.channel, ""))
            self.entries.setdefault(delta.channel, []).extend((start, e) for e in delta.entries)
            self.text[delta.channel] = self.text.get(delta.channel, "") + delta.text
        self.finish_reason = output.finish_reason or self.finish_reason
        self.num_output = output.num_output


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


class CompletionResponder(Responder):
    object_name = chunk_name = "text_completion"

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, echo: list[str] | None, n: int):
        super().__init__(request_id, model, tokenizer)
        self.echo, self.n = echo, n  # echo[i]: prompt i's text, when the request asked for echo

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def first_chunks(self, num_choices: int) -> list[dict]:
        return [self.envelope(self.chunk_name, [self._choice(i, self.echo_text(i), None, None)])
                for i in range(num_choices) if self.echo_text(i)]

    def chunks(self, output: Output, logprobs: bool, before: Choice) -> list[dict]:
        """Stream chunks of one output; `before` is the choice as it was before this output."""
        text = "".join(d.text for d in output.deltas)
        entries = [(0, e) for d in output.deltas for e in d.entries]
        if not text and not entries and output.finish_reason is None:
            return []
        start = len(self.echo_text(output.index)) + len(before.text.get("text", ""))
        lp = self._logprobs(entries, start) if logprobs else None
        return [self.envelope(self.chunk_name, [self._choice(output.index, text, lp, output.finish_reason)])]

    def response(self, choices: list[Choice], logprobs: bool, usage_body: dict) -> dict:
        body = []
        for i, c in enumerate(choices):
            echo = self.echo_text(i)
            lp = self._logprobs(c.entries.get("text", []), len(echo)) if logprobs else None
            body.append(self._choice(i, echo + c.text.get("text", ""), lp, c.finish_reason))
        return self.envelope(self.object_name, body, usage=usage_body)

    @staticmethod
    def _choice(index: int, text: str, logprobs, finish_reason) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, entries: list[tuple[int, TokenEntry]], shift: int) -> dict:
        text = self.tokenizer.token_text
        return {"tokens": [text(e.token_id) for _, e in entries], "token_logprobs": [e.logprob for _, e in entries],
                "top_logprobs": [{text(i): lp for i, lp in e.top} for _, e in entries],
                "text_offset": [shift + offset for offset, _ in entries]}


class ChatResponder(Responder):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def first_chunks(self, num_choices: int) -> list[dict]:
        return [self.envelope(self.chunk_name, [self._delta(i, {"role": "assistant", "content": ""}, None, None)])
                for i in range(num_choices)]

    def chunks(self, output: Output, logprobs: bool, before: Choice) -> list[dict]:
        out = []
        for d in output.deltas:
            key = "reasoning_content" if d.channel == "reasoning" else "content"
            lp = {"content": self._entries(d.entries)} if logprobs and d.channel == "content" else None
            if d.text or lp:
                out.append(self.envelope(self.chunk_name, [self._delta(output.index, {key: d.text}, lp, None)]))
        if output.finish_reason is not None:
            out.append(self.envelope(self.chunk_name, [self._delta(output.index, {}, None, output.finish_reason)]))
        return out

    def response(self, choices: list[Choice], logprobs: bool, usage_body: dict) -> dict:
        body = []
        for i, c in enumerate(choices):
            message = {"role": "assistant", "content": c.text.get("content", ""),
                       "reasoning_content": c.text.get("reasoning")}
            lp = {"content": self._entries([e for _, e in c.entries.get("content", [])])} if logprobs else None
            body.append({"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
        return self.envelope(self.object_name, body, usage=usage_body)

    @staticmethod
    def _delta(index: int, delta: dict, logprobs, finish_reason) -> dict:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _entries(self, entries: list[TokenEntry]) -> list[dict]:
        def one(token_id: int, logprob: float) -> dict:
            return {"token": self.tokenizer.token_text(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}

        return [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]
