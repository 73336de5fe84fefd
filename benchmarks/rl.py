"""RL post-training on one GPU (`train.rl`'s rollout engine, policy step and weight sync, random weights): rollout
output tok/s against the same engine serving the same load, train tok/s and MFU against the bf16 matmul ceiling
measured in the same run, weight-sync seconds, and the train-rollout mismatch per step, in three modes: fast
(`fast`), fast with routing replay (`replay`) and batch-invariant (`invariant`, whose slowdown against `fast` it
reports).

    python -m benchmarks.rl [--out DIR] [--profile]       # an H200: the `bench` preset, as many layers as fit
    python -m benchmarks.rl --preset tiny --concurrency 4 --group-size 2 --prompt-tokens 8 --output-tokens 8 \\
        --steps 1                                          # a functional check on CPU

Each mode builds the trainer (`train.step.Trainer`, `train.rl.step.PolicyTrainer`, GRPO) and its rollout engine
(`train.rl.rollout.Rollouts`, `engine_config` as `train.rl` sizes it) from the same seeded weights, then runs
1 + `--steps` steps: `--concurrency` / `--group-size` prompts of `--prompt-tokens` random ids, `--group-size`
completions of each, up to `--output-tokens` tokens at temperature 1; a reward (the share of even token ids: any
reward with a spread will do); the policy step; the weight sync. The first step compiles and is left out of the
timings (its mismatch is kept). Then the serving reference on the same engine: `benchmarks.serving.run_load` at
the same concurrency, prompt and output lengths (its first prompts are the rollouts' prompts; greedy, EOS ignored),
the median of three runs after a warm-up; rollout/serving is the mode's median rollout tok/s over it.
MFU: model FLOPs per trained token (`benchmarks.rl_memory.model_flops_per_token`) x train tok/s (prompt and
completion tokens) / the ceiling (a jitted bf16 8192^3 matmul on random data).

Memory: the trainer and the engine share the device; the default layer count is the most that the plan of
`benchmarks.rl_memory` fits (printed). By default the embedding and the LM head are frozen (`--freeze`), so that
at the `bench` widths a MoE layer fits beside the 201k-entry vocabulary's 2.5B parameters; `--freeze ''` trains
every weight, `--lora-rank R` only adapters. The table is printed last, also on SIGTERM (the modes done so far),
and `rl.json` is written into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import statistics
import time

import jax
import numpy as np

from benchmarks.profile import device_op_times, op_table
from benchmarks.rl_memory import (
    device_bytes,
    layers_that_fit,
    memory_plan,
    model_flops_per_token,
    plan_lines,
)
from benchmarks.serving import random_prompts, run_load
from benchmarks.timing import attempt, matmul_flops, save_json, show_progress_logs, stamp, stamp_line
from inkling_jax.backend import add_backend_flag, start_cpu_without_fma
from inkling_jax.config import preset
from inkling_jax.parallel.mesh import make_mesh
from train.optim import OptimConfig
from train.rl.colocation import engine_mesh
from train.rl.command import ROW_MULTIPLE, policy_batch, step_plan
from train.rl.losses import DEFAULT_CLIP, LossConfig, group_advantages
from train.rl.rollout import EnginePool, Rollouts, engine_config
from train.rl.step import PolicyTrainer
from train.run import first_layers
from train.state import seeded_params
from train.step import StepConfig, Trainer

MODES = {"fast": (False, False), "replay": (True, False), "invariant": (False, True)}  # (replay, batch-invariant)
LOGITS_CHUNK = 64  # positions per row whose logits exist at once in the policy step (fp32 over a 201k vocabulary)
SERVING_RUNS = 3
MEMORY_FRACTION = "0.95"  # of the GPU's memory XLA may take (its default, 0.75, leaves a fifth of it unused)


class Terminated(BaseException):
    """SIGTERM: stop, and report the modes done (not an Exception: `attempt` must not take it for a failed mode)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.rl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench", help="the model's widths (tiny: a check on CPU)")
    p.add_argument("--layers", type=int, help="keep the preset's first N layers (default: the most that fit)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode, after a first (compiling) one")
    p.add_argument("--concurrency", type=int, default=32, help="sequences of a step, all running at once (P x G)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128, help="the longest completion")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--freeze", default=r"^embed$,^unembed$", help="comma-separated regexes of weights kept frozen "
                   "(default: the embedding and the LM head; '' trains every weight)")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank only (default 0)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    p.add_argument("--dtype", help="compute dtype (default: float32 on CPU, else bfloat16)")
    add_backend_flag(p)
    p.add_argument("--ceiling-n", type=int, help="size of the bf16 matmul ceiling (default: 8192 on GPU, else 256)")
    p.add_argument("--profile", action="store_true", help="also print where a rollout's and a policy step's device "
                   "time goes, per mode (`benchmarks.profile`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for rl.json (default: $OUT or .)")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.freeze = tuple(f for f in args.freeze.split(",") if f)
    checks = [(set(args.modes) <= set(MODES) and args.modes, f"--modes: choose from {', '.join(MODES)}"),
              (args.steps >= 1, "--steps must be >= 1"), (args.group_size >= 2, "--group-size must be >= 2"),
              (args.concurrency % args.group_size == 0, "--concurrency must be a multiple of --group-size"),
              (args.prompt_tokens >= 1 and args.output_tokens >= 1, "--prompt-tokens and --output-tokens must be >= 1"),
              (args.layers is None or args.layers >= 1, "--layers must be >= 1")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


def run_mode(args, config, mode: str, seq_len: int) -> dict:
    """The mode's steps and its serving reference (module doc)."""
    replay, invariant = MODES[mode]
    trainer = Trainer(config, make_mesh(None, jax.devices()[:1]),
                      StepConfig(compute_dtype=args.dtype, lora_rank=args.lora_rank, freeze=args.freeze,
                                 backend=dataclasses.replace(args.backend, batch_invariant=invariant)),
                      OptimConfig(learning_rate=args.lr, warmup_steps=0, total_steps=args.steps + 1,
                                  min_lr_ratio=1.0, weight_decay=0.0))
    began = time.perf_counter()
    state, frozen = trainer.init(seeded_params(config, args.seed, trainer.param_shardings(),
                                               trainer.compiler_options), args.seed)
    result = {"mode": mode, "routing_replay": replay, "batch_invariant": invariant,
              "init_s": time.perf_counter() - began, "steps": []}
    policy = PolicyTrainer(trainer, LossConfig("grpo", DEFAULT_CLIP["grpo"], 0.0, args.output_tokens), 1.0,
                           LOGITS_CHUNK)
    count, vocab = args.concurrency // args.group_size, config.text.unpadded_vocab_size
    prompts = [tuple(p) for p in random_prompts(vocab, count, args.prompt_tokens, args.seed)]
    with EnginePool() as pool:
        began = time.perf_counter()
        # train.rl's engine, plus the plain sampler's programs: the serving reference's greedy requests run them,
        # as the serving benchmark's do
        served = dataclasses.replace(engine_config(args.concurrency, args.prompt_tokens, args.output_tokens, replay,
                                                   invariant), full_sampler_only=False)
        rollouts = Rollouts(trainer, state, frozen, served, pool, engine_mesh(trainer.mesh))
        result["engine_start_s"] = time.perf_counter() - began
        for step in range(args.steps + 1):
            chosen, seeds = step_plan(args.seed, step, count, count)
            began = time.perf_counter()
            groups = rollouts.generate([prompts[i] for i in chosen], seeds, args.group_size, args.output_tokens, 1.0)
            rollout_s = time.perf_counter() - began
            completions = [c for group in groups for c in group]
            rewards = np.asarray([[np.mean(np.asarray(c.token_ids) % 2 == 0) for c in g] for g in groups])
            batch = policy_batch([prompts[i] for i in chosen], completions, group_advantages(rewards, "grpo"),
                                 seq_len)
            began = time.perf_counter()
            state, metrics = policy.step(state, frozen, None, batch)
            metrics = jax.device_get(metrics)
            train_s = time.perf_counter() - began
            sync_s = rollouts.sync(state, frozen)
            generated = sum(len(c.token_ids) for c in completions)
            result["steps"].append({
                "step": step, "rollout_s": rollout_s, "train_s": train_s, "weight_sync_s": sync_s,
                "step_s": rollout_s + train_s + sync_s, "rollout_tokens_per_s": generated / rollout_s,
                "train_tokens_per_s": int(batch["segment_ids"].sum()) / train_s, "generated_tokens": generated,
                **{k: float(metrics[k]) for k in ("mismatch_kl", "logprob_abs_diff_max", "logprob_abs_diff_mean",
                                                  "clip_fraction", "loss")}})
            print(f"{mode} step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in result["steps"][-1].items()
                                                     if k != "step"), flush=True)
        if args.profile:
            state = profile_step(mode, rollouts, policy, state, frozen, batch, [prompts[i] for i in chosen], seeds,
                                 args)
        engine = rollouts.engine
        run_load(engine, args.concurrency, args.prompt_tokens, 4, vocab, seed=args.seed)  # first calls: compiles
        result["serving"] = [run_load(engine, args.concurrency, args.prompt_tokens, args.output_tokens, vocab,
                                      seed=args.seed) for _ in range(SERVING_RUNS)]
    stats = jax.devices()[0].memory_stats() or {}
    result["peak_bytes"] = stats.get("peak_bytes_in_use")
    return summarise(result)


def profile_step(mode: str, rollouts, policy, state, frozen, batch, prompts, seeds, args):
    """Prints the device time by operation of a rollout and of a policy step (the last step's prompts and batch);
    returns the state after the profiled policy steps."""
    print(f"{mode} rollout, device time by operation:\n" + op_table(device_op_times(
        lambda: rollouts.generate(prompts, seeds, args.group_size, args.output_tokens, 1.0), calls=1)), flush=True)
    held = [state]

    def train():
        held[0], metrics = policy.step(held[0], frozen, None, batch)
        return metrics

    print(f"{mode} policy step, device time by operation:\n" + op_table(device_op_times(train, calls=1)),
          flush=True)
    return held[0]


def summarise(result: dict) -> dict:
    """Medians over the timed steps (all but the first) and of the serving runs."""
    timed = result["steps"][1:]
    for key in ("rollout_tokens_per_s", "train_tokens_per_s", "weight_sync_s", "step_s", "rollout_s", "train_s"):
        result[key] = statistics.median(s[key] for s in timed)
    result["serving_tokens_per_s"] = statistics.median(r["tok_s"] for r in result["serving"])
    result["rollout_over_serving"] = result["rollout_tokens_per_s"] / result["serving_tokens_per_s"]
    return result


def table(results: dict, flops_per_token: float, ceiling: float) -> str:
    """One row per mode; each mode's slowdown against fast (step time, and rollout tok/s)."""
    fast = results.get("fast") or {}
    rows = [("| mode | rollout tok/s | serving tok/s | rollout/serving | train tok/s | MFU | weight sync s | step s | "
             "vs fast (step, rollout) | mismatch_kl per step | logprob_abs_diff_max per step | process peak GiB |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]
    for mode, r in results.items():
        if "error" in r:
            rows.append(f"| {mode} | failed: {r['error'][:200]} |" + " |" * 10)
            continue
        vs = (f"{r['step_s'] / fast['step_s']:.2f}x, {fast['rollout_tokens_per_s'] / r['rollout_tokens_per_s']:.2f}x"
              if "step_s" in fast and mode != "fast" else "")
        kl = ", ".join(f"{s['mismatch_kl']:.1e}" for s in r["steps"])
        diff = ", ".join(f"{s['logprob_abs_diff_max']:.1e}" for s in r["steps"])
        mfu = r["train_tokens_per_s"] * flops_per_token / ceiling
        rows.append(f"| {mode} | {r['rollout_tokens_per_s']:,.0f} | {r['serving_tokens_per_s']:,.0f} | "
                    f"{r['rollout_over_serving']:.2f} | {r['train_tokens_per_s']:,.0f} | {mfu:.3f} | "
                    f"{r['weight_sync_s']:.3f} | {r['step_s']:.2f} | {vs} | {kl} | {diff} | "
                    f"{(r.get('peak_bytes') or 0) / 2**30:.1f} |")
    return "\n".join(rows)


def terminate(signum, frame):
    raise Terminated()


def main(argv=None):
    args = parse_args(argv)
    show_progress_logs()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION)  # read when the GPU is first used
    if any(MODES[mode][1] for mode in args.modes):
        start_cpu_without_fma()  # before jax starts its backend (the invariant mode on CPU)
    previous = signal.signal(signal.SIGTERM, terminate)
    gpu = jax.default_backend() == "gpu"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    base = preset(args.preset)
    seq_len = -(-(args.prompt_tokens + args.output_tokens) // ROW_MULTIPLE) * ROW_MULTIPLE  # as train.rl's rows
    engine = engine_config(args.concurrency, args.prompt_tokens, args.output_tokens)
    plan_args = {"engine": engine, "rows": args.concurrency, "seq_len": seq_len, "logits_chunk": LOGITS_CHUNK,
                 "dtype": args.dtype, "freeze": args.freeze, "lora_rank": args.lora_rank}
    budget = device_bytes()
    if args.layers is None:
        args.layers = (layers_that_fit(lambda n: first_layers(base, n), base.text.num_layers, budget, **plan_args)
                       if budget else base.text.num_layers)
    config = first_layers(base, args.layers)
    moe_layers = sum(not config.text.is_dense(i) for i in range(args.layers))
    flops_per_token = model_flops_per_token(config, seq_len, args.freeze, args.lora_rank)
    found = {"args": vars(args) | {"backend": str(args.backend)}, "stamp": stamp(), "modes": {}}
    print(stamp_line(found["stamp"]))
    print(f"preset {args.preset}, first {args.layers} layers ({moe_layers} MoE), {args.dtype}; "
          f"{'LoRA rank ' + str(args.lora_rank) if args.lora_rank else 'frozen: ' + (', '.join(args.freeze) or 'none')}"
          f"; a step: {args.concurrency // args.group_size} prompts x {args.group_size} completions, prompt "
          f"{args.prompt_tokens}, output up to {args.output_tokens}, trainer rows [{args.concurrency}, {seq_len}]")
    found["memory_plan"] = memory_plan(config, **plan_args)
    print("\n".join(plan_lines(found["memory_plan"], budget)), flush=True)
    found["ceiling_flops"] = matmul_flops(args.ceiling_n or (8192 if gpu else 256), data="normal")
    found["flops_per_token"] = flops_per_token
    os.makedirs(args.out, exist_ok=True)
    try:
        for mode in args.modes:
            if MODES[mode][0] and not moe_layers:  # the engine would refuse to record: say why, and go on
                found["modes"][mode] = {"error": f"no MoE layer in the first {args.layers} layers: nothing to replay"}
                continue
            errors: dict = {}
            found["modes"][mode] = attempt(mode, lambda mode=mode: run_mode(args, config, mode, seq_len), errors) or \
                {"error": errors.get(mode, "failed")}
            gc.collect()
    except Terminated:
        print("SIGTERM: the modes done so far", flush=True)
    finally:
        save_json(args.out, "rl.json", found)
        print(f"bf16 matmul ceiling {found['ceiling_flops'] / 1e12:.1f} TFLOP/s; model FLOPs per trained token "
              f"{flops_per_token / 1e9:.2f} G")
        print(table(found["modes"], flops_per_token, found["ceiling_flops"]), flush=True)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
