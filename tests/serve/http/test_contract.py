"""The smaller parts of the contract: the OpenAPI document says what the server answers; values are of their
declared types (no booleans or strings for numbers); tools, in every spelling, are refused rather than ignored;
429s say when to retry; the API key is checked as bytes; without a key, a loopback server answers only Host
headers that name it."""

import json
import urllib.request

import pytest

from serve.http.guards import local_host_names
from serve.http.routes import Service, create_app
from serve.http.server import ServerThread
from tests.serve.http.client import HEADERS, KEY, MODEL, connect, post

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


def test_the_openapi_document_describes_the_errors_as_answered(server):
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=30) as r:
        doc = json.load(r)
    assert "422" not in json.dumps(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "default"} <= set(responses)
        assert all(responses[s]["content"]["application/json"]["schema"] == error for s in responses if s != "200")
        assert "text/event-stream" in responses["200"]["content"]
    assert set(doc["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "prompt": [True, False]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1.0, 2.0]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "n": "2"}, "n"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [False]}, "stop_token_ids.0"),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_values_must_have_their_declared_types(server, path, body, param):
    status, reply = post(server.url, path, body)
    assert status == 400 and reply["error"]["param"].startswith(param), reply


@pytest.mark.parametrize("changes,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_tools_in_any_spelling_are_refused(server, changes, param):
    status, reply = post(server.url, "/v1/chat/completions", {**CHAT, **changes})
    assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize("changes", [{"tool_choice": "none"}, {"function_call": "none"}, {"tools": []}])
def test_asking_for_no_tool_call_is_what_the_server_does(server, changes):
    assert post(server.url, "/v1/chat/completions", {**CHAT, **changes})[0] == 200


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                       ("/v1/completions", {**COMPLETION, "stream": True})])
def test_a_full_queue_answers_429_with_retry_after(server, path, body):
    server.engine.max_queued = 0
    try:
        conn = connect(server.url)
        conn.request("POST", path, json.dumps(body), HEADERS)
        response = conn.getresponse()
        reply = json.loads(response.read())
    finally:
        server.engine.max_queued = 256
    assert response.status == 429 and reply["error"]["code"] == "rate_limit_exceeded"
    assert int(response.getheader("retry-after")) >= 1


@pytest.mark.parametrize("authorization", [None, "", "Bearer", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x",
                                           f"bearer {KEY}", f"Bearer {KEY[:-1]}\u00ff", "Bearer \u00e9\u00e9"])
def test_wrong_keys_get_401(server, authorization):
    headers = {"Content-Type": "application/json", **({} if authorization is None else
                                                       {"Authorization": authorization})}
    conn = connect(server.url)
    conn.request("POST", "/v1/completions", json.dumps(COMPLETION), headers)
    response = conn.getresponse()
    assert response.status == 401 and json.loads(response.read())["error"]["code"] == "invalid_api_key"


@pytest.fixture(scope="module")
def keyless(server):
    """A second app on the shared engine, without an API key, as `python -m serve.app` serves 127.0.0.1."""
    s = server.service
    service = Service(s.engine, s.tokenizer, MODEL, "keyless", s.vocab_size, max_prompt_tokens=s.max_prompt_tokens,
                      max_tokens=s.max_tokens, chat=s.chat, allowed_hosts=local_host_names("127.0.0.1"))
    with ServerThread(create_app(service)) as thread:  # an app without a drain: leaving it leaves the engine be
        yield thread.url


@pytest.mark.parametrize("host,allowed", [
    ("localhost", True), ("localhost:8000", True), ("127.0.0.1:1", True), ("[::1]:8000", True), ("LOCALHOST", True),
    ("evil.example", False), ("evil.example:8000", False), ("localhost.evil.example", False), ("127.0.0.2", False),
    ("[::1", False), ("", False),
])
def test_without_a_key_only_local_host_names_are_answered(keyless, host, allowed):
    conn = connect(keyless)
    conn.putrequest("POST", "/v1/completions", skip_host=True)
    for name, value in {"Host": host, "Content-Type": "application/json",
                        "Content-Length": str(len(json.dumps(COMPLETION)))}.items():
        conn.putheader(name, value)
    conn.endheaders(json.dumps(COMPLETION).encode())
    response = conn.getresponse()
    reply = json.loads(response.read())
    assert (response.status == 200) if allowed else (response.status == 400 and
                                                     reply["error"]["code"] == "invalid_host"), (host, reply)


def test_local_host_names_include_the_bound_address():
    assert {"localhost", "127.0.0.1", "[::1]"} <= local_host_names("127.0.0.1")
    assert "[::1]" in local_host_names("::1") and "127.0.0.5" in local_host_names("127.0.0.5")
