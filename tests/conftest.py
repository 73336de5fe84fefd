"""Shared fixtures: tiny random Inkling checkpoints written by transformers' `save_pretrained` (the genuine hub
layout, sharded with an index), with their PyTorch models kept as the numerical oracle."""

import jax
import pytest

from tests import hf_oracle

# fp32 matmuls at full precision, so parity tolerances mean the same on every CPU and GPU.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (directory, torch model); built once per session, on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = hf_oracle.write_checkpoint(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get
