"""A property-based fuzz of both generation routes over the server's own OpenAPI document: bodies drawn from
each route's request schema, with the model pinned to the served one so that they reach generation. Whatever the
body, the answer is no 5xx; an error is the document's error schema; a stream is events of JSON ending with
`[DONE]`. Derandomized and bounded, so it runs the same on every machine."""

import json
import urllib.request

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.serve.http.client import HEADERS, MODEL, connect
from tests.serve.http.schema_strategies import from_schema

PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def document(server):
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=30) as r:
        return json.load(r)


def request_schema(document, path):
    return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def check_answer(status, content_type, data, stream):
    assert status < 500, data
    if status != 200:
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    elif stream:
        assert content_type.startswith("text/event-stream")
        events = [line[len("data: "):] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events
    else:
        assert json.loads(data)["choices"]


@pytest.mark.parametrize("path", PATHS)
def test_bodies_from_the_openapi_schema_never_get_a_5xx(server, document, path):
    bodies = from_schema(request_schema(document, path), document["components"]["schemas"], {"model": MODEL})
    conn = connect(server.url, timeout=120)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, stream=st.booleans())
    def fuzz(body, stream):
        body = {**body, "stream": stream} if "stream" not in body else body
        conn.request("POST", path, json.dumps(body), HEADERS)
        response = conn.getresponse()
        data = response.read()
        event(f"HTTP {response.status}")
        check_answer(response.status, response.getheader("content-type", ""), data, body.get("stream"))

    fuzz()
