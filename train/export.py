"""A trained model written as a directory the server and transformers take as it is: the weights and
config.json in the hub layout (`inkling_jax.checkpoint.loading.save_pretrained`), its tokenizer.json, and a
generation_config.json that names its EOS (and keeps the source checkpoint's sampling defaults)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

from inkling_jax.checkpoint.loading import save_pretrained
from inkling_jax.config import GenerationConfig
from inkling_jax.config.generation import FILE as GENERATION_FILE
from train.tokenizer import byte_tokenizer

log = logging.getLogger(__name__)


def export(model, directory: str, *, dtype=None, tokenizer_file: str | None = None,
           generation: GenerationConfig | None = None) -> None:
    """tokenizer_file: copied beside the weights (None: the presets' byte tokenizer, written as a file).
    generation: the source's defaults (None: none); its stop tokens are the model's EOS first."""
    save_pretrained(model, directory, dtype=dtype)
    target = os.path.join(directory, "tokenizer.json")
    if tokenizer_file is None:
        byte_tokenizer().save(target)
    elif os.path.exists(tokenizer_file):
        shutil.copyfile(tokenizer_file, target)
    else:
        log.warning("%s does not exist: %s has no tokenizer.json and serves only token ids", tokenizer_file,
                    directory)
    generation = generation or GenerationConfig()
    eos = model.config.eos_token_id
    stops = (eos,) + tuple(i for i in generation.eos_token_ids if i != eos)
    with open(os.path.join(directory, GENERATION_FILE), "w") as fh:
        json.dump(dataclasses.replace(generation, eos_token_ids=stops).to_dict(), fh, indent=1)
