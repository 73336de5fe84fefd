"""Every error is an OpenAI-shaped JSON body, whatever raised it, and the connection stays open: text that is no
text (lone UTF-16 surrogates, wherever a string goes) is a 400 naming its field; an exception anywhere in a
handler is a 500; a stream that fails ends with an error event and `[DONE]`."""

import json

import pytest

from serve.http.chat import ChatFormat
from tests.serve.http.client import HEADERS, KEY, MODEL, connect

LONE = "\ud800"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def exchange(conn, method, path, body=None, headers=HEADERS):
    """(status, JSON body, content type) over a kept connection; asserts the server kept it."""
    sock = conn.sock
    conn.request(method, path, body if isinstance(body, (bytes, type(None))) else json.dumps(body), headers)
    response = conn.getresponse()
    data = response.read()
    assert not response.will_close and (sock is None or conn.sock is sock), "the server dropped the connection"
    return response.status, json.loads(data), response.getheader("content-type")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "prompt": "a" + LONE}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", LONE + "b"]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "stop": [LONE]}, "stop.0"),
    ("/v1/completions", {**COMPLETION, "user": LONE}, "user"),
    ("/v1/completions", {**COMPLETION, "model": MODEL + "\udfff"}, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": LONE}]},
     "messages.0.name"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + LONE}}]}]},
     "messages.0.content.0.image_url.url"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": LONE}, "reasoning_effort"),
])
def test_lone_surrogates_in_any_text_get_400_naming_the_field(server, path, body, param):
    conn = connect(server.url)
    status, reply, _ = exchange(conn, "POST", path, body)  # json.dumps writes the surrogate as \ud800
    assert status == 400 and reply["error"]["param"] == param and "surrogate" in reply["error"]["message"], reply
    assert exchange(conn, "POST", path, COMPLETION if "prompt" in body else CHAT)[0] == 200


def boom(*args, **kwargs):
    raise RuntimeError("an unforeseen failure")


@pytest.mark.parametrize("path,body,target", [
    ("/v1/completions", COMPLETION, lambda s: (s.tokenizer, "encode")),
    ("/v1/chat/completions", CHAT, lambda s: (ChatFormat, "render_with_media")),
    ("/v1/completions", COMPLETION, lambda s: (s.engine, "submit")),
    ("/v1/chat/completions", {**CHAT, "stream": True}, lambda s: (s.engine, "submit")),
    ("/metrics", None, lambda s: (s.engine.metrics, "render")),
])
def test_an_exception_in_a_handler_is_a_json_500_and_the_connection_stays(server, monkeypatch, path, body, target):
    monkeypatch.setattr(*target(server), boom)
    conn = connect(server.url)
    status, reply, kind = exchange(conn, "POST" if body else "GET", path, body)
    assert status == 500 and reply["error"]["type"] == "server_error" and kind == "application/json", reply
    assert exchange(conn, "GET", "/health")[0] == 200


@pytest.mark.parametrize("method,path,body,headers,status", [
    ("GET", "/v2/nothing", None, HEADERS, 404),
    ("DELETE", "/v1/completions", None, HEADERS, 405),
    ("POST", "/v1/completions", b"{not json", HEADERS, 400),
    ("POST", "/v1/completions", b"", HEADERS, 400),
    ("POST", "/v1/completions", b'{"model": 1}', {**HEADERS, "Content-Type": "text/plain"}, 400),
    ("POST", "/v1/completions", COMPLETION, {"Content-Type": "application/json"}, 401),
    ("POST", "/v1/completions", COMPLETION, {**HEADERS, "Authorization": "Bearer \u00e9" + KEY}, 401),
    ("POST", "/v1/completions", {**COMPLETION, "model": "other"}, HEADERS, 404),
    ("POST", "/v1/chat/completions", {**CHAT, "messages": []}, HEADERS, 400),
    ("GET", "/v1/models", None, {"Authorization": "Basic abc"}, 401),
])
def test_every_error_is_openai_shaped_json_on_a_kept_connection(server, method, path, body, headers, status):
    conn = connect(server.url)
    for _ in range(2):  # the same error twice on one connection
        got, reply, kind = exchange(conn, method, path, body, headers)
        assert got == status and kind == "application/json", reply
        assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_a_failing_stream_ends_with_an_error_event_and_done(server, monkeypatch):
    monkeypatch.setattr(server.tokenizer, "token_text", boom)  # the logprobs of every chunk need it
    conn = connect(server.url)
    conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True, "logprobs": 1}), HEADERS)
    response = conn.getresponse()
    events = [line[len(b"data: "):].strip() for line in response if line.startswith(b"data: ")]
    assert response.status == 200 and events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
