"""The RL demo notebook (notebooks/rl.ipynb, docs/rl.md's demo) runs top to bottom: the shipped default model's
reward rises on the built-in `digits` task (the notebook asserts it) within minutes on a CPU."""

import pytest

from tests.test_notebook import executed_text

pytestmark = pytest.mark.heavy  # see conftest.py


def test_rl_notebook_executes():
    assert "the reward rose from" in executed_text("rl.ipynb")
