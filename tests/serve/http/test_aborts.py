"""A client that goes away aborts its request at once, streaming or not: the engine drops its sequences, frees
their slots and pages, and the gauges say so within a second (not at the next request's step)."""

import contextlib
import json
import time

import pytest

from tests.serve.http.client import HEADERS, MODEL, connect, ids, metric, slowed

GAUGES = ("inkling_running_sequences", "inkling_queued_sequences", "inkling_kv_cache_usage_ratio")
LONG = 60  # tokens a request asks for: far more engine steps than the test takes to walk away
STEP_SECONDS = 0.1  # each engine step's pace: a request of LONG - 40 tokens runs for 2 s or more however fast the
# machine is, longer than opening the test's connections takes, and an abort still lands within one step


@pytest.fixture
def slow_requests(server, monkeypatch):
    """Long requests, one token per paced engine step, so that none finishes before its client leaves."""
    service, engine = server.service, server.engine
    limits = service.max_tokens, engine.decode_steps
    service.max_tokens, engine.decode_steps = LONG, 1
    monkeypatch.setattr(engine, "step", slowed(engine.step, STEP_SECONDS))
    yield
    service.max_tokens, engine.decode_steps = limits


def aborted(url):
    return metric(url, 'inkling_requests_total{finish_reason="abort"}')


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_aborted_streams_free_their_work_and_zero_the_gauges_within_a_second(server, slow_requests):
    before = aborted(server.url)
    conns = []
    for i in range(20):
        conn = connect(server.url)
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": LONG - 30,
                "stream": True, "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), HEADERS)
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")  # the role chunk: it runs
        conns.append(conn)
    assert wait_for(lambda: metric(server.url, "inkling_running_sequences") > 0, 60)  # past a first compile
    for conn in conns:
        conn.sock.close()
        conn.close()
    assert wait_for(lambda: all(metric(server.url, g) == 0 for g in GAUGES), 1.0), \
        {g: metric(server.url, g) for g in GAUGES}
    assert server.engine.num_requests == 0
    assert aborted(server.url) - before == 20


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ids(8, 1)}),
    ("/v1/completions", {"prompt": [ids(8, 2), ids(5, 3)], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG - 40}),
])
def test_a_whole_response_whose_client_left_is_aborted(server, slow_requests, path, body):
    before, generated = aborted(server.url), metric(server.url, "inkling_generation_tokens_total")
    conn = connect(server.url)
    conn.request("POST", path, json.dumps({"model": MODEL, "max_tokens": LONG, "ignore_eos": True, **body}), HEADERS)
    assert wait_for(lambda: server.engine.num_requests == 1, 30)
    with contextlib.closing(conn):
        conn.sock.close()
    assert wait_for(lambda: server.engine.num_requests == 0, 1.0)
    choices = len(body["prompt"]) * body["n"] if "n" in body else 1
    assert aborted(server.url) - before == choices
    assert metric(server.url, "inkling_generation_tokens_total") - generated < choices * LONG / 2
    assert all(metric(server.url, g) == 0 for g in GAUGES)
