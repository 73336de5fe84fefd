"""RL post-training on our own serving engine: GRPO, Dr. GRPO or GSPO from verifiable rewards.

    python -m train.rl.tasks --task reverse --count 256 --out reverse.jsonl
    python -m train.rl --preset tiny --prompts reverse.jsonl --reward train.rl.tasks:answer_prefix \\
        --steps 50 --out runs/rl

Each step samples P prompts (seeded by --seed and the step), generates G completions of each with the serving
engine in this process at the current weights, recording every sampled token's logprob; scores them with the
reward; takes group-relative advantages; lets the trainer recompute the logprobs (with --routing-replay, routing
each position to the experts the engine chose), measure the train-rollout mismatch and take one clipped
policy-gradient step; then syncs the new weights into the engine (no disk). Prompts may hold images (a model with
a vision tower): engine and trainer run the same pixels through the tower, frozen unless --train-towers.
Under --out: `metrics.jsonl` (one line per step), `tensorboard/`, `checkpoints/` (orbax), and with LoRA
`adapters.safetensors` (as `train.run` writes them). Running the same command again resumes from the newest
checkpoint. docs/rl.md explains the losses and the metrics.

With --mesh the trainer is sharded over that mesh and the engine runs on the same devices (`train.rl.colocation`);
--free-engine-cache frees its cache while the trainer runs. Multi-host: run the same command on every host with
`--coordinator HOST0:PORT --num-processes N --process-id I` (none under SLURM or Open MPI): each process's engine
rolls out its share of the prompts on its own devices, and every process trains on all of them.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from inkling_jax.backend import add_backend_flag, add_batch_invariant_flag
from inkling_jax.config import load_config, preset
from inkling_jax.parallel.mesh import make_mesh
from serve.http.chat import ChatFormat
from serve.http.tokenizer import ByteTokenizer, load_tokenizer
from train import distributed, lora
from train.checkpoint import Checkpoints
from train.distributed import add_distributed_flags, check_distributed_flags
from train.metrics import MetricsWriter
from train.optim import OptimConfig
from train.rl.colocation import engine_mesh
from train.rl.losses import DEFAULT_CLIP, LOSSES, LossConfig, group_advantages
from train.rl.media import image_reader, step_pixels
from train.rl.prompts import completion_text, load_reward, read_prompts, score
from train.rl.rollout import EnginePool, Rollouts, engine_config
from train.rl.step import PolicyTrainer
from train.run import first_layers, initial_params
from train.step import StepConfig, Trainer

log = logging.getLogger("train.rl")
ROW_MULTIPLE = 16  # the trainer's rows are padded to a multiple of this: one compiled step per run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.rl", description=__doc__.split("\n\n")[0],
                                epilog="docs/rl.md: the losses, the metrics, a mesh and several processes, and a "
                                "demo.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory in the hub layout (its tokenizer.json encodes prompts)")
    src.add_argument("--preset", help="a named configuration with seeded random weights (tiny, inkling-tiny, ...) "
                     "and the byte-level tokenizer")
    p.add_argument("--prompts", required=True, help='JSONL: {"prompt": "..."} or {"messages": [...]} per line; '
                   "other fields go to the reward as keyword arguments")
    p.add_argument("--reward", required=True, help="MODULE:FUNCTION, f(prompt, completion, **fields) -> float "
                   "(built-in: train.rl.tasks:exact_match, :final_number, :answer_prefix, :charset_share)")
    p.add_argument("--steps", type=int, required=True, help="policy updates to reach")
    p.add_argument("--out", required=True, help="run directory: metrics, TensorBoard, checkpoints, adapters")
    p.add_argument("--group-size", type=int, default=8,
                   help="completions per prompt (G), the advantages' group (default 8)")
    p.add_argument("--prompts-per-step", type=int, default=4,
                   help="prompts per step (P, default 4); a step trains on P x G")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="longest completion in tokens, the EOS included (default 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, in (0, 2] (default 1)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate, constant (default 1e-5)")
    p.add_argument("--loss", choices=LOSSES, default="grpo", help="grpo: token-level clipped ratio, std-normalised "
                   "advantages (default); dr_grpo: no std, sum over tokens / constant; gspo: sequence-level ratio")
    p.add_argument("--clip-eps", type=float, help="clip range of the ratio (default: 0.2; gspo 3e-4)")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="weight of the k3 KL to the initial policy (default 0: off)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank only (default 0: all weights)")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA scale alpha (the update is alpha / rank "
                   "x A @ B; default 32)")
    p.add_argument("--routing-replay", action="store_true", help="the engine records each MoE layer's chosen "
                   "experts at every position, and the trainer's forward takes that choice (its router still "
                   "computes the weights, so gradients reach it)")
    p.add_argument("--train-towers", action="store_true", help="train the media towers too (full fine-tuning; by "
                   "default they are frozen)")
    p.add_argument("--dtype", help="compute dtype of trainer and engine (default: float32 on CPU, else bfloat16; "
                   "master weights and optimizer are fp32)")
    add_backend_flag(p)
    add_batch_invariant_flag(p, "the engine's logprobs equal the trainer's bit for bit at any concurrency "
                             "(logprob_abs_diff_max 0, the first update's ratios exactly 1)")
    p.add_argument("--mesh", help='the trainer\'s mesh, e.g. "fsdp=4,tensor=2" (devices left over go to data; '
                   "default: one device); the engine runs on the same devices over its tensor and expert axes")
    p.add_argument("--free-engine-cache", action="store_true", help="free the engine's KV cache while the trainer "
                   "runs and allocate it again for the next rollouts (default: kept)")
    p.add_argument("--layers", type=int, help="keep only the first N layers (presets only)")
    p.add_argument("--save-every", type=int, default=50,
                   help="checkpoint every N steps and after the last (default 50)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds a preset's weights, the prompts' order and the sampling (default 0)")
    p.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard logs (metrics.jsonl only)")
    add_distributed_flags(p)
    args = p.parse_args(argv)
    check_distributed_flags(p, args)
    checks = [(args.steps >= 0, "--steps must be >= 0"), (args.group_size >= 2, "--group-size must be >= 2 (the "
              "advantages compare completions of one prompt)"), (args.prompts_per_step >= 1,
              "--prompts-per-step must be >= 1"), (args.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
              (0 < args.temperature <= 2, "--temperature must be in (0, 2]"), (args.lr > 0, "--lr must be > 0"),
              (args.kl_coef >= 0, "--kl-coef must be >= 0"), (args.lora_rank >= 0, "--lora-rank must be >= 0"),
              (args.clip_eps is None or args.clip_eps > 0, "--clip-eps must be > 0"),
              (not (args.train_towers and args.lora_rank), "--train-towers trains the towers in full: not with "
               "--lora-rank"),
              (not args.layers or args.preset, "--layers works with --preset only"),
              (not (args.backend.batch_invariant and (args.mesh or args.coordinator)), "--batch-invariant runs on "
               "one device: not with --mesh or several processes")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    for path, flag in ((args.prompts, "--prompts"), (args.model, "--model")):
        if path and not os.path.exists(path):
            p.error(f"{flag} {path}: no such file or directory")
    args.clip_eps = DEFAULT_CLIP[args.loss] if args.clip_eps is None else args.clip_eps
    return args


def policy_batch(prompts: list[tuple[int, ...]], completions: list, advantages: np.ndarray, seq_len: int) -> dict:
    """One row per completion (prompt-major, prompt i's G completions in rows i * G ...): the trainer's batch, with
    the engine's routing record (`expert_ids`, -1 where none) where the completions carry one."""
    rows = len(completions)
    batch = {k: np.zeros((rows, seq_len), np.int32) for k in ("input_ids", "segment_ids", "positions", "loss_mask")}
    batch["rollout_logprobs"] = np.zeros((rows, seq_len), np.float32)
    recorded = completions[0].routed_experts is not None
    if recorded:
        batch["expert_ids"] = np.full((rows, seq_len, *completions[0].routed_experts.shape[1:]), -1, np.int32)
    group = rows // len(prompts)
    for row, completion in enumerate(completions):
        prompt = prompts[row // group]
        ids = list(prompt) + completion.token_ids
        n, start = len(ids), len(prompt)
        batch["input_ids"][row, :n] = ids
        batch["segment_ids"][row, :n] = 1
        batch["positions"][row, :n] = np.arange(n)
        batch["loss_mask"][row, start:n] = 1
        batch["rollout_logprobs"][row, start - 1:n - 1] = completion.logprobs  # where its token is predicted
        if recorded:  # every position but the last, whose choice no sampled token depends on
            if len(completion.routed_experts) != n - 1:
                raise RuntimeError(f"the engine recorded routing at {len(completion.routed_experts)} positions of a "
                                   f"sequence of {n} tokens; expected {n - 1}")
            batch["expert_ids"][row, :n - 1] = completion.routed_experts
    batch["advantages"] = advantages.reshape(-1).astype(np.float32)
    return batch


def step_plan(seed: int, step: int, num_prompts: int, per_step: int) -> tuple[np.ndarray, list[int]]:
    """(the step's prompt indices, a sampling seed per prompt): a function of (seed, step) alone, so a resumed run
    draws what an uninterrupted one does."""
    rng = np.random.default_rng([seed, step])
    chosen = rng.choice(num_prompts, per_step, replace=num_prompts < per_step)
    return chosen, [int(s) for s in rng.integers(0, 2**31, per_step)]


def main(argv=None, engines: EnginePool | None = None) -> None:
    """`engines`: where the run's rollout engine comes from and stays (reused by later runs in the process); by
    default the run makes its own and shuts it down at the end."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)  # where an import configured logging first (basicConfig then does nothing)
    distributed.initialize(args)  # before anything touches a device
    args.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if args.prompts_per_step % jax.process_count():
        raise SystemExit(f"--prompts-per-step {args.prompts_per_step} must split evenly over the "
                         f"{jax.process_count()} processes (each process's engine rolls out its share)")
    if engines is not None:
        return train(args, engines)
    with EnginePool() as own:
        return train(args, own)


def train(args: argparse.Namespace, engines: EnginePool) -> None:
    config = preset(args.preset) if args.preset else load_config(args.model)
    if args.layers:
        config = first_layers(config, args.layers)
    if args.train_towers and config.vision is None and config.audio is None:
        raise ValueError("--train-towers: this model has no media towers")
    tokenizer = ByteTokenizer() if args.preset else load_tokenizer(args.model)
    prompts = read_prompts(args.prompts, tokenizer, config.text.unpadded_vocab_size, image_reader(config))
    chat = ChatFormat(tokenizer) if any(p.chat for p in prompts) else None
    reward = load_reward(args.reward)
    max_prompt = max(len(p.ids) for p in prompts)
    seq_len = -(-(max_prompt + args.max_new_tokens) // ROW_MULTIPLE) * ROW_MULTIPLE
    image_width = max(p.image_tokens for p in prompts)  # the most image tokens of a prompt: a step's pixels

    several = args.mesh or jax.process_count() > 1  # else one device
    trainer = Trainer(config, make_mesh(args.mesh, jax.devices() if several else jax.devices()[:1]),
                      StepConfig(compute_dtype=args.dtype, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                                 backend=args.backend, train_towers=args.train_towers),
                      OptimConfig(learning_rate=args.lr, warmup_steps=0, total_steps=max(args.steps, 1),
                                  min_lr_ratio=1.0, weight_decay=0.0))
    state, frozen = trainer.init(initial_params(args, config, trainer), args.seed)
    policy = PolicyTrainer(trainer, LossConfig(args.loss, args.clip_eps, args.kl_coef, args.max_new_tokens),
                           args.temperature)
    reference = policy.reference_params(state, frozen)
    record = {"prompts": os.path.abspath(args.prompts), "reward": args.reward, "seed": args.seed,
              "group_size": args.group_size, "prompts_per_step": args.prompts_per_step, "loss": args.loss,
              "routing_replay": args.routing_replay, "train_towers": args.train_towers}
    checkpoints = Checkpoints(os.path.join(args.out, "checkpoints"), save_every=args.save_every, keep=args.keep)
    restored = checkpoints.restore_latest(trainer.abstract_state(state), record)
    state = restored[0] if restored else state
    start = int(state.step)

    share = args.prompts_per_step // jax.process_count() * args.group_size  # each process's engine's sequences
    rollouts = Rollouts(trainer, state, frozen, engine_config(share, max_prompt, args.max_new_tokens,
                                                              args.routing_replay, args.backend.batch_invariant),
                        engines, engine_mesh(trainer.mesh), args.free_engine_cache)
    log.info("%d prompts; a step: %d prompts x %d completions of up to %d tokens, trainer rows [%d, %d]; from step "
             "%d to %d", len(prompts), args.prompts_per_step, args.group_size, args.max_new_tokens,
             args.prompts_per_step * args.group_size, seq_len, start, args.steps)
    log.info("trainer on mesh %s; rollout engine on %s", dict(trainer.mesh.shape),
             rollouts.engine.runner.placement.devices)
    writer = MetricsWriter(args.out, tensorboard=not args.no_tensorboard)
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="rl", disable=jax.process_index() > 0)
    for step in bar:
        chosen, seeds = step_plan(args.seed, step, len(prompts), args.prompts_per_step)
        began = time.perf_counter()
        images = {}
        if image_width:  # the same pixels for the engine (through the current tower) and the trainer
            pixels, positions = step_pixels([prompts[i] for i in chosen], image_width, config.vision)
            images = {"pixels": pixels, "media_positions": positions}
        groups = rollouts.generate([prompts[i].ids for i in chosen], seeds, args.group_size, args.max_new_tokens,
                                   args.temperature, rollouts.media(state, frozen, **images) if images else None)
        rollout_s = time.perf_counter() - began
        completions = [c for group in groups for c in group]
        rewards = np.asarray([[score(reward, prompts[i], completion_text(prompts[i], c.token_ids, tokenizer, chat))
                               for c in group] for i, group in zip(chosen, groups)], np.float64)
        batch = policy_batch([prompts[i].ids for i in chosen], completions, group_advantages(rewards, args.loss),
                             seq_len) | images
        began = time.perf_counter()
        state, metrics = policy.step(state, frozen, reference, batch)
        metrics = jax.device_get(metrics)
        train_s = time.perf_counter() - began
        generated = int(metrics.pop("completion_tokens"))
        metrics.update(reward_mean=rewards.mean(), reward_std=rewards.std(),
                       response_len_mean=np.mean([len(c.token_ids) for c in completions]),
                       rollout_tokens_per_s=generated / rollout_s,
                       train_tokens_per_s=int(batch["segment_ids"].sum()) / train_s,
                       weight_sync_s=rollouts.sync(state, frozen), rollout_s=rollout_s, train_s=train_s)
        writer.write(step + 1, metrics)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{float(metrics['mismatch_kl']):.1e}")
        checkpoints.save(step + 1, state, record, force=step + 1 == args.steps)
    checkpoints.close()
    writer.close()
    if trainer.lora:
        lora.save_adapters(os.path.join(args.out, "adapters.safetensors"), state.params, args.lora_alpha)
