"""`python -m train.rl` on a 2-layer `tiny` model in float32 with the reference kernels, trainer and engine alike.

The tests' task: the reward is the share of ASCII characters in 8-token completions (a random model writes about a
third; 256 of its 380 ids are bytes, half of them ASCII). The text runs have the same engine setup and share an
`EnginePool`, so one compiled engine (`train.rl.rollout`) and policy step (`train.rl.step`) serve them all.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax import preset
from inkling_jax.parallel.mesh import make_mesh
from serve.engine.sampling_params import InvalidParams, SamplingParams
from serve.http.chat import ChatFormat
from serve.http.tokenizer import ByteTokenizer
from serve.offline import generate
from tests.backends import REFERENCE
from train import lora
from train.checkpoint import Checkpoints
from train.rl import command, tasks
from train.rl.losses import LossConfig, group_advantages, mismatch_metrics, policy_loss, token_logprobs
from train.rl.prompts import completion_text, load_reward, read_prompts, score
from train.rl.rollout import EnginePool, Rollouts, engine_config
from train.rl.step import PolicyTrainer
from train.rl.tasks import write_tasks
from train.run import first_layers
from train.state import seeded_params
from train.step import StepConfig, Trainer

pytestmark = pytest.mark.heavy  # see conftest.py

STEPS = 30
CONFIG = first_layers(preset("tiny"), 2)
TIMING = {"rollout_tokens_per_s", "train_tokens_per_s", "weight_sync_s", "rollout_s", "train_s"}


def ascii_share(prompt: str, completion: str, **fields) -> float:
    return sum(c.isascii() for c in completion) / 8


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rl") / "digits.jsonl")
    write_tasks(path, "digits", 32)
    return path


@pytest.fixture(scope="module")
def engines():
    with EnginePool() as pool:
        yield pool


def arguments(prompts, out, *extra) -> list[str]:
    """The tests' command line."""
    return ["--preset", "tiny", "--layers", "2", "--prompts", prompts, "--reward", f"{__name__}:ascii_share",
            "--out", str(out), "--group-size", "8", "--prompts-per-step", "4", "--max-new-tokens", "8",
            "--lr", "3e-2", "--backend", "reference,moe=dense", *extra]


def run(prompts, out, *extra, engines=None):
    """The command's metrics; `engines`: the pool to take the engine from (None: the run's own, shut down at its
    end)."""
    command.main(arguments(prompts, out, *extra), engines)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def long_run(prompts, engines, tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    return out, run(prompts, out, "--steps", str(STEPS), engines=engines)


def test_reward_rises_and_rollouts_match_the_trainer(long_run):
    out, rows = long_run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward_mean"] for r in rows]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.1, rewards
    for r in rows:
        # The engine (fused projections, paged cache) and the trainer compute the same float32 function: the
        # sampled tokens' logprobs agree to float rounding, at every step, so every sync reached the engine.
        assert 0 <= r["logprob_abs_diff_mean"] <= r["logprob_abs_diff_max"] < 1e-5
        assert abs(r["mismatch_kl"]) < 1e-6
        assert r["clip_fraction"] == 0.0  # the ratios are within float rounding of 1, far inside the clip
        assert 0 < r["entropy"] <= np.log(380) + 1e-4 and 1 <= r["response_len_mean"] <= 8
        assert all(r[k] > 0 for k in TIMING)
    assert os.listdir(out / "tensorboard") and os.listdir(out / "checkpoints")


def test_the_rollout_engine_compiles_only_what_rollouts_run(long_run, engines):
    """Rollouts ask for their tokens' logprobs, never for their prompts', and draw at a temperature only: each
    engine of the pool compiled the full sampler's step programs alone, without filters, and no prompt-scoring
    program, and it refuses prompt logprobs and filters, saying why."""
    for engine in engines:
        assert {full for _, _, full in engine.runner._steps} == {True} and engine.runner._scoring is None
        assert engine.runner.programs.filters is False
        for params, why in ((SamplingParams(max_tokens=1, prompt_logprobs=1), "does not score prompts"),
                            (SamplingParams(max_tokens=1, top_p=0.9), "without filters")):
            with pytest.raises(InvalidParams, match=why):
                engine.submit("refused", [[1, 2, 3]], params, 1, lambda: None, lambda output: None)


def test_a_resumed_run_continues_with_the_same_metrics(prompts, engines, long_run, tmp_path):
    first = run(prompts, tmp_path, "--steps", "3", engines=engines)
    resumed = run(prompts, tmp_path, "--steps", "6", engines=engines)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for got, want in zip(resumed, long_run[1][:6]):
        assert {k: v for k, v in got.items() if k not in TIMING} == {k: v for k, v in want.items() if k not in TIMING}
    assert resumed[:3] == first


def test_lora_trains_only_adapters_and_the_engine_samples_with_them(prompts, engines, tmp_path):
    rows = run(prompts, tmp_path, "--steps", "2", "--lora-rank", "4", "--loss", "dr_grpo", "--kl-coef", "0.1",
               engines=engines)
    adapters, alpha = lora.load_adapters(str(tmp_path / "adapters.safetensors"))
    assert alpha == 32.0 and adapters and any(np.abs(x).max() > 0 for n, x in adapters.items() if n.endswith(lora.B))
    # The checkpoint's trained parameters are the adapters alone; the model they give differs from the initial one
    # only in the adapted weights.
    trainer = Trainer(CONFIG, make_mesh(None, jax.devices()[:1]), StepConfig(compute_dtype="float32", lora_rank=4))
    initial, frozen = trainer.init(seeded_params(CONFIG, 0, trainer.param_shardings()), 0)
    checkpoints = Checkpoints(str(tmp_path / "checkpoints"), save_every=1, keep=1)
    state = checkpoints.restore_latest(trainer.abstract_state(initial), {})[0]
    checkpoints.close()
    assert set(state.params) == set(adapters)
    before, after = (jax.device_get(trainer.model_params(s, frozen)) for s in (initial, state))
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed and changed <= set(lora.target_names(trainer.parts.shapes))
    # Step 2 sampled with step 1's adapters: the engine's logprobs match the trainer's, which have moved away from
    # the initial policy by far more than that (k3 ~ d^2 / 2 for a log ratio d).
    assert rows[1]["logprob_abs_diff_max"] < 1e-5 < 0.1 * np.sqrt(2 * rows[1]["kl_to_initial"])


def test_gspo_at_another_temperature(prompts, engines, tmp_path):
    rows = run(prompts, tmp_path, "--steps", "2", "--loss", "gspo", "--temperature", "0.7", engines=engines)
    for r in rows:
        assert 0 <= r["clip_fraction"] <= 1 and np.isfinite(r["loss"]) and r["logprob_abs_diff_max"] < 1e-5
    assert rows[1]["clip_fraction"] == 0.0  # the old policy is the trainer's own: ratios of exactly 1


def test_routing_replay_replays_the_choice_the_engine_recorded(prompts, engines, tmp_path):
    rows = run(prompts, tmp_path, "--steps", "2", "--routing-replay", engines=engines)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["logprob_abs_diff_max"] < 1e-5 and abs(r["mismatch_kl"]) < 1e-6 and np.isfinite(r["loss"])
    # At the weights that sampled them, the trainer's own routing of every recorded position is the engine's.
    trainer = Trainer(CONFIG, make_mesh(None, jax.devices()[:1]), StepConfig(compute_dtype="float32",
                                                                              backend=REFERENCE))
    state, frozen = trainer.init(seeded_params(CONFIG, 0, trainer.param_shardings()), 0)
    lines = read_prompts(prompts, ByteTokenizer(), 380)[:4]
    config = engine_config(32, max(len(p.ids) for p in lines), 8, record_experts=True)
    rollouts = Rollouts(trainer, state, frozen, config, engines)  # the run's engine, given the initial weights
    groups = rollouts.generate([p.ids for p in lines], [1, 2, 3, 4], 8, 8, 1.0)
    batch = command.policy_batch([p.ids for p in lines], [c for g in groups for c in g], np.ones((4, 8)), 32)
    recorded = batch["expert_ids"]
    assert recorded.shape == (32, 32, 1, 2)
    assert (recorded[..., 0, 0] >= 0).sum() == batch["segment_ids"].sum() - 32  # all but each row's last token
    params = trainer.model_params(state, frozen)
    _, chosen = trainer.parts.merge(params).hidden_states(jnp.asarray(batch["input_ids"]),
                                                           segment_ids=batch["segment_ids"],
                                                           positions=batch["positions"])
    own = np.asarray(chosen[0]).reshape(32, 32, 2)
    mask = recorded[..., 0, 0] >= 0
    np.testing.assert_array_equal(own[mask], recorded[..., 0, :][mask])
    # The trainer's forward takes the record: the same logprobs as routing afresh here, other ones (by far more
    # than float rounding; a random model's experts move them little) for another choice.
    policy = PolicyTrainer(trainer, LossConfig(), 1.0)
    logprobs = lambda b: np.asarray(policy._logprobs(params, b, 1.0)[1])  # noqa: E731
    plain = logprobs({k: v for k, v in batch.items() if k != "expert_ids"})
    np.testing.assert_allclose(logprobs(batch), plain, atol=1e-6)
    moved = dict(batch, expert_ids=np.where(recorded >= 0, (recorded + 1) % CONFIG.text.num_experts, -1))
    assert np.abs(logprobs(moved) - plain).max() > 2e-5


def test_the_engine_refuses_parameters_of_another_shape(engines, long_run):
    engine = next(iter(engines))  # the text runs' engine
    leaves = list(engine.runner.params)
    wrong = list(leaves)
    wrong[0] = leaves[0][..., :1]
    with pytest.raises(ValueError, match="does not replace"):
        engine.update_params(wrong)
    with pytest.raises(ValueError, match="parameter arrays for a view of"):
        engine.update_params(leaves[:-1])


def test_new_parameters_reach_the_engine_and_empty_its_prefix_cache(engines, long_run):
    engine = next(iter(engines))  # the text runs' engine
    hits = lambda: engine.metrics.registry.get_sample_value("inkling_prefix_cache_hit_tokens_total")  # noqa: E731
    prompt = list(range(40, 60))  # a full page and a bit: a second request reuses the page
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
    leaves = list(engine.runner.params)
    first = generate(engine, [prompt], params)[0]
    before = hits()
    assert generate(engine, [prompt], params)[0].logprobs == pytest.approx(first.logprobs, abs=1e-6)
    assert hits() > before
    engine.update_params([x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves])
    before = hits()
    other = generate(engine, [prompt], params)[0]
    assert hits() == before  # computed afresh under the new weights, not from the old weights' pages
    assert np.abs(np.subtract(other.logprobs, first.logprobs)).max() > 1e-3
    engine.update_params(leaves)
    assert generate(engine, [prompt], params)[0].logprobs == pytest.approx(first.logprobs, abs=1e-6)


def test_a_failed_swap_is_raised_to_the_sender_and_the_engine_keeps_serving(engines, long_run, monkeypatch):
    engine = next(iter(engines))  # the text runs' engine
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=0)
    before = generate(engine, [[5, 6, 7]], params)[0]

    def fail(leaves):
        raise MemoryError("no room for the new arrays")

    monkeypatch.setattr(engine.runner, "swap_params", fail)
    with pytest.raises(RuntimeError, match="could not swap in the new parameters: no room"):
        engine.update_params(list(engine.runner.params), timeout=60)
    assert engine.alive
    assert generate(engine, [[5, 6, 7]], params)[0].token_ids == before.token_ids


def test_mismatch_metrics_and_losses():
    mask = np.array([[1.0, 1.0, 0.0]], np.float32)
    trainer = np.array([[-1.0, -2.0, -9.0]], np.float32)
    rollout = np.array([[-1.5, -2.0, 0.0]], np.float32)
    m = {k: float(v) for k, v in mismatch_metrics(trainer, rollout, mask).items()}
    assert m["logprob_abs_diff_max"] == 0.5 and m["logprob_abs_diff_mean"] == 0.25
    assert np.isclose(m["mismatch_kl"], (np.exp(0.5) - 0.5 - 1) / 2)
    rewards = np.array([[0.0, 1.0, 1.0, 2.0]])
    assert np.allclose(group_advantages(rewards, "dr_grpo"), [[-1, 0, 0, 1]])
    assert np.allclose(group_advantages(rewards, "grpo"), [[-1, 0, 0, 1]] / np.std(rewards), atol=1e-5)
    logp, old = np.log([[0.5, 0.5]]), np.log([[0.25, 0.5]])  # ratio 2 on the first token, 1 on the second
    loss, extra = policy_loss(LossConfig("grpo", 0.2), logp, old, np.array([1.0]), np.ones((1, 2), np.float32))
    assert np.isclose(float(loss), -(1.2 + 1.0) / 2) and float(extra["clip_fraction"]) == 0.5


def test_token_logprobs_take_values_one_way_and_the_gradient_another():
    """`gradient_of` (a batch-invariant model's values with XLA's gradient): the terms are exactly those of the
    first logits function, their derivative that of the second (here twice the first, to tell them apart), with
    respect to the hidden states and to a weight both close over."""
    hidden, weight = jax.random.normal(jax.random.key(0), (2, 12, 8)), jax.random.normal(jax.random.key(1), (8, 16))
    targets = jax.random.randint(jax.random.key(2), (2, 12), 0, 16)

    def total(weight, hidden, double, gradient_of_double):
        logits = (lambda h: 2 * (h @ weight)) if double else (lambda h: h @ weight)
        gradient_of = ((lambda h: 2 * (h @ weight)), jax.nn.log_softmax) if gradient_of_double else None
        terms = token_logprobs(logits, hidden, targets, 0.7, 4, gradient_of=gradient_of)
        return sum(x.sum() for x in terms), terms

    grad = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)
    (_, single), _ = grad(weight, hidden, False, False)
    (_, mixed), mixed_grads = grad(weight, hidden, False, True)
    _, double_grads = grad(weight, hidden, True, False)
    assert all(np.array_equal(a, b) for a, b in zip(single, mixed, strict=True))
    for got, want in zip(mixed_grads, double_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_help_and_bad_input(prompts, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        command.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--preset", "--model", "--prompts", "--reward", "--steps", "--out", "--group-size",
                 "--prompts-per-step", "--max-new-tokens", "--temperature", "--lr", "--loss", "--kl-coef",
                 "--lora-rank", "--seed", "--batch-invariant"):
        assert flag in text
    base = ["--preset", "tiny", "--prompts", prompts, "--reward", "m:f", "--steps", "1", "--out", str(tmp_path)]
    for extra, message in ((["--group-size", "1"], "--group-size must be >= 2"),
                           (["--temperature", "0"], "--temperature must be in (0, 2]"),
                           (["--loss", "ppo"], "invalid choice"),
                           (["--model", "x"], "not allowed with argument --preset"),
                           (["--batch-invariant", "--mesh", "tensor=2"], "--batch-invariant runs on one device")):
        with pytest.raises(SystemExit) as exit_:
            command.parse_args(base + extra)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        command.parse_args(["--model", str(tmp_path), *base[2:], "--layers", "1"])
    assert exit_.value.code == 2 and "--layers works with --preset only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command.parse_args([*base[:3], str(tmp_path / "missing.jsonl"), *base[4:]])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        command.main([*base[:5], "no_colon", *base[6:]])
    image = tmp_path / "image.jsonl"
    image.write_text(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}) + "\n")
    with pytest.raises(ValueError, match="image.jsonl:1: the image cannot be decoded"):
        command.main([*base[:3], str(image), *base[4:]])
    with pytest.raises(SystemExit):
        command.parse_args(base + ["--train-towers", "--lora-rank", "4"])
    assert "--train-towers trains the towers in full" in capsys.readouterr().err


def test_prompts_rewards_and_tasks(tmp_path):
    tokenizer = ByteTokenizer()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "2+2="}]}]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n"
                    + json.dumps({"messages": messages, "answer": "4", "level": 3}) + "\n")
    text, chat = read_prompts(str(path), tokenizer, 380)
    assert text.ids == tuple(b"1+1=") and text.text == "1+1=" and text.fields == {"answer": "2"}
    assert chat.ids == tuple(ChatFormat(tokenizer).render(messages)) and chat.text == "2+2="
    assert chat.fields == {"answer": "4", "level": 3} and chat.chat and not text.chat
    chat_format = ChatFormat(tokenizer)
    answer = [chat_format.ids["<|message_model|>"], chat_format.reasoning_start, *b"hmm, 5?",
              chat_format.ids["<|content_text|>"], *b"4", chat_format.ids["<|content_model_end_sampling|>"]]
    assert completion_text(chat, answer, tokenizer, chat_format) == "4"  # the answer, without the reasoning
    assert completion_text(text, [*b"2", 257], tokenizer, None) == "2"  # the EOS has no text
    assert score(load_reward("train.rl.tasks:final_number"), chat, "so it is 4") == 1.0
    assert score(load_reward("train.rl.tasks:exact_match"), chat, " 4\n") == 1.0
    with pytest.raises(ValueError, match="not a finite number"):
        score(lambda prompt, completion, **fields: float("nan"), chat, "")
    with pytest.raises(ValueError, match="has no function"):
        load_reward("train.rl.tasks:nothing")
    for bad, message in (({"text": "x"}, "exactly one of"), ({"prompt": ""}, "non-empty string"),
                         ({"prompt": "\u0101"}, None)):
        path.write_text(json.dumps(bad) + "\n")
        if message is None:  # two bytes, both in the vocabulary: fine
            assert len(read_prompts(str(path), tokenizer, 380)[0].ids) == 2
            continue
        with pytest.raises(ValueError, match=message):
            read_prompts(str(path), tokenizer, 380)
    rng = np.random.default_rng(0)
    for task in tasks.TASKS:
        fields = tasks.make_task(task, rng)
        prompt = fields.pop("prompt")
        if task == "digits":
            assert tasks.charset_share(prompt, "12a4", **fields) == 0.75
        else:
            assert tasks.exact_match(prompt, fields["answer"], **fields) == 1.0
            assert tasks.answer_prefix(prompt, fields["answer"][:1] + "#", **fields) == 1 / len(fields["answer"])
    assert tasks.final_number("", "19 or 20", answer="20") == 1.0 and tasks.final_number("", "none", answer=1) == 0.0


def test_batch_invariant_rollouts_match_the_trainer_bit_for_bit(tmp_path):
    """--batch-invariant with prompts of 9 to 16 bytes (one prefill chunk of 16 tokens, a different count of real
    tokens in each row) and all 6 sequences running at once: at every step the trainer's and the engine's
    logprobs are equal, also once the weights have moved (norm weights of 1 hide rounding at the first), so the
    first update's ratios are exactly 1."""
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"prompt": "digits: " + "x" * n}) + "\n" for n in (1, 5, 8)))
    rows = run(str(path), tmp_path / "out", "--steps", "2", "--layers", "3", "--group-size", "2",
               "--max-new-tokens", "4", "--batch-invariant", "--no-tensorboard")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["logprob_abs_diff_max"] == 0.0 and r["mismatch_kl"] == 0.0 for r in rows)
    assert rows[0]["clip_fraction"] == 0.0
