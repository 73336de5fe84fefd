"""One streamed request to an OpenAI-compatible server over plain HTTP (the standard library: a load generator needs
no extras), timed chunk by chunk as vLLM's benchmark times them.

A chunk that carries a token (`carries_token`) is its arrival: the first gives the time to first token, the gaps
between the next ones the inter-token latencies. The token counts are the server's `usage` (asked for with
`stream_options.include_usage`); a server that sends none is counted by its chunks with choices.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.parse

from benchmarks.load.datasets import Prompt

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclasses.dataclass
class Result:
    prompt_len: int  # the server's count where it gave one, else the client's
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error


class Server:
    """Where requests go: the base URL (scheme, host, port, optional path prefix), the endpoint and the key."""

    def __init__(self, base_url: str, endpoint: str, api_key: str | None, timeout: float):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"the base URL must be http(s)://host[:port][/path], got {base_url!r}")
        self.https = url.scheme == "https"
        self.host, self.port, self.prefix = url.hostname, url.port, url.path.rstrip("/")
        self.endpoint, self.timeout = endpoint, timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout)

    def post(self, path: str, body: dict) -> dict:
        """A plain (not streamed) POST; its JSON answer, or RuntimeError with the status and body."""
        connection = self.connect()
        try:
            connection.request("POST", self.prefix + path, json.dumps(body), self.headers)
            response = connection.getresponse()
            text = response.read().decode("utf-8", "replace")
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {response.status}: {text[:500]}")
        return json.loads(text)


def request_body(endpoint: str, model: str, prompt: Prompt, sampling: dict) -> dict:
    """A streamed request for `prompt`'s output length; `sampling`: temperature, ignore_eos and other fields."""
    body = {"model": model, "max_tokens": prompt.output_len, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    return body


def stream(server: Server, body: dict, prompt_len: int) -> Result:
    """Send one streamed request and time its chunks; never raises (a failure is the result's `error`)."""
    result = Result(prompt_len)
    connection = server.connect()
    start = last = time.perf_counter()
    chunks = 0
    try:
        connection.request("POST", server.prefix + server.endpoint, json.dumps(body), server.headers)
        response = connection.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read().decode('utf-8', 'replace')[:500]}"
            return result
        for line in response:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, other fields
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = f"error event: {json.dumps(chunk['error'])[:500]}"
                return result
            if chunk.get("choices") and carries_token(chunk["choices"][0]):
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                chunks += 1
                last = now
            usage = chunk.get("usage")
            if usage:
                result.prompt_len = usage.get("prompt_tokens", prompt_len)
                result.output_len = usage.get("completion_tokens", 0)
        result.latency = time.perf_counter() - start
        if chunks == 0:
            result.error = "the stream ended without a token"
        elif not result.output_len:
            result.output_len = chunks  # no usage from the server: one token per chunk
    except (OSError, http.client.HTTPException, ValueError, TypeError, KeyError, AttributeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    return result


def carries_token(choice: dict) -> bool:
    """Whether a streamed choice brings a token: a completion's text (even empty: this server and vLLM send a
    chunk per token), a chat delta's content or reasoning; not a chat stream's opening role announcement (its
    content empty) nor a chunk that only finishes."""
    if "text" in choice:
        return True
    delta = choice.get("delta") or {}
    texts = [delta[k] for k in ("content", "reasoning_content") if isinstance(delta.get(k), str)]
    return bool(texts) and ("role" not in delta or any(texts))


def server_token_counter(server: Server, model: str):
    """A function that counts a text's tokens with the server's `/tokenize` route (vLLM's, which this server and
    vLLM have), so that ShareGPT lengths need no tokenizer on the client."""
    def count(text: str) -> int:
        return len(server.post("/tokenize", {"model": model, "prompt": text})["tokens"])
    return count
