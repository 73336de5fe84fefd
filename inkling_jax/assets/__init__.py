"""Files shipped inside the package: the trained default model, `inkling-tiny` (docs/default-model.md), a
hub-layout directory (config.json, generation_config.json, tokenizer.json, the safetensors weights and
their index, training.json)
that `python -m serve.app` and `python -m inkling_jax` use when no --model is given."""

import os

DEFAULT_MODEL_NAME = "inkling-tiny"
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_MODEL_NAME)


def default_model_dir() -> str:
    """The shipped default model's directory; an error naming the rebuild command when it is missing."""
    if not os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        raise FileNotFoundError(f"{DEFAULT_MODEL_DIR}: the default model is missing from this installation; "
                                "rebuild it with `python -m train.default_model` or pass --model DIR")
    return DEFAULT_MODEL_DIR
