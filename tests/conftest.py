"""Shared fixtures: tiny random Inkling checkpoints written by transformers' `save_pretrained` (the genuine hub
layout, sharded with an index), with their PyTorch models kept as the numerical oracle."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from tests import hf_oracle  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (directory, torch model); built once per session, on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = hf_oracle.write_checkpoint(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get
