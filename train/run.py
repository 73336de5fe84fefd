"""Train or fine-tune Inkling from the command line.

    python -m train.run --preset tiny --data corpus.txt --steps 200 --out runs/tiny
    python -m train.run --model path/to/Inkling --data sft.jsonl --steps 1000 --out runs/sft \\
        --mesh fsdp=4,tensor=2 --lora-rank 16 --batch 32 --accum 4 --seq-len 4096 --remat full

With `--eval-data` it reports the held-out loss and perplexity every `--eval-every` steps and after the last
(`--steps 0` only evaluates), with unigram and bigram baselines of the training rows on the same tokens;
`python -m train.evaluate` scores a model directory the same way without training.
`--export DIR` writes the model with its tokenizer.json and generation_config.json, ready to serve.

Running the same command again with the same `--out` resumes from the newest checkpoint (parameters, optimizer,
step, RNG, data position) and continues to `--steps`. Under `--out`: `checkpoints/` (orbax), `metrics.jsonl`
(one line per step), `tensorboard/`, and with LoRA `adapters.safetensors`.

Multi-host: run the same command on every host, each with `--coordinator HOST0:PORT --num-processes N
--process-id I`; under SLURM or Open MPI no flag is needed (`train.distributed`, docs/scale.md). The mesh then
spans every host's devices and `--out` must be on a filesystem all hosts share: every process writes its shards
of each checkpoint, process 0 commits it and alone writes metrics, TensorBoard, adapters and the export. Every
process packs the same data file (the rows are a pure function of it) and places only its own rows of each
batch on its devices.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from inkling_jax.backend import add_backend_flag
from inkling_jax.config import InklingConfig, load_config, load_generation_config, preset
from inkling_jax.nn.model import REMAT_POLICIES
from inkling_jax.parallel.mesh import make_mesh
from train import distributed, lora
from train.checkpoint import Checkpoints
from train.data import Batches, byte_tokenizer, file_tokenizer, pack, read_documents
from train.distributed import add_distributed_flags, check_distributed_flags, host_copy
from train.evaluate import Evaluator
from train.export import export
from train.metrics import MetricsWriter, peak_flops, train_flops_per_token
from train.optim import OptimConfig
from train.state import ModelParts, pretrained_params, seeded_params
from train.step import StepConfig, Trainer

log = logging.getLogger("train")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.run", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory in the hub layout")
    src.add_argument("--preset", help="a named configuration with seeded random weights (tiny, bench, ...)")
    p.add_argument("--data", required=True, help="tokenised .jsonl, or plain text (documents split by blank lines)")
    p.add_argument("--tokenizer", help="tokenizer.json for plain-text data, exported with the model (default: the "
                   "--model directory's; presets: UTF-8 bytes)")
    p.add_argument("--eval-data", help="held-out data (same formats as --data): loss, perplexity and count "
                   "baselines in metrics.jsonl")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: after the last only)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to reach (0: evaluate only)")
    p.add_argument("--out", required=True)
    p.add_argument("--mesh", default=None, help='e.g. "fsdp=4,tensor=2"; devices left over go to data')
    p.add_argument("--devices", type=int, help="use only the first N devices (one host; default: all)")
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--adapters", help="continue from LoRA adapters in this safetensors file")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="rows per optimizer step (all microbatches)")
    p.add_argument("--accum", type=int, default=1, help="microbatches per step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, help="linear warm-up steps (default: 5%% of --steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip (0: off)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (master weights and optimizer are fp32)")
    p.add_argument("--remat", default="none", choices=sorted(REMAT_POLICIES))
    p.add_argument("--loss-chunk", type=int, default=1024, help="positions per row whose logits exist at once")
    p.add_argument("--bias-update-rate", type=float, default=0.0,
                   help="aux-loss-free MoE balancing: per-step change of the selection biases (0: off)")
    p.add_argument("--freeze", action="append", default=[], help="regex of weights not to train (repeatable)")
    p.add_argument("--mtp-weight", type=float, default=0.0,
                   help="train the MTP head too, on this weight times its mean loss over depths (0: frozen)")
    p.add_argument("--mtp-distill", action="store_true",
                   help="train only the MTP head (the model frozen), on the model's own distribution of each "
                   "depth's token (self-distillation: fit a head to a fine-tuned model); needs --mtp-weight")
    add_backend_flag(p)
    p.add_argument("--layers", type=int, help="keep only the first N layers (presets only)")
    p.add_argument("--stop-at", type=int, help="leave after this step (checkpointed), e.g. to fit a job's time "
                   "limit; the schedule still runs to --steps and the next run resumes")
    p.add_argument("--time-limit", type=float, help="leave (checkpointed, evaluated, exported) after the step that "
                   "passes this many seconds of training, like --stop-at")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: by device kind)")
    p.add_argument("--export", help="after training, write the (LoRA-merged) model here in the hub layout")
    p.add_argument("--no-tensorboard", action="store_true")
    p.add_argument("--fast-compile", action="store_true", help="lower XLA backend optimisation (small CPU runs)")
    add_distributed_flags(p)
    args = p.parse_args(argv)
    check_distributed_flags(p, args)
    if args.batch % args.accum:
        p.error(f"--batch {args.batch} is not a multiple of --accum {args.accum}")
    if args.layers and not args.preset:
        p.error("--layers works with --preset only (a checkpoint has all its layers)")
    if args.warmup is None:
        args.warmup = args.steps // 20
    return args


def first_layers(config: InklingConfig, n: int) -> InklingConfig:
    t = config.text
    return config.replace(num_layers=n, local_layer_ids=tuple(i for i in t.local_layer_ids if i < n),
                          dense_layer_ids=tuple(i for i in t.dense_layer_ids if i < n))


def initial_params(args, config: InklingConfig, trainer: Trainer):
    """fp32 parameters, placed on their shardings as they are made (seeded for presets, read for --model)."""
    shardings = trainer.param_shardings()
    if args.preset:
        return seeded_params(config, args.seed, shardings, trainer.compiler_options)
    return pretrained_params(args.model, config, shardings, progress=jax.process_index() == 0)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)  # where an import configured logging first (absl, under orbax), at WARNING
    if distributed.initialize(args) and args.devices:
        raise SystemExit("--devices picks devices of one process; a multi-process mesh spans every process's")
    config = preset(args.preset) if args.preset else load_config(args.model)
    if args.layers:
        config = first_layers(config, args.layers)
    mesh = make_mesh(args.mesh, jax.devices()[: args.devices] if args.devices else None)
    trainer = Trainer(
        config, mesh,
        StepConfig(compute_dtype=args.dtype, remat=args.remat, loss_chunk=args.loss_chunk,
                   bias_update_rate=args.bias_update_rate, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                   freeze=tuple(args.freeze), mtp_weight=args.mtp_weight, mtp_distill=args.mtp_distill,
                   backend=args.backend),
        OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                    min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, clip_norm=args.clip),
        compiler_options={"xla_backend_optimization_level": 0} if args.fast_compile else None)
    log.info("mesh %s on %d devices", dict(mesh.shape), mesh.size)

    tokenizer_file = args.tokenizer or (os.path.join(args.model, "tokenizer.json") if args.model else None)
    tokenize = file_tokenizer(tokenizer_file) if tokenizer_file else byte_tokenizer
    read = lambda path: pack(read_documents(path, tokenize, config.eos_token_id,  # noqa: E731
                                            config.text.unpadded_vocab_size), args.seq_len)
    rows = read(args.data)
    batches = Batches(rows, args.batch // args.accum, args.accum, seed=args.seed)
    evaluator = Evaluator(read(args.eval_data), args.batch // args.accum) if args.eval_data else None
    record = {"data": os.path.abspath(args.data), "seq_len": args.seq_len, "batch": args.batch,
              "accum": args.accum, "seed": args.seed}

    adapters = lora.load_adapters(args.adapters)[0] if args.adapters else None
    state, frozen = trainer.init(initial_params(args, config, trainer), args.seed, adapters)
    checkpoints = Checkpoints(os.path.join(args.out, "checkpoints"), save_every=args.save_every, keep=args.keep)
    start = 0
    restored = checkpoints.restore_latest(trainer.abstract_state(state), record)
    if restored:
        state, saved = restored
        start = saved["data_position"]

    writer = MetricsWriter(args.out, tensorboard=not args.no_tensorboard)
    baselines = evaluator.baselines(rows, config.text.unpadded_vocab_size) if evaluator else {}
    if baselines:
        log.info("held-out baselines: %s", ", ".join(f"{k} {v:.4f}" for k, v in baselines.items()))
    flops_per_token = train_flops_per_token(config.text, args.seq_len)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops()
    stop = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(range(start, stop), initial=start, total=args.steps, desc="training",
               disable=jax.process_index() != 0)
    loop_began = time.perf_counter()
    for step in bar:
        batch = trainer.place_batch(batches.batch(step))
        began = time.perf_counter()
        state, metrics = trainer.step(state, frozen, batch)
        metrics = jax.device_get(metrics)
        seconds = time.perf_counter() - began
        tokens_per_s = float(metrics["real_tokens"]) / seconds
        metrics.update(tokens_per_s=tokens_per_s, step_seconds=seconds,
                       mfu=tokens_per_s * flops_per_token / (peak * mesh.size) if peak else None)
        last = step + 1 == stop or bool(args.time_limit and time.perf_counter() - loop_began > args.time_limit)
        if evaluator and (last or args.eval_every and (step + 1) % args.eval_every == 0):
            metrics.update(evaluator.evaluate(trainer, state, frozen), **baselines)
        writer.write(step + 1, metrics)
        bar.set_postfix(loss=f"{float(metrics['loss']):.4f}", tok_s=f"{tokens_per_s:,.0f}",
                        **({"eval": f"{metrics['eval_loss']:.4f}"} if "eval_loss" in metrics else {}))
        checkpoints.save(step + 1, state, {**record, "data_position": step + 1}, force=last)
        if last and step + 1 < stop:
            log.warning("--time-limit %.0f s reached: leaving after step %d of %d", args.time_limit, step + 1,
                        args.steps)
            break
    if evaluator and start >= stop:  # nothing trained in this call: evaluate what was loaded or restored
        scores = {**evaluator.evaluate(trainer, state, frozen), **baselines}
        writer.write(start, scores)
        log.info("held-out: %s", ", ".join(f"{k} {v:.4f}" for k, v in scores.items()))
    checkpoints.close()
    writer.close()

    if trainer.lora:
        lora.save_adapters(os.path.join(args.out, "adapters.safetensors"), state.params, args.lora_alpha)
    if args.export:
        flat = host_copy(trainer.model_params(state, frozen))
        if jax.process_index() == 0:
            export(ModelParts(config, jnp.float32).merge(flat), args.export, dtype=args.dtype,
                   tokenizer_file=tokenizer_file, generation=load_generation_config(args.model) if args.model else None)


if __name__ == "__main__":
    main()
