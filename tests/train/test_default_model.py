"""The shipped default model, inkling-tiny (inkling_jax/assets, docs/default-model.md): it loads with the strict
checks, its logits equal transformers' Inkling on the same directory, it beats the bigram baseline on a committed
held-out sample, and the server without --model serves it and answers chat in words."""

import json
import math
import os
import re
import urllib.request

import numpy as np
import pytest

from inkling_jax import load_pretrained
from inkling_jax.assets import DEFAULT_MODEL_NAME, default_model_dir, training_record
from inkling_jax.generate import StepFunctions
from tests.hf_oracle import relative_error

SAMPLE = os.path.join(os.path.dirname(__file__), "data", "inkling_tiny_heldout.txt")
FP32_TOL = 1e-5


def sample_chapters() -> list[str]:
    with open(SAMPLE, encoding="utf-8") as fh:
        return [c for c in fh.read().split("\n\n") if c.strip()]


@pytest.fixture(scope="module")
def model():
    return load_pretrained(default_model_dir(), progress=False)  # names and shapes checked against config.json


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))


def test_logits_match_transformers_on_the_shipped_directory(model, tokenizer):
    import torch
    from transformers import InklingConfig, InklingForConditionalGeneration
    from transformers.models.inkling.configuration_inkling import InklingVisionConfig

    # transformers always builds media towers, of its huge default sizes where config.json has none (this model
    # is text-only): small ones here, which the text logits never touch.
    config = InklingConfig.from_pretrained(default_model_dir())
    config.vision_config = InklingVisionConfig(patch_size=10, temporal_patch_size=2, n_layers=3,
                                               text_hidden_size=config.text_config.hidden_size)
    reference, info = InklingForConditionalGeneration.from_pretrained(default_model_dir(), config=config,
                                                                       dtype=torch.float32, output_loading_info=True)
    assert all(k.startswith("model.mtp.") for k in info["unexpected_keys"])  # transformers has no MTP head
    assert all(k.startswith(("model.vision_tower.", "model.audio_tower.")) for k in info["missing_keys"])
    assert not info["mismatched_keys"]
    ids = np.asarray([tokenizer.encode(sample_chapters()[0]).ids[:200]])
    with torch.no_grad():
        want = reference.eval()(input_ids=torch.as_tensor(ids)).logits.float().numpy()
    got = np.asarray(StepFunctions(model).forward(ids.astype(np.int32)))
    assert got.shape == want.shape == (1, 200, model.config.text.unpadded_vocab_size)
    assert relative_error(got, want) < FP32_TOL


def test_held_out_loss_beats_the_bigram_baseline(model):
    """The committed sample is the first held-out chapters; its baselines (counts of the training split, which
    is not committed) and the model's loss on it were recorded when the weights were made, on the rows
    train.run packs (512 tokens, each chapter a segment ending in EOS)."""
    from flax import nnx

    from train.data import file_tokenizer, pack, read_documents

    recorded = training_record()["evaluation_sample"]
    tokenize = file_tokenizer(os.path.join(default_model_dir(), "tokenizer.json"))
    rows = pack(read_documents(SAMPLE, tokenize, model.config.eos_token_id, 4096), 512)
    logits = nnx.jit(lambda m, ids, seg, pos: m(ids, segment_ids=seg, positions=pos))(
        model, rows.input_ids, rows.segment_ids, rows.positions)
    logp = np.asarray(logits, np.float64)
    logp -= logp.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    counted = (rows.segment_ids[:, :-1] == rows.segment_ids[:, 1:]) & (rows.segment_ids[:, :-1] > 0)
    targets = np.take_along_axis(logp[:, :-1], rows.input_ids[:, 1:, None], axis=-1)[..., 0]
    loss = -targets[counted].mean()
    assert counted.sum() == recorded["eval_tokens"]
    assert loss == pytest.approx(recorded["eval_loss"], abs=2e-3)
    assert loss < recorded["eval_bigram_loss"] - 0.5 < recorded["eval_unigram_loss"]


def test_the_server_without_model_serves_it_and_chats_in_words():
    from serve.app import build_service, parse_args
    from serve.http.server import ServerThread, serving_app

    service = build_service(parse_args(["--max-num-seqs", "2", "--max-model-len", "256",
                                        "--compilation-cache", ""]))
    verse = sample_chapters()[1].splitlines()[3]
    try:
        with ServerThread(serving_app(service)) as server:
            with urllib.request.urlopen(f"{server.url}/v1/models") as response:
                listed = json.load(response)["data"][0]
            body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": verse}],
                    "max_tokens": 40, "seed": 0}
            request = urllib.request.Request(f"{server.url}/v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as response:
                answer = json.load(response)["choices"][0]["message"]["content"]
    finally:
        service.engine.shutdown(drain_seconds=0)
    assert listed["id"] == DEFAULT_MODEL_NAME and "King James" in listed["description"]
    words = answer.split()
    assert answer.isprintable() and len(words) >= 5, answer
    known = set(re.findall(r"[A-Za-z]+", " ".join(sample_chapters()).lower())) | _training_vocabulary()
    real = [w for w in re.findall(r"[A-Za-z]+", answer.lower()) if w in known]
    assert len(real) >= 0.7 * len(re.findall(r"[A-Za-z]+", answer)), answer


def _training_vocabulary() -> set[str]:
    """Whole words of the tokenizer's vocabulary (byte-level pieces that start a word)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json")).get_vocab()
    return {piece.lstrip("Ġ").lower() for piece in vocab if re.fullmatch(r"Ġ?[A-Za-z]+", piece)}


def test_training_record_states_what_the_docs_report():
    record = training_record()
    assert record["corpus"]["license"].startswith("public domain")
    assert record["parameters"] == pytest.approx(5.08e6, rel=0.01)
    assert record["size_bytes"] < 10.6e6
    scores = record["evaluation"]
    assert scores["eval_loss"] < scores["eval_bigram_loss"] < scores["eval_unigram_loss"]
    assert math.isclose(scores["eval_perplexity"], math.exp(scores["eval_loss"]))
    assert abs(record["rebuild"]["difference"]) < 0.02
