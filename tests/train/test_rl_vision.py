"""Vision-language RL (`python -m train.rl` on chat prompts with images as data URLs), on the 2-layer `tiny` model
with its vision tower, in float32 with the reference kernels: the engine's prefill and the trainer's forward see
the same pixels through the same tower, the text weights train through it while the towers stay frozen, and
`--train-towers` trains the vision tower too. A run given no engine pool shuts its engine down at its end."""

import base64
import gc
import io
import json
import os
import threading

import jax
import numpy as np
import pytest
from PIL import Image

from inkling_jax import preset
from inkling_jax.parallel.mesh import make_mesh
from serve.http.tokenizer import ByteTokenizer
from tests.backends import REFERENCE
from train.checkpoint import Checkpoints
from train.rl import command
from train.rl.losses import LossConfig
from train.rl.media import image_reader, step_pixels
from train.rl.prompts import read_prompts
from train.rl.rollout import EnginePool, Rollouts, engine_config
from train.rl.step import PolicyTrainer
from train.run import first_layers
from train.state import seeded_params
from train.step import StepConfig, Trainer

CONFIG = first_layers(preset("tiny"), 2)
GROUP, PER_STEP, NEW_TOKENS = 4, 2, 6


def ascii_share(prompt: str, completion: str, **fields) -> float:
    return sum(c.isascii() for c in completion) / NEW_TOKENS


def png_url(rng, height, width):
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def image_prompts(tmp_path_factory):
    """Four chat prompts of one or two small images (4 to 6 placeholder tokens each) and some text."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(4):
        images = [{"type": "image_url", "image_url": {"url": png_url(rng, 5 + i, 9)}} for _ in range(1 + i % 2)]
        lines.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "Say:"}, *images]}]})
    path = tmp_path_factory.mktemp("vlm") / "images.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.fixture(scope="module")
def engines():
    with EnginePool() as pool:
        yield pool


def run(prompts, out, *extra, engines=None):
    command.main(["--preset", "tiny", "--layers", "2", "--prompts", prompts, "--reward", f"{__name__}:ascii_share",
                  "--out", str(out), "--group-size", str(GROUP), "--prompts-per-step", str(PER_STEP),
                  "--max-new-tokens", str(NEW_TOKENS), "--lr", "3e-2", "--steps", "2", "--no-tensorboard",
                  "--backend", "reference,moe=dense", *extra], engines)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def trainer_and_initial(**step):
    trainer = Trainer(CONFIG, make_mesh(None, jax.devices()[:1]), StepConfig(compute_dtype="float32",
                                                                              backend=REFERENCE, **step))
    return trainer, *trainer.init(seeded_params(CONFIG, 0, trainer.param_shardings()), 0)


def params_before_and_after(out, **step):
    """The complete parameters at the start and in the run's last checkpoint, on the host."""
    trainer, initial, frozen = trainer_and_initial(**step)
    checkpoints = Checkpoints(str(out / "checkpoints"), save_every=1, keep=1)
    state = checkpoints.restore_latest(trainer.abstract_state(initial), {})[0]
    checkpoints.close()
    return (jax.device_get(trainer.model_params(s, frozen)) for s in (initial, state))


def changed(out, **step):
    before, after = params_before_and_after(out, **step)
    return {n for n in before if not np.array_equal(before[n], after[n])}


def test_the_trainer_sees_the_pixels_the_engine_saw(image_prompts, engines):
    trainer, state, frozen = trainer_and_initial()
    prompts = read_prompts(image_prompts, ByteTokenizer(), 380, image_reader(CONFIG))
    assert [len(p.images) for p in prompts] == [1, 2, 1, 2] and min(p.image_tokens for p in prompts) > 0
    width, chosen = max(p.image_tokens for p in prompts), prompts[:PER_STEP]
    pixels, positions = step_pixels(chosen, width, CONFIG.vision)
    max_prompt = max(len(p.ids) for p in prompts)
    rollouts = Rollouts(trainer, state, frozen, engine_config(GROUP * PER_STEP, max_prompt, NEW_TOKENS), engines)
    groups = rollouts.generate([p.ids for p in chosen], [1, 2], GROUP, NEW_TOKENS, 1.0,
                               rollouts.media(state, frozen, pixels, positions))
    batch = command.policy_batch([p.ids for p in chosen], [c for g in groups for c in g], np.ones((PER_STEP, GROUP)),
                                 max_prompt + NEW_TOKENS) | {"pixels": pixels, "media_positions": positions}
    policy = PolicyTrainer(trainer, LossConfig(), 1.0)
    params = trainer.model_params(state, frozen)
    logprobs, _, mask = (np.asarray(x) for x in policy._logprobs(params, batch, 1.0)[1:])
    seen = np.abs(logprobs - batch["rollout_logprobs"]) * mask
    assert seen.max() < 1e-5
    # Other pixels give other logprobs, by far more than that: the images reach the trainer's forward.
    blank = np.asarray(policy._logprobs(params, dict(batch, pixels=np.zeros_like(pixels)), 1.0)[1])
    assert (np.abs(blank - batch["rollout_logprobs"]) * mask).max() > 10 * seen.max() + 1e-5


def test_a_run_trains_the_text_through_the_frozen_tower_and_lets_its_engine_go(image_prompts, tmp_path):
    engine_threads = lambda: sum(t.name == "inkling-engine" for t in threading.enumerate())  # noqa: E731
    gc.collect()
    threads, arrays = engine_threads(), len(jax.live_arrays())
    rows = run(image_prompts, tmp_path)
    assert engine_threads() == threads  # its engine was shut down
    gc.collect()
    assert len(jax.live_arrays()) <= arrays  # and its device arrays (engine, trainer) went with it
    for r in rows:
        assert r["logprob_abs_diff_max"] < 1e-5 and r["reward_std"] > 0
    moved = changed(tmp_path)
    assert any(n.startswith("layers.") for n in moved) and not any(n.startswith(("vision.", "audio.")) for n in moved)


def test_train_towers_trains_the_vision_tower(image_prompts, engines, tmp_path):
    rows = run(image_prompts, tmp_path, "--train-towers", engines=engines)
    # Step 2 sampled through step 1's tower: the engine's image rows came from the updated tower.
    assert rows[1]["logprob_abs_diff_max"] < 1e-5
    moved = changed(tmp_path, train_towers=True)
    assert any(n.startswith("vision.") for n in moved) and any(n.startswith("layers.") for n in moved)
    assert not any(n.startswith("audio.") for n in moved)  # no audio in the prompts: no gradient
