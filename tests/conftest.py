"""Shared fixtures: tiny random Inkling checkpoints written by transformers' `save_pretrained` (the genuine hub
layout, sharded with an index), with their PyTorch models kept as the numerical oracle."""

import jax
import pytest

from tests import hf_oracle

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest without pytest-xdist: one process, nothing to schedule
    LoadFileScheduling = None

# The HTTP tests share one server (tests/serve/http/conftest.py, package scope): handed out as one unit, that
# package runs in one worker, which builds the server once instead of once per file it happens to receive.
SHARED_SERVER_PACKAGE = "tests/serve/http/"

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


if LoadFileScheduling is not None:
    class _FilesAndSharedServer(LoadFileScheduling):
        """`--dist loadfile`, with the shared server's package as one unit."""

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_SERVER_PACKAGE if scope.startswith(SHARED_SERVER_PACKAGE) else scope

    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "loadfile":
            return _FilesAndSharedServer(config, log)
        return None
