"""`python -m train.run` end to end (data-parallel over 2 of the simulated CPU devices, so that the state is
sharded yet the 100 steps stay quick): 50 steps on the tiny preset over a small repeated corpus drive the loss
well down; a run stopped at step 25 and resumed from its checkpoint logs exactly the losses of the uninterrupted
run. Sharded equivalence is in test_train_step.py; the LoRA CLI run uses all 8 devices."""

import json
import os

import jax
import pytest

from train.run import main

pytestmark = pytest.mark.heavy  # see conftest.py

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.",
             "How vexingly quick daft zebras jump!", "Sphinx of black quartz, judge my vow."]


def run(data, out, *extra):
    main(["--preset", "tiny", "--layers", "3", "--data", str(data), "--out", str(out), "--steps", "50",
          "--devices", "2", "--mesh", "data=2", "--seq-len", "64", "--batch", "4", "--lr", "1e-1", "--warmup", "5",
          "--save-every", "10", "--keep", "2", "--fast-compile", "--bias-update-rate", "1e-3", *extra])


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_fifty_steps_learn_and_resume_is_exact(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(SENTENCES * 6))

    run(data, tmp_path / "whole")
    whole = metrics(tmp_path / "whole")
    assert [r["step"] for r in whole] == list(range(1, 51))
    first, last = whole[0]["loss"], sum(r["loss"] for r in whole[-5:]) / 5
    assert first > 5.5 and last < 2.0, (first, last)  # ln(380) = 5.94 at the start
    for key in ("grad_norm", "tokens_per_s", "mfu", "lr", "expert_load_max_over_mean", "expert_load_cv"):
        assert key in whole[-1]
    assert os.listdir(tmp_path / "whole" / "tensorboard")
    assert sorted(os.listdir(tmp_path / "whole" / "checkpoints")) == ["40", "50"]

    run(data, tmp_path / "split", "--stop-at", "25")
    assert [r["step"] for r in metrics(tmp_path / "split")] == list(range(1, 26))
    run(data, tmp_path / "split")
    split = metrics(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 51))
    assert [r["loss"] for r in split] == [r["loss"] for r in whole]
    assert [r["grad_norm"] for r in split] == [r["grad_norm"] for r in whole]
