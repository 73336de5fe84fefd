"""`python -m train.evaluate`: the held-out loss of a model directory is the model's own forward cross-entropy
(float32), for plain text and JSONL alike, with bits per byte over the predicted tokens' bytes; bad input is
refused with a message that says what is wrong."""

import json
import math
import shutil

import numpy as np
import pytest

from inkling_jax import preset
from inkling_jax.assets import DEFAULT_MODEL_DIR
from serve.random_weights import random_model
from tests.backends import REFERENCE
from tests.serve.logprobs import model_logprobs
from train.evaluate import evaluate_model, main
from train.export import export
from train.run import first_layers

CONFIG = first_layers(preset("tiny"), 2)
DOCS = ["the cat sat on the mat", "Caf\u00e9 au lait, s'il vous pla\u00eet", "a dog and a log"]
ARGS = ["--seq-len", "128", "--batch", "2", "--devices", "1", "--backend", "reference,moe=dense"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer `tiny` model exported in float32 with the presets' byte tokenizer, and the model."""
    directory = tmp_path_factory.mktemp("exported") / "model"
    model = random_model(CONFIG, seed=3, backend=REFERENCE)
    export(model, str(directory), dtype="float32")
    return directory, model


def forward_nll(model, ids: list[int]) -> np.ndarray:
    return -model_logprobs(model, ids)[np.arange(len(ids) - 1), ids[1:]]


def test_the_loss_is_the_models_own_cross_entropy_for_text_and_jsonl(model_dir, tmp_path, capsys):
    directory, model = model_dir
    # Each document is its bytes and EOS, all in one row: every token after the first is predicted.
    nll = np.concatenate([forward_nll(model, list(d.encode()) + [CONFIG.eos_token_id]) for d in DOCS])
    text, jsonl = tmp_path / "held.txt", tmp_path / "held.jsonl"
    text.write_text("\n\n".join(DOCS) + "\n")
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    scores = evaluate_model(str(directory), str(text), seq_len=128, batch=2, backend=REFERENCE, devices=1,
                            progress=False)
    assert scores["eval_tokens"] == nll.size
    assert scores["eval_loss"] == pytest.approx(nll.mean(), abs=1e-5)
    assert math.isclose(scores["eval_perplexity"], math.exp(scores["eval_loss"]))
    predicted_bytes = sum(len(d.encode()) - 1 for d in DOCS)  # EOS has no bytes; a document's first is not predicted
    assert scores["eval_bits_per_byte"] == pytest.approx(nll.sum() / math.log(2) / predicted_bytes, abs=1e-5)
    assert "eval_mtp_loss" in scores

    out = tmp_path / "scores.json"
    main(["--model", str(directory), "--data", str(jsonl), "--baseline-data", str(text), "--json", str(out), *ARGS])
    written = json.loads(out.read_text())
    assert written["eval_loss"] == pytest.approx(scores["eval_loss"], abs=1e-6)
    assert written["eval_tokens"] == scores["eval_tokens"]
    assert written["eval_bigram_loss"] < written["eval_unigram_loss"]  # fitted on the very same documents
    assert f"loss             {scores['eval_loss']:.4f} nats/token" in capsys.readouterr().out


def test_bad_input_is_refused_with_a_clear_message(model_dir, tmp_path):
    directory, _ = model_dir
    data = tmp_path / "held.txt"
    data.write_text("some text")

    def refused(model, path, match):
        with pytest.raises(SystemExit, match=match):
            main(["--model", str(model), "--data", str(path), *ARGS])

    refused(directory, tmp_path / "missing.txt", "missing.txt: no such file")
    (tmp_path / "empty.txt").write_text("\n\n")
    refused(directory, tmp_path / "empty.txt", "no documents")
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    shutil.copyfile(f"{DEFAULT_MODEL_DIR}/tokenizer.json", other / "tokenizer.json")
    refused(other, data, "4096 entries, the model's vocabulary 380: it is another model's tokenizer")
    (other / "tokenizer.json").unlink()
    refused(other, data, "no tokenizer.json")
