"""What train.run adds for a small model trained from scratch: held-out evaluation with count baselines on the
same tokens, an MTP loss that trains the head, a warm-up that fits short runs, and an export that serves."""

import json
import math
import os

import numpy as np
import pytest

from train.data import pack
from train.ngram import DISCOUNT, NgramBaselines
from train.run import main, parse_args

TEXT = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"]


def test_count_baselines_by_hand():
    rows = pack([(np.asarray([1, 2, 1, 3]), np.ones(4, np.uint8)), (np.asarray([1, 2]), np.ones(2, np.uint8))], 8)
    baselines = NgramBaselines.fit(rows, vocab_size=4)
    # Targets 2, 1, 3, 2 (pairs across the two documents do not count): add-one counts over 4 ids.
    np.testing.assert_allclose(baselines.unigram, np.asarray([1, 2, 3, 2]) / 8)
    held = pack([(np.asarray([1, 3]), np.ones(2, np.uint8)), (np.asarray([0, 1]), np.ones(2, np.uint8))], 8)
    scores = NgramBaselines.fit(rows, 4).losses(held)
    # After 1 (seen 3 times, 2 successors: 2 twice, 3 once) comes 3; after 0 (never seen) the unigram.
    p13 = (1 - DISCOUNT) / 3 + DISCOUNT * 2 / 3 * baselines.unigram[3]
    assert scores["bigram_loss"] == pytest.approx(-(math.log(p13) + math.log(baselines.unigram[1])) / 2)
    assert scores["unigram_loss"] == pytest.approx(-(math.log(2 / 8) + math.log(2 / 8)) / 2)
    assert scores["tokens"] == 2


def test_the_warm_up_is_a_fraction_of_the_run():
    args = ["--preset", "tiny", "--data", "x.txt", "--out", "o"]
    assert parse_args(args + ["--steps", "20"]).warmup == 1
    assert parse_args(args + ["--steps", "2000"]).warmup == 100
    assert parse_args(args + ["--steps", "20", "--warmup", "5"]).warmup == 5


def test_eval_mtp_and_export(tmp_path):
    from inkling_jax import load_config, load_pretrained, preset
    from inkling_jax.config import load_generation_config
    from serve.http.tokenizer import load_tokenizer
    from train.run import first_layers

    data, held = tmp_path / "train.txt", tmp_path / "held.txt"
    data.write_text("\n\n".join(TEXT * 4))
    held.write_text("the cat sat on the log\n\na dog and a mat")
    out, export = tmp_path / "run", tmp_path / "export"
    main(["--preset", "tiny", "--layers", "2", "--data", str(data), "--eval-data", str(held), "--steps", "3",
          "--out", str(out), "--export", str(export), "--seq-len", "32", "--batch", "2", "--lr", "1e-2",
          "--mtp-weight", "0.5", "--dtype", "float32", "--fast-compile", "--no-tensorboard", "--devices", "1"])
    with open(out / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    assert all("mtp_loss" in r for r in rows) and rows[0]["lr"] > 0
    last = rows[-1]
    assert last["eval_unigram_loss"] > last["eval_bigram_loss"] and last["eval_tokens"] == 36
    assert math.isclose(last["eval_perplexity"], math.exp(last["eval_loss"])) and "eval_mtp_loss" in last

    config = first_layers(preset("tiny"), 2)
    assert load_config(export) == config  # EOS included: generation_config.json names the same one
    assert load_generation_config(export).eos_token_ids == (config.eos_token_id,)
    tokenizer = load_tokenizer(str(export))  # the presets' bytes, as a tokenizer.json the server reads
    assert tokenizer.encode("hé") == list("hé".encode()) and tokenizer.token_id("<|content_model_end_sampling|>") == 257
    trained = load_pretrained(export, progress=False)
    from train.state import model_params, seeded_params

    start = seeded_params(config, 0)
    moved = model_params(trained)
    assert not np.allclose(moved["mtp.layers.0.input_proj.kernel"], start["mtp.layers.0.input_proj.kernel"])
    assert os.path.exists(export / "config.json")


def test_mtp_self_distillation_trains_the_head_alone(tmp_path):
    """--mtp-distill: the exported model's trunk is the initial one, bit for bit; its MTP head moved, and its
    distillation loss fell."""
    from inkling_jax import load_pretrained, preset
    from train.run import first_layers
    from train.state import model_params, seeded_params

    data = tmp_path / "train.txt"
    data.write_text("\n\n".join(TEXT * 4))
    out, export = tmp_path / "run", tmp_path / "export"
    main(["--preset", "tiny", "--layers", "2", "--data", str(data), "--steps", "4", "--out", str(out),
          "--export", str(export), "--seq-len", "32", "--batch", "2", "--lr", "1e-2", "--warmup", "0",
          "--mtp-weight", "1", "--mtp-distill", "--dtype", "float32", "--fast-compile", "--no-tensorboard",
          "--devices", "1"])
    with open(out / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    assert rows[-1]["mtp_loss"] < rows[0]["mtp_loss"]
    start, trained = seeded_params(first_layers(preset("tiny"), 2), 0), model_params(load_pretrained(export,
                                                                                                    progress=False))
    moved = {name for name in start if not np.array_equal(np.asarray(start[name]), np.asarray(trained[name]))}
    assert moved and all(name.startswith("mtp.") for name in moved)
