"""Evaluating the served model as lm-evaluation-harness's `local-completions` does: its loglikelihood request
(`echo` + `logprobs: 1` + `max_tokens: 1` on token ids) read the way the harness reads it, vLLM's
`prompt_logprobs`, and the tokenizer routes it tokenizes through (`/tokenizer_info`, `/tokenize`,
`/detokenize`). The logprobs are checked against the model's own forward in float32. On the shared server of
conftest.py, whose small KV pool makes a request of several long prompts preempt one of them.
"""

import json
import operator
import urllib.error
import urllib.request

import numpy as np
import pytest

from tests.serve.http.client import KEY, MODEL, ids, metric, post
from tests.serve.logprobs import model_logprobs


def loglikelihood(url, context: list[int], continuation: list[int]):
    """The harness's loglikelihood request for one (context, continuation) pair and its reading of the answer:
    (sum of the continuation's logprobs, whether each continuation token is the most likely, the choice)."""
    status, body = post(url, "/v1/completions", {"model": MODEL, "prompt": [context + continuation],
                                                 "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                                 "echo": True})
    assert status == 200, body
    choice = sorted(body["choices"], key=operator.itemgetter("index"))[0]
    logprobs = choice["logprobs"]
    scored, tops = logprobs["token_logprobs"][len(context):-1], logprobs["top_logprobs"][len(context):-1]
    return sum(scored), all(lp == max(top.values()) for lp, top in zip(scored, tops)), choice


def check(server, prompt: list[int], choice: dict, generated: int = 1) -> None:
    """The echoed prompt's logprobs are the model's own, with `generated` tokens after them."""
    expected = model_logprobs(server.model, prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(prompt) + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:len(prompt)], expected[np.arange(len(prompt) - 1), prompt[1:]],
                               rtol=0, atol=1e-5)
    best = [max(top.values()) for top in lp["top_logprobs"][1:len(prompt)]]
    np.testing.assert_allclose(best, expected[:-1].max(axis=-1), rtol=0, atol=1e-5)
    assert lp["tokens"][:len(prompt)] == [server.tokenizer.token_text(t) for t in prompt]
    assert choice["text"].startswith(server.tokenizer.decode(prompt))


def test_loglikelihood_requests_equal_the_models_forward(server):
    context, continuations = ids(30, 1), [ids(n, 10 + n) for n in (1, 4, 9)]
    for continuation in continuations:
        total, greedy, choice = loglikelihood(server.url, context, continuation)
        check(server, context + continuation, choice)
        expected = model_logprobs(server.model, context + continuation)
        rows = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
        assert total == pytest.approx(expected[rows, continuation].sum(), abs=1e-4)
        assert greedy == bool(np.all(expected[rows].argmax(axis=-1) == continuation))
    # A greedy continuation is recognised as such (a token's logprob is the best one exactly).
    greedy_tokens = [int(model_logprobs(server.model, context)[-1].argmax())]
    assert loglikelihood(server.url, context, greedy_tokens)[1]


def test_a_cached_prefix_does_not_change_the_logprobs(server):
    prompt = ids(57, 2)
    first = loglikelihood(server.url, prompt, [])[2]
    server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)  # its pages are cached now
    hits = metric(server.url, "inkling_prefix_cache_hit_tokens_total")
    server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert metric(server.url, "inkling_prefix_cache_hit_tokens_total") > hits
    again = loglikelihood(server.url, prompt, [])[2]
    check(server, prompt, again)
    assert again["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"]


def test_scored_prompts_preempted_beside_generation_keep_their_logprobs(server):
    """One request of two prompts, each scored (`echo` + `logprobs`) and continued greedily by 24 tokens: together
    they need 2 x 10 pages of 8 tokens, more than the shared server's 16, so one of them is preempted and
    recomputed by construction (both enter the scheduler in the same step). Neither the prompts' logprobs nor the
    continuations change."""
    prompts = [ids(50, 20), ids(50, 21)]
    body = {"model": MODEL, "echo": True, "logprobs": 1, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    def complete(batch):
        status, reply = post(server.url, "/v1/completions", {**body, "prompt": batch})
        assert status == 200, reply
        return sorted(reply["choices"], key=operator.itemgetter("index"))

    alone = [complete([p])[0] for p in prompts]
    preempted = metric(server.url, "inkling_preemptions_total")
    together = complete(prompts)
    assert metric(server.url, "inkling_preemptions_total") > preempted
    for prompt, choice, own in zip(prompts, together, alone):
        check(server, prompt, choice, generated=24)
        assert choice["text"] == own["text"]


def test_echo_without_generation_and_vllms_prompt_logprobs(server):
    prompt = ids(20, 4)
    status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2,
                                                        "max_tokens": 0})
    choice = body["choices"][0]
    assert status == 200 and choice["text"] == server.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and body["usage"]["completion_tokens"] == 0
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"][1:])
    expected = model_logprobs(server.model, prompt)
    status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                        "prompt_logprobs": 1})
    listed = body["choices"][0]["prompt_logprobs"]
    assert status == 200 and listed[0] is None and len(listed) == len(prompt)
    for position, (token, entries) in enumerate(zip(prompt[1:], listed[1:])):
        own = entries[str(token)]
        assert own["logprob"] == pytest.approx(expected[position, token], abs=1e-5)
        assert own["rank"] == 1 + np.sum(expected[position] > expected[position, token])
        assert own["decoded_token"] == server.tokenizer.token_text(token)
        assert min(e["rank"] for e in entries.values()) == 1
    messages = [{"role": "user", "content": "Why?"}]
    chat = post(server.url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                     "prompt_logprobs": 0})[1]
    assert len(chat["prompt_logprobs"]) == len(server.chat.render(messages))


def test_a_stop_token_keeps_its_place_in_the_logprobs(server):
    """The harness drops the last token of an echo: the one generated. When that token is EOS or a stop id, it
    is still listed (with no text), so the prompt's own tokens keep their places."""
    prompt = ids(15, 5)
    token = int(model_logprobs(server.model, prompt)[-1].argmax())
    status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1,
                                                        "max_tokens": 1, "temperature": 0, "stop_token_ids": [token]})
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and choice["text"] == server.tokenizer.decode(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1
    assert choice["logprobs"]["tokens"][-1] == server.tokenizer.token_text(token)


@pytest.mark.parametrize("body", [
    {"prompt": "x", "echo": True, "logprobs": 1, "stream": True},
    {"prompt": "x", "prompt_logprobs": 21},
    {"prompt": "x", "prompt_logprobs": -1},
])
def test_prompt_logprobs_refusals(server, body):
    status, reply = post(server.url, "/v1/completions", {"model": MODEL, "max_tokens": 1, **body})
    assert status == 400 and reply["error"]["param"] in ("stream", "prompt_logprobs"), reply


def test_tokenizer_routes_as_vllm_shapes_them(server):
    def tokenizer_info(key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(server.url + "/tokenizer_info", headers=headers),
                                        timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, None

    status, info = tokenizer_info(KEY)
    assert status == 200 and tokenizer_info(None)[0] == 401
    assert info["eos_token"] == "<|content_model_end_sampling|>" and info["eos_token_id"] == server.engine.eos_token_id
    assert info["bos_token"] is None and info["pad_token"] is None and info["chat_template"] is None
    text = "Caf\u00e9 <|endoftext|> 42"
    status, tokens = post(server.url, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert status == 200 and tokens["tokens"] == list(text.encode()) and tokens["count"] == len(text.encode())
    assert tokens["max_model_len"] == server.engine.config.max_model_len
    assert len(tokens["token_strs"]) == tokens["count"]
    assert post(server.url, "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": text})
    messages = [{"role": "user", "content": "hi"}]
    status, chat = post(server.url, "/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == server.chat.render(messages)
    assert post(server.url, "/detokenize", {"tokens": [999]})[0] == 400
    assert post(server.url, "/detokenize", {"tokens": [True]})[0] == 400  # strict types, as on /v1
    assert post(server.url, "/tokenize", {"prompt": "x", "messages": messages})[0] == 400
    assert post(server.url, "/tokenize", {"prompt": "x", "model": "other"})[0] == 404
    for path in ("/tokenize", "/detokenize"):
        assert post(server.url, path, {"prompt": "x", "tokens": [1]}, key=None)[0] == 401
