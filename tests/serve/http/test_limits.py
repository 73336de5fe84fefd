"""Limits come before the work they bound: a body over the limit is refused (413) from its Content-Length, or as
its chunks pass the limit, before the rest is read; a prompt that cannot fit is refused before it is tokenized;
what work there is runs off the event loop, so /health keeps answering meanwhile."""

import http.client
import json
import select
import socket

import pytest

from tests.serve.http.client import (
    HEADERS,
    KEY,
    MODEL,
    assert_health_answered,
    connect,
    health_during,
    ids,
    post,
    slowed,
)
from tests.serve.http.conftest import MAX_BODY_BYTES

CHUNK = 64 << 10


def send_chunked(url, path, total):
    """POST up to `total` bytes of a chunked body that never ends, stopping as soon as the server answers;
    (status, JSON body, bytes sent)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        sent = 0
        while sent < total and not select.select([sock], [], [], 0)[0]:
            sock.sendall(b"%x\r\n%s\r\n" % (CHUNK, b"[" * CHUNK))
            sent += CHUNK
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read()), sent


def announce(url, path, length):
    """A request whose headers announce a body of `length` bytes, of which none is sent: the server's answer."""
    conn = connect(url)
    conn.putrequest("POST", path)
    for name, value in {**HEADERS, "Content-Length": str(length)}.items():
        conn.putheader(name, value)
    conn.endheaders()
    response = conn.getresponse()
    return response.status, json.loads(response.read()), response.getheader("connection")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/health", "/no/such/path"])
@pytest.mark.parametrize("length", [MAX_BODY_BYTES + 1, 512 << 20])
def test_a_body_announced_over_the_limit_gets_413_unread(server, path, length):
    status, body, connection = announce(server.url, path, length)
    assert status == 413 and body["error"]["code"] == "request_too_large" and connection == "close"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_chunked_body_gets_413_once_it_passes_the_limit(server, path):
    status, body, sent = send_chunked(server.url, path, MAX_BODY_BYTES + 2 * CHUNK)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert sent > MAX_BODY_BYTES  # answered once past the limit (not before: it was counted, not guessed)


LONG_TEXT = "x" * (MAX_BODY_BYTES // 2)  # fits the body, but not the 80 prompt tokens


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": LONG_TEXT}),
    ("/v1/completions", {"prompt": ["hi", LONG_TEXT]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONG_TEXT}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": LONG_TEXT}]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": LONG_TEXT[:60]},
                                           {"role": "user", "content": LONG_TEXT[:60]}]}),
])
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server, monkeypatch, path, body):
    encoded = []
    encode = server.tokenizer.encode
    monkeypatch.setattr(server.tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    status, reply = post(server.url, path, {"model": MODEL, **body})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert all(n <= 80 for n in encoded)  # nothing longer than the limit was ever encoded


def test_health_answers_while_hostile_requests_are_handled(server):
    hostile = [
        lambda: announce(server.url, "/v1/completions", 512 << 20),
        lambda: send_chunked(server.url, "/v1/chat/completions", MAX_BODY_BYTES + 2 * CHUNK),
        lambda: post(server.url, "/v1/completions", {"model": MODEL, "prompt": LONG_TEXT}),
        lambda: post(server.url, "/v1/completions", {"model": MODEL, "prompt": [1] * (MAX_BODY_BYTES // 3)}),
        lambda: post(server.url, "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_BODY_BYTES // 40)}]}),
    ]
    assert_health_answered(health_during(server.url, hostile * 2))


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    monkeypatch.setattr(server.tokenizer, "encode", slowed(server.tokenizer.encode))
    answers = []
    probes = health_during(server.url, [lambda: answers.append(
        post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}))])
    assert answers[0][0] == 200, answers
    assert_health_answered(probes)
    assert len(probes) > 5  # probes ran during the whole 1.5 s


def test_a_long_token_id_prompt_is_refused(server):
    status, reply = post(server.url, "/v1/completions", {"model": MODEL, "prompt": ids(81, 0)})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
