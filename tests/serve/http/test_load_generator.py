"""`inkling-bench-serving` against the shared test server (conftest.py): every metric of vLLM's serving benchmark
is written and agrees with the requests sent; ShareGPT files are read as vLLM reads them, counted with the
server's /tokenize."""

import json

import numpy as np
import pytest

from benchmarks.load import cli
from benchmarks.load.client import Server, server_token_counter
from benchmarks.load.datasets import random_prompts, sharegpt_prompts
from tests.serve.http.client import KEY, MODEL

LATENCIES = ("ttft", "tpot", "itl", "e2el")
TOTALS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
          "input_throughput", "output_throughput", "total_token_throughput")


def bench(server, path, *flags):
    cli.main(["--base-url", server.url, "--api-key", KEY, "--disable-tqdm", "--save-result", "--result-filename",
              str(path), *flags])
    with open(path) as f:
        return json.load(f)


def test_random_load_writes_every_metric_of_the_requests_it_sent(server, tmp_path, capsys):
    flags = ["--num-prompts", "7", "--random-input-len", "20", "--random-output-len", "8", "--random-range-ratio",
             "0.5", "--random-token-range", "0,256", "--max-concurrency", "3", "--seed", "5", "--request-rate", "50",
             "--burstiness", "0.5"]
    found = bench(server, tmp_path / "run.json", *flags)
    assert "output throughput (tok/s)" in capsys.readouterr().out
    sent = random_prompts(7, 20, 8, 0.5, np.random.default_rng(5), (0, 256))  # the same seed, the same prompts
    assert found["model_id"] == MODEL and found["max_concurrency"] == 3
    assert found["request_rate"] == 50 and found["burstiness"] == 0.5
    assert all(key in found for key in TOTALS)
    assert found["completed"] == 7 and found["failed"] == 0 and found["errors"] == [""] * 7
    assert found["input_lens"] == [p.prompt_len for p in sent] and found["total_input_tokens"] == sum(
        p.prompt_len for p in sent)
    assert found["output_lens"] == [p.output_len for p in sent]  # ignore_eos: every output as long as asked
    assert found["total_output_tokens"] == sum(found["output_lens"])
    # one chunk per token, even for tokens that decode to no text (the byte tokenizer's ids from 256)
    assert [len(itl) + 1 for itl in found["itls"]] == found["output_lens"]
    duration = found["duration"]
    assert found["request_throughput"] == pytest.approx(7 / duration)
    assert found["output_throughput"] == pytest.approx(found["total_output_tokens"] / duration)
    assert found["total_token_throughput"] == pytest.approx(found["input_throughput"] + found["output_throughput"])
    for name in LATENCIES:
        mean, median, p99, std = (found[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99", "std"))
        assert 0 < median <= p99 and 0 < mean <= p99 and std >= 0, name
    assert found["p99_ttft_ms"] <= found["p99_e2el_ms"] and found["mean_tpot_ms"] < found["mean_e2el_ms"]


def sharegpt_file(path, conversations):
    path.write_text(json.dumps([{"id": str(i), "conversations": [{"from": who, "value": text} for who, text in turns]}
                                for i, turns in enumerate(conversations)]))
    return str(path)


def test_sharegpt_prompts_are_first_turns_sized_by_the_answers(server, tmp_path):
    usable = [[("human", f"Tell me about item {i}."), ("gpt", "It is fine" + "!" * i)] for i in range(4)]
    skipped = [[("human", "Hi"), ("gpt", "A long enough answer")],  # a prompt under 4 tokens
               [("human", "A long enough question"), ("gpt", "No")],  # an answer under 4 tokens
               [("human", "A question without an answer")]]
    path = sharegpt_file(tmp_path / "sharegpt.json", usable + skipped)
    count = server_token_counter(Server(server.url, "/v1/completions", KEY, 60), MODEL)
    assert count("héllo") == len("héllo".encode())  # the test server's tokenizer: one token per byte
    prompts = sharegpt_prompts(path, 4, np.random.default_rng(0), count)
    assert sorted((p.prompt, p.output_len) for p in prompts) == sorted(
        (human, len(gpt)) for (_, human), (_, gpt) in usable)
    assert all(p.prompt_len == len(p.prompt) for p in prompts)
    assert [p.output_len for p in sharegpt_prompts(path, 2, np.random.default_rng(0), count, output_len=3)] == [3, 3]
    with pytest.raises(ValueError, match="4 usable conversations, fewer than the 5"):
        sharegpt_prompts(path, 5, np.random.default_rng(0), count)


def test_sharegpt_load_through_chat(server, tmp_path):
    path = sharegpt_file(tmp_path / "sharegpt.json", [[("human", f"Question {i}?"), ("gpt", "Answer " * (i + 1))]
                                                      for i in range(3)])
    found = bench(server, tmp_path / "chat.json", "--dataset-name", "sharegpt", "--dataset-path", path,
                  "--num-prompts", "3", "--endpoint", "/v1/chat/completions", "--model", MODEL)
    assert found["completed"] == 3 and found["dataset_name"] == "sharegpt"
    assert sorted(found["output_lens"]) == [7, 14, 21]  # the answers' byte counts
    assert min(found["input_lens"]) > len("Question 0?")  # the chat framing counts, as the server's usage says
    # a chunk per token: neither the opening role announcement nor the finishing chunk counts as one
    assert [len(itl) + 1 for itl in found["itls"]] == found["output_lens"]
