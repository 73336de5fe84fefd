"""The server end to end, through the official `openai` client and raw HTTP, on 127.0.0.1 (the shared server of
conftest.py)."""

import concurrent.futures
import http.client
import json
import socket
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from inkling_jax.generate import greedy_generate
from serve.http.chat import ChatOutput
from serve.runner.compilation import compilation_count
from tests.serve.http.client import KEY, MODEL, complete, ids, metric, post

LENGTH, NEW = 36, 12  # reference prompts: 32 tokens of chat framing + 4 characters of user text


# ------------------------------------------------------------------------------------------------------------


def test_models_health_metrics_and_auth(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
        assert r.status == 200
    assert metric(server.url, "inkling_kv_cache_usage_ratio") >= 0
    status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = post(server.url, "/v2/nothing", {})
    assert status == 404 and "error" in body


def test_greedy_completions_and_chat_equal_greedy_generate(server):
    messages = [{"role": "user", "content": "Why?"}]
    chat_prompt = server.chat.render(messages)
    prompts = [ids(LENGTH, seed) for seed in range(3)] + [chat_prompt]
    assert len(chat_prompt) == LENGTH
    expected = greedy_generate(server.model, np.array(prompts), NEW).tolist()
    out = complete(server.client, prompts[:3], max_tokens=NEW, temperature=0, logprobs=2)
    for choice, tokens in zip(out.choices, expected):
        assert choice.text == server.tokenizer.decode(tokens) and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == NEW and all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values())
                                             for i in range(NEW))
    assert out.usage.prompt_tokens == 3 * LENGTH and out.usage.completion_tokens == 3 * NEW
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                                 extra_body={"ignore_eos": True})
    parser = ChatOutput(server.chat)
    deltas = [d for t in expected[3] for d in parser.feed(t)] + parser.finish()
    assert chat.choices[0].message.content == "".join(d.text for d in deltas if d.channel == "content")


def test_stop_strings_split_across_tokens(server):
    prompt = ids(LENGTH, 0)
    full = complete(server.client, prompt, max_tokens=NEW, temperature=0).choices[0].text
    assert len(full) >= 6
    stop = full[3:6]  # byte-level tokens: a 3-character stop string spans at least 3 tokens
    cut = full[:full.index(stop)]
    got = complete(server.client, prompt, max_tokens=NEW, temperature=0, stop=[stop, "never seen"]).choices[0]
    assert (got.text, got.finish_reason) == (cut, "stop")
    stream = complete(server.client, prompt, max_tokens=NEW, temperature=0, stop=stop, stream=True,
                      stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens >= 4
    assert not any(stop in c.choices[0].text for c in chunks if c.choices)


def test_concurrent_streams_equal_one_at_a_time(server):
    """A load that overflows the KV pool (preempting and recomputing sequences) loses nothing: every request
    completes with the output it has alone, token for token where it asks for logprobs (the byte tokenizer gives
    ids from 256 no text)."""
    jobs = [dict(prompt=ids(5 + 4 * (i % 16), 100 + i), max_tokens=3 + i % 8,
                 temperature=0 if i % 2 else 0.8, seed=i, **({"logprobs": 0} if i % 3 == 0 else {}))
            for i in range(64)]

    def run(job, stream):
        if not stream:
            choice = complete(server.client, **job).choices[0]
            return choice.text, choice.finish_reason, choice.logprobs and choice.logprobs.tokens
        chunks = [c for c in complete(server.client, stream=True, **job) if c.choices]
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens] if "logprobs" in job else None
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason, tokens

    alone = [run(job, False) for job in jobs]
    preempted = metric(server.url, "inkling_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: run(job, True), jobs, timeout=300))
    assert together == alone
    assert all(reason == "length" for _, reason, _ in alone)
    assert all(len(tokens) == job["max_tokens"] for job, (_, _, tokens) in zip(jobs, alone) if "logprobs" in job)
    assert metric(server.url, "inkling_preemptions_total") > preempted  # recomputed sequences lost nothing


def test_n_choices_with_a_seed_are_reproducible(server):
    kw = dict(prompt=ids(10, 7), max_tokens=8, temperature=1.0, n=3, seed=11)
    first = [c.text for c in complete(server.client, **kw).choices]
    again = [c.text for c in complete(server.client, **kw).choices]
    assert first == again and len(set(first)) > 1


def test_prefix_cache_hit_equals_miss(server):
    prompt = ids(45, 3)  # chunks of 16: snapshots at 16 and 32
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=5)):
        prompt[0] = (prompt[0] + 1) % 256  # a fresh prefix for each case
        hits = metric(server.url, "inkling_prefix_cache_hit_tokens_total")
        miss = complete(server.client, prompt, max_tokens=10, **kw).choices[0].text
        assert metric(server.url, "inkling_prefix_cache_hit_tokens_total") == hits
        hit = complete(server.client, prompt, max_tokens=10, **kw).choices[0].text
        assert metric(server.url, "inkling_prefix_cache_hit_tokens_total") == hits + 32
        assert hit == miss


def test_presence_penalty_stops_repeats(server):
    prompt = ids(LENGTH, 1)
    plain = complete(server.client, prompt, max_tokens=24, temperature=0, logprobs=0).choices[0].logprobs.tokens
    penalised = complete(server.client, prompt, max_tokens=24, temperature=0, presence_penalty=2.0,
                         logprobs=0).choices[0].logprobs.tokens
    assert len(set(plain)) < len(plain)  # the random model repeats itself greedily...
    assert len(set(penalised)) == len(penalised)  # ...and a presence penalty of 2 outweighs its logit gaps


def test_disconnected_stream_returns_its_pages(server):
    """The engine is held after the stream's first token until the server has seen the client go (so that the
    request cannot finish first: the engine queues its steps faster than a disconnect is noticed)."""
    aborted = metric(server.url, 'inkling_requests_total{finish_reason="abort"}')
    engine = server.engine
    first_out, gone = threading.Event(), threading.Event()
    emit, abort, collect = engine._emit, engine.abort, engine.runner.collect

    def held_collect(dispatched):
        if first_out.is_set():
            gone.wait(30)
        return collect(dispatched)

    engine._emit = lambda request, output: (first_out.set(), emit(request, output))[1]
    engine.abort = lambda request_id: (gone.set(), abort(request_id))[1]
    engine.runner.collect = held_collect
    try:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": ids(20, 9), "max_tokens": 24,
                                                            "stream": True, "ignore_eos": True}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        conn.sock.close()
        conn.close()
        assert gone.wait(30)  # the server aborted the request
    finally:
        del engine._emit, engine.abort, engine.runner.collect  # the instances' own methods again
    blocks = server.engine.blocks
    deadline = time.monotonic() + 30
    while (server.engine.num_requests or blocks.num_free < blocks.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.num_requests == 0 and blocks.num_free == blocks.num_blocks
    assert metric(server.url, 'inkling_requests_total{finish_reason="abort"}') == aborted + 1


def test_a_decode_runs_tokens_leave_in_one_write(server):
    """A stream keeps an event per token, but the tokens of one decode run (up to 8 a device call here) leave in
    one HTTP chunk, one send and socket write, not one per token."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": ids(8, 21), "max_tokens": 24, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
                     b"application/json\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        raw = b"".join(iter(lambda: sock.recv(1 << 16), b""))
    head, rest = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    chunks = []  # the body's HTTP chunks, as the server wrote them
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            break
        chunks.append(rest[:int(size, 16)])
        rest = rest[int(size, 16) + 2:]
    events = [e.removeprefix(b"data: ") for e in b"".join(chunks).split(b"\n\n") if e]
    tokens = [e for e in events if e != b"[DONE]" and json.loads(e)["choices"]]
    assert len(tokens) == 24  # an event per token...
    assert len(chunks) <= len(events) // 3  # ...in far fewer writes (one per token: as many as events)


def test_full_queue_answers_429(server):
    server.engine.max_queued = 0
    try:
        with pytest.raises(openai.RateLimitError):
            complete(server.client, "hi", max_tokens=2)
    finally:
        server.engine.max_queued = 256


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL}),
    ("/v1/completions", {"model": "other", "prompt": "x"}),
    ("/v1/completions", {"model": MODEL, "prompt": ""}),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999]}),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 90}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 25}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 5}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1": 2}}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 17}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**40, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "x"}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "extreme"}),
])
def test_malformed_requests_get_openai_errors(server, path, body):
    status, reply = post(server.url, path, body)
    assert status == 200 if body.get("top_k") else 400 <= status < 500, reply
    assert status == 200 or set(reply["error"]) == {"message", "type", "param", "code"}


def test_unparseable_bodies_get_400(server):
    for raw in (b"{not json", b"[1, 2]", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode()):
        status, reply = post(server.url, "/v1/completions", None, raw=raw)
        assert status == 400 and "error" in reply


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3), max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
          "echo", "presence_penalty", "frequency_penalty", "repetition_penalty", "reasoning_effort", "best_of",
          "ignore_eos", "skip_special_tokens", "suffix", "tools", "response_format", "unknown"]
PLAUSIBLE = st.integers(-3, 5) | st.floats(-3, 3) | st.sampled_from(["a", "hi", "low", "text", MODEL]) | \
    st.lists(st.integers(-2, 400), max_size=3) | st.just([{"role": "user", "content": "hi"}])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), changes=st.dictionaries(st.sampled_from(FIELDS), PLAUSIBLE | JSON, max_size=4))
def test_fuzzed_request_bodies_never_get_5xx(server, chat, changes):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": [{"role": "user", "content": "hi"}]} if chat
                                                 else {"prompt": "hi"}), **changes}
    status, reply = post(server.url, "/v1/chat/completions" if chat else "/v1/completions", body)
    event(f"HTTP {status}")
    assert status < 500, (body, reply)


def test_nothing_compiles_after_warm_up(server):
    """Nothing in this process, and per /metrics nothing on the engine thread since its warm-up (whatever the
    tests before this one sent), under a mixed load: lengths, n, logprobs, penalties, streams, prompt logprobs."""
    before = compilation_count()
    assert metric(server.url, "inkling_compilations_after_warmup_total") == 0
    mixed = [dict(prompt=ids(40, 20), max_tokens=5, temperature=0.7, top_p=0.9, n=2, logprobs=3,
                  frequency_penalty=0.5, extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2}),
             dict(prompt=ids(40, 20), max_tokens=3),  # a prefix-cache hit
             dict(prompt=ids(70, 21), max_tokens=9, stream=True, n=3, temperature=1.0, seed=3),
             dict(prompt=ids(3, 22), max_tokens=2, logprobs=0, echo=True, extra_body={"prompt_logprobs": 2}),
             dict(prompt=[ids(9, 23), ids(33, 24)], max_tokens=6, stream=True, presence_penalty=1.0)]

    def send(kw):
        out = complete(server.client, **kw)
        return list(out) if kw.get("stream") else out

    with concurrent.futures.ThreadPoolExecutor(len(mixed)) as pool:
        list(pool.map(send, mixed, timeout=300))
    list(server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                               max_tokens=4, stream=True))
    assert compilation_count() == before
    assert metric(server.url, "inkling_compilations_after_warmup_total") == 0
