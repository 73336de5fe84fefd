"""Files shipped inside the package: the trained default model, `inkling-tiny` (docs/default-model.md), a
hub-layout directory (config.json, generation_config.json, tokenizer.json, the safetensors weights and their
index, and training.json, the record of the run that made them) that `python -m serve.app` and
`python -m inkling_jax` use when no --model is given."""

import json
import os

DEFAULT_MODEL_NAME = "inkling-tiny"
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_MODEL_NAME)


def default_model_dir() -> str:
    """The shipped default model's directory; an error naming the rebuild command when it is missing."""
    if not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise FileNotFoundError(f"{DEFAULT_MODEL_DIR}: the default model is missing from this installation; "
                                "rebuild it with `python -m train.default_model` or pass --model DIR")
    return DEFAULT_MODEL_DIR


def training_record() -> dict:
    """training.json of the shipped model: corpus, data, the train.run command, timings, metrics, samples."""
    with open(os.path.join(default_model_dir(), "training.json")) as fh:
        return json.load(fh)


def default_model_description() -> str:
    """One line on what the default model is and what it was trained on (/v1/models, the start-up log)."""
    record = training_record()
    scores = record["evaluation"]
    return (f"{DEFAULT_MODEL_NAME}: a {record['parameters'] / 1e6:.1f}M-parameter Inkling (sliding and full layers, "
            f"MoE, MTP head) trained by train/ on the {record['corpus']['name']}, {record['corpus']['license']}; "
            f"held-out perplexity {scores['eval_perplexity']:.1f} (bigram baseline "
            f"{scores['eval_bigram_perplexity']:.1f}). A continuation model: it continues text in the style of the "
            "King James Bible and answers a chat message with what might follow it (docs/default-model.md)")
