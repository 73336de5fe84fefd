"""Shutting down: requests in flight get the drain to finish; streams still open at its end get an error event
and `[DONE]`, not a cut connection; afterwards the engine takes nothing more and holds nothing.

Its own small server (the shared one must outlive this test), with a drain of one second and room for a
stream of thousands of tokens, which no CPU decodes in that second one token at a time.
"""

import json
import threading

import pytest

from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.request import EngineStopped
from serve.engine.sampling_params import SamplingParams
from serve.http.routes import Service
from serve.http.server import ServerThread, serving_app
from serve.http.tokenizer import ByteTokenizer
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.serve.http.client import HEADERS, KEY, MODEL, connect, ids
from tests.serve.http.conftest import CONFIG

DRAIN_SECONDS = 1.0
LONG = 4000  # tokens of the stream that the drain cuts


@pytest.fixture(scope="module")
def server():
    engine = Engine(random_model(CONFIG, seed=0, backend=REFERENCE),
                    EngineConfig(max_num_seqs=2, max_model_len=LONG + 16, max_num_batched_tokens=48, page_size=16,
                                 chunk_buckets=(1, 16), row_buckets=(3,), decode_steps=1),
                    eos_token_id=CONFIG.eos_token_id)
    engine.start()
    service = Service(engine, ByteTokenizer(), MODEL, "test model", CONFIG.text.unpadded_vocab_size,
                      max_prompt_tokens=16, max_tokens=LONG, api_key=KEY)
    thread = ServerThread(serving_app(service), drain_seconds=DRAIN_SECONDS)
    with thread:
        yield thread, engine


def open_stream(url, max_tokens):
    conn = connect(url)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": ids(8, 4), "max_tokens": max_tokens,
                                                        "stream": True, "ignore_eos": True}), HEADERS)
    response = conn.getresponse()
    assert response.status == 200
    return response


def read_events(response, first: threading.Event, events: list):
    """The stream's data lines, parsed, until it ends; `first` is set at the first."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            first.set()


def test_drain_finishes_short_requests_and_ends_open_streams_with_an_error_event(server):
    thread, engine = server
    streams = {"short": (24, threading.Event(), []), "long": (LONG, threading.Event(), [])}
    readers = [threading.Thread(target=read_events, args=(open_stream(thread.url, n), first, events))
               for n, first, events in streams.values()]
    for reader in readers:
        reader.start()
    assert all(first.wait(60) for _, first, _ in streams.values())
    thread.__exit__(None, None, None)  # what SIGTERM does: stop listening, drain, stop the engine
    for reader in readers:
        reader.join(60)
    short, long = streams["short"][2], streams["long"][2]
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == "server_shutdown", long[-2:]
    assert len(long) < LONG  # it was cut, not finished
    assert engine.num_requests == 0 and engine.blocks.num_free == engine.blocks.num_blocks
    with pytest.raises(EngineStopped):
        engine.submit("late", [[1]], SamplingParams(), 1, lambda: None, lambda out: None)
