"""Evaluating the served model as lm-evaluation-harness's `local-completions` does: its loglikelihood request
(`echo` + `logprobs: 1` + `max_tokens: 1` on token ids) read the way the harness reads it, vLLM's
`prompt_logprobs`, and the tokenizer routes it tokenizes through (`/tokenizer_info`, `/tokenize`,
`/detokenize`). The logprobs are checked against the model's own forward in float32.
"""

import concurrent.futures
import json
import operator
import types
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from inkling_jax import preset
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.http.chat import ChatFormat
from serve.http.routes import Service
from serve.http.server import ServerThread, serving_app
from serve.http.tokenizer import ByteTokenizer
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.serve.http.client import KEY, MODEL, ids, metric, post
from tests.serve.logprobs import model_logprobs

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))


@pytest.fixture(scope="module")
def served():
    tokenizer = ByteTokenizer()
    engine = Engine(random_model(CONFIG, seed=1, backend=REFERENCE), EngineConfig(
        max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(2, 5), num_pages=48, num_snapshots=8), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    service = Service(engine, tokenizer, MODEL, "test model", CONFIG.text.unpadded_vocab_size, max_prompt_tokens=90,
                      max_tokens=8, max_n=4, api_key=KEY, chat=ChatFormat(tokenizer))
    with ServerThread(serving_app(service)) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        reference = random_model(CONFIG, seed=1, backend=REFERENCE)
        yield types.SimpleNamespace(url=thread.url, client=client, reference=reference, tokenizer=tokenizer,
                                    chat=service.chat)


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


def check(served, prompt: list[int], choice: dict) -> None:
    """The echoed prompt's logprobs are the model's own, with one generated token after them."""
    expected = model_logprobs(served.reference, prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:len(prompt)], expected[np.arange(len(prompt) - 1), prompt[1:]],
                               rtol=0, atol=1e-5)
    best = [max(top.values()) for top in lp["top_logprobs"][1:len(prompt)]]
    np.testing.assert_allclose(best, expected[:-1].max(axis=-1), rtol=0, atol=1e-5)
    assert lp["tokens"][:len(prompt)] == [served.tokenizer.token_text(t) for t in prompt]
    assert choice["text"].startswith(served.tokenizer.decode(prompt))


def test_loglikelihood_requests_equal_the_models_forward(served):
    context, continuations = ids(30, 1), [ids(n, 10 + n) for n in (1, 4, 9)]
    for continuation in continuations:
        total, greedy, choice = loglikelihood(served.url, context, continuation)
        check(served, context + continuation, choice)
        expected = model_logprobs(served.reference, context + continuation)
        rows = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
        assert total == pytest.approx(expected[rows, continuation].sum(), abs=1e-4)
        assert greedy == bool(np.all(expected[rows].argmax(axis=-1) == continuation))
    # A greedy continuation is recognised as such (a token's logprob is the best one exactly).
    greedy_tokens = [int(model_logprobs(served.reference, context)[-1].argmax())]
    assert loglikelihood(served.url, context, greedy_tokens)[1]


def test_a_cached_prefix_does_not_change_the_logprobs(served):
    prompt = ids(57, 2)
    first = loglikelihood(served.url, prompt, [])[2]
    served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)  # its pages are cached now
    hits = metric(served.url, "inkling_prefix_cache_hit_tokens_total")
    served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert metric(served.url, "inkling_prefix_cache_hit_tokens_total") > hits
    again = loglikelihood(served.url, prompt, [])[2]
    check(served, prompt, again)
    assert again["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"]


def test_loglikelihood_requests_inside_a_batch_of_generation_requests(served):
    prompts = [ids(12 + 7 * i, 20 + i) for i in range(6)]

    def generate(prompt):
        return served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.8, seed=3,
                                                extra_body={"ignore_eos": True}).choices[0].text

    alone = [generate(p) for p in prompts[::2]]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        generated = [pool.submit(generate, p) for p in prompts[::2]]
        scored = [pool.submit(loglikelihood, served.url, p, []) for p in prompts[1::2]]
        assert [g.result(timeout=300) for g in generated] == alone
        for prompt, result in zip(prompts[1::2], scored):
            check(served, prompt, result.result(timeout=300)[2])


def test_echo_without_generation_and_vllms_prompt_logprobs(served):
    prompt = ids(20, 4)
    status, body = post(served.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2,
                                                        "max_tokens": 0})
    choice = body["choices"][0]
    assert status == 200 and choice["text"] == served.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and body["usage"]["completion_tokens"] == 0
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"][1:])
    expected = model_logprobs(served.reference, prompt)
    status, body = post(served.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                        "prompt_logprobs": 1})
    listed = body["choices"][0]["prompt_logprobs"]
    assert status == 200 and listed[0] is None and len(listed) == len(prompt)
    for position, (token, entries) in enumerate(zip(prompt[1:], listed[1:])):
        own = entries[str(token)]
        assert own["logprob"] == pytest.approx(expected[position, token], abs=1e-5)
        assert own["rank"] == 1 + np.sum(expected[position] > expected[position, token])
        assert own["decoded_token"] == served.tokenizer.token_text(token)
        assert min(e["rank"] for e in entries.values()) == 1
    messages = [{"role": "user", "content": "Why?"}]
    chat = post(served.url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                     "prompt_logprobs": 0})[1]
    assert len(chat["prompt_logprobs"]) == len(served.chat.render(messages))


def test_a_stop_token_keeps_its_place_in_the_logprobs(served):
    """The harness drops the last token of an echo: the one generated. When that token is EOS or a stop id, it
    is still listed (with no text), so the prompt's own tokens keep their places."""
    prompt = ids(15, 5)
    token = int(model_logprobs(served.reference, prompt)[-1].argmax())
    status, body = post(served.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1,
                                                        "max_tokens": 1, "temperature": 0, "stop_token_ids": [token]})
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and choice["text"] == served.tokenizer.decode(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1
    assert choice["logprobs"]["tokens"][-1] == served.tokenizer.token_text(token)


@pytest.mark.parametrize("body", [
    {"prompt": "x", "echo": True, "logprobs": 1, "stream": True},
    {"prompt": "x", "prompt_logprobs": 21},
    {"prompt": "x", "prompt_logprobs": -1},
])
def test_prompt_logprobs_refusals(served, body):
    status, reply = post(served.url, "/v1/completions", {"model": MODEL, "max_tokens": 1, **body})
    assert status == 400 and reply["error"]["param"] in ("stream", "prompt_logprobs"), reply


def test_tokenizer_routes_as_vllm_shapes_them(served):
    def tokenizer_info(key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(served.url + "/tokenizer_info", headers=headers),
                                        timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, None

    status, info = tokenizer_info(KEY)
    assert status == 200 and tokenizer_info(None)[0] == 401
    assert info["eos_token"] == "<|content_model_end_sampling|>" and info["eos_token_id"] == CONFIG.eos_token_id
    assert info["bos_token"] is None and info["pad_token"] is None and info["chat_template"] is None
    text = "Caf\u00e9 <|endoftext|> 42"
    status, tokens = post(served.url, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert status == 200 and tokens["tokens"] == list(text.encode()) and tokens["count"] == len(text.encode())
    assert tokens["max_model_len"] == 96 and len(tokens["token_strs"]) == tokens["count"]
    assert post(served.url, "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": text})
    messages = [{"role": "user", "content": "hi"}]
    status, chat = post(served.url, "/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == served.chat.render(messages)
    assert post(served.url, "/detokenize", {"tokens": [999]})[0] == 400
    assert post(served.url, "/tokenize", {"prompt": "x", "messages": messages})[0] == 400
    assert post(served.url, "/tokenize", {"prompt": "x", "model": "other"})[0] == 404
    for path in ("/tokenize", "/detokenize"):
        assert post(served.url, path, {"prompt": "x", "tokens": [1]}, key=None)[0] == 401
