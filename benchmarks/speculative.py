"""Speculative decoding: what a verify of K + 1 tokens costs against one decode step, what it gives end to end,
and how often the shipped default model's MTP head is right on natural text.

    python -m benchmarks.speculative                      # an H200: the `bench` preset + a 1-depth MTP head
    python -m benchmarks.speculative --mesh tensor=2      # the same over 2 GPUs
    python -m benchmarks.speculative --acceptance         # the shipped inkling-tiny on held-out KJV text (CPU)

Throughput (random weights with a planted rule, greedy, EOS ignored, one engine request of `concurrency` random
prompts). On plain random weights the logits are nearly flat, and bf16's verify and decode steps (XLA's matmuls
differ by row count) part on near ties every few tokens, so no drafter could be right for long: `plant_successor`
sets the head to rank token t + 1 first after token t by a wide margin and damps the layers' outputs (the same
shapes, so the same work), so that greedy decoding is t + 1, t + 2, ... in every program, each token routed to its
own experts.
- the programs alone at 1, 8 and 32 rows, 128 cached tokens per row: the plain decode step (one token), the
  oracle engine's round (verify K + 1 tokens, accept, roll back) and the MTP engine's round (the same, then the
  head's catch-up and its K-step draft chain), each the median of back-to-back calls;
  Beside them, the least bytes a verify of K + 1 tokens per row reads over a one-token step's
  (`benchmarks.model.decode_step_bytes`: K + 1 tokens touch more routed experts), the ratio a verify can reach;
- output tok/s at batch 1 and 8: plain decoding (up to `--decode-steps` tokens per device call), the oracle
  drafter proposing the target's own greedy tokens (the upper bound, every draft accepted) and the random MTP
  head (acceptance ~0: the round's cost without its gain), each up to `--decode-steps` rounds per call. The
  oracle's plan is the plain run's output; should a near tie still part them, the oracle runs again with its last
  output as its plan until the output equals the plan (`passes`), and the last pass is timed. Then the same
  oracle, wrong at a seeded `--wrong-fraction` of the output positions, runs once more: the acceptance of a real
  drafter (the default 0.24 gives the mean acceptance length the shipped default's MTP head reaches on held-out
  text at K = 3, 2.79; docs/speculative-decoding.md).
`--acceptance`: the shipped default (float32) continues prompts cut from the held-out chapters
(`tests/train/data/inkling_tiny_heldout.txt`), greedily or sampled (`--temperature`, `--top-p`), for each K;
it reports the mean acceptance length (tokens per round) and each draft position's acceptance rate.
"""

import argparse
import dataclasses
import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.model import decode_step_bytes
from benchmarks.profile import device_op_times, op_table
from benchmarks.programs import decode_program_call, decode_program_seconds
from benchmarks.timing import save_json, show_progress_logs, stamp, stamp_line
from inkling_jax import InklingModel, load_pretrained, preset
from inkling_jax.assets import default_model_dir
from inkling_jax.config import MTPConfig
from inkling_jax.nn.moe import MoE
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.config import EXPERT_PRECISIONS
from serve.engine.acceptance import summarize
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.http.tokenizer import load_tokenizer
from serve.offline import generate
from serve.random_weights import device_random_model, random_model
from serve.runner.drafters import OracleDrafter
from serve.runner.placement import Placement

HELDOUT = os.path.join(os.path.dirname(__file__), "..", "tests", "train", "data", "inkling_tiny_heldout.txt")
ROWS = (1, 8, 32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--acceptance", action="store_true", help="the shipped default's acceptance on held-out text")
    p.add_argument("--draft-tokens", default="3", help="K values (throughput; --acceptance default 1,2,3,4)")
    p.add_argument("--methods", default="oracle,mtp", help="throughput: the drafters timed beside plain decoding "
                   "(each engine compiles its own programs: one method, a shorter run)")
    p.add_argument("--preset", default="bench", help="throughput: the preset, given a random 1-depth MTP head")
    p.add_argument("--concurrency", default="1,8", help="throughput: batch sizes of the end-to-end runs")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8, help="the plain engine's tokens per device call")
    p.add_argument("--wrong-fraction", type=float, default=0.24, help="throughput: the oracle's second run is "
                   "wrong at this fraction of output positions (0: no such run)")
    p.add_argument("--prompts", type=int, default=12, help="--acceptance: prompts cut from the held-out text")
    p.add_argument("--temperature", type=float, default=0.0, help="--acceptance: 0 greedy, else sampled (seeded)")
    p.add_argument("--top-p", type=float, default=1.0, help="--acceptance: with --temperature")
    p.add_argument("--expert-precision", default="bf16", choices=EXPERT_PRECISIONS,
                   help="throughput: the routed experts' precision, as serve.app's flag (the verify's extra bytes "
                   "are experts')")
    p.add_argument("--mesh", help="throughput: serve over a device mesh, as serve.app's --mesh (e.g. tensor=2); "
                   "default: one device")
    p.add_argument("--profile", action="store_true", help="throughput: also print where each program's device "
                   f"time goes at {ROWS[0]} and {ROWS[-1]} rows (`benchmarks.profile`)")
    p.add_argument("--out", help="directory for speculative.json")
    args = p.parse_args(argv)
    if not set(args.methods.split(",")) <= {"oracle", "mtp"}:
        p.error(f"--methods takes oracle and mtp, got {args.methods}")
    return args


def engine_config(args, speculative=None, **changes) -> EngineConfig:
    """Buckets for 1, 8 and 32 rows (the last the all-rows bucket) and one prompt chunk; pages for every slot at
    full length (not from free memory: the engines run one after another in one process). No mixed programs:
    a speculative engine has none, and the loads here send every prompt at once, so a plain engine's decodes
    never meet a prompt chunk either, and compiling its mixed programs would only cost time."""
    length = args.prompt_tokens + args.output_tokens + 16
    return EngineConfig(**{**dict(
        max_num_seqs=32, max_model_len=length, num_pages=33 * -(-(length + 16) // 16),
        max_num_batched_tokens=8 * args.prompt_tokens, chunk_buckets=(1, args.prompt_tokens),
        row_buckets=(1, 8, 33), prefix_caching=False, mixed_steps=False, decode_steps=args.decode_steps,
        speculative=speculative),
        **changes})


def timed_generate(engine: Engine, prompts: list[list[int]], output_tokens: int, **sampling):
    """Greedy unless `sampling` says otherwise (SamplingParams fields)."""
    params = SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=output_tokens, ignore_eos=True)
    generate(engine, prompts[:1], dataclasses.replace(params, max_tokens=4))  # first calls of each executable
    start = time.perf_counter()
    results = generate(engine, prompts, params)
    return results, time.perf_counter() - start


def plant_successor(model: InklingModel, damping: float = 1 / 256) -> InklingModel:
    """`model` (random weights) changed in place so that its greedy continuation of token t is t + 1 (mod the
    unpadded vocabulary) by a wide margin: the head's row of t + 1 is t's embedding, and every layer's output
    projections (attention out, MLP and experts down) are scaled by `damping`, so that the final hidden state
    points along the last token's embedding. The other logits are products of independent random rows, about
    1/sqrt(hidden) of the chosen one's."""
    vocab = model.config.text.unpadded_vocab_size
    embed = model.embed.get_value()
    model.unembed.set_value(jnp.zeros_like(embed).at[:vocab].set(jnp.roll(embed[:vocab], 1, axis=0)))
    for layer in model.layers:
        outputs = [layer.attn.wo.kernel, layer.mlp.w_down]
        if isinstance(layer.mlp, MoE):
            outputs.append(layer.mlp.shared_down)
        for param in outputs:
            param.set_value(param.get_value() * jnp.asarray(damping, param.get_value().dtype))
    return model


def throughput(args) -> dict:
    gpu = jax.default_backend() == "gpu"
    config = dataclasses.replace(preset(args.preset), mtp=MTPConfig(num_layers=1, local_layer_ids=(0,)))
    model = plant_successor(device_random_model(config) if gpu else random_model(config))
    if args.expert_precision != "bf16":
        model = serving_view(model, QuantConfig(args.expert_precision), fuse=False)
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = np.random.default_rng(0)
    vocab = config.text.unpadded_vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_tokens).tolist() for _ in range(max(levels))]
    results = {"stamp": stamp(), "rows": {}, "runs": [], "verify_bytes_x_step": {}}
    placement = Placement.from_spec(args.mesh)
    plain_outputs = {}  # concurrency -> {prompt: plain greedy output}
    plan = {}  # the oracle's, changed in place between passes
    kinds = [("plain", None)] + [(method, int(k)) for k in args.draft_tokens.split(",")
                                 for method in args.methods.split(",")]
    for method, k in kinds:
        speculative = None if k is None else SpeculativeConfig(method, k)
        oracle = OracleDrafter(plan, vocab=vocab) if method == "oracle" else None
        engine = Engine(model, engine_config(args, speculative), eos_token_id=config.eos_token_id, oracle=oracle,
                        placement=placement)
        engine.start()
        label = method if k is None else f"{method} K={k}"
        for level in levels:
            if oracle is not None:
                timed = [(label, *oracle_fixed_point(engine, plan, prompts[:level], plain_outputs[level],
                                                     args.output_tokens))]
                if args.wrong_fraction:
                    wrong = rng.random(args.output_tokens) < args.wrong_fraction
                    oracle.wrong_at = frozenset(np.flatnonzero(wrong).tolist())
                    timed.append((f"{label}, {args.wrong_fraction:.0%} wrong",
                                  *timed_generate(engine, prompts[:level], args.output_tokens), 1))
                    oracle.wrong_at = frozenset()
            else:
                timed = [(label, *timed_generate(engine, prompts[:level], args.output_tokens), 1)]
            if k is None:
                plain_outputs[level] = {tuple(p): o.token_ids for p, o in zip(prompts, timed[0][1])}
            for name, outputs, seconds, passes in timed:
                acceptance = summarize(r for o in outputs for r in o.speculative_rounds)
                results["runs"].append({"engine": name, "concurrency": level, "compile_s": engine.warm_up_seconds,
                                        "tok_s": level * args.output_tokens / seconds, "passes": passes,
                                        "mean_acceptance_length": acceptance.mean_length,
                                        "position_rates": acceptance.position_rates})
                print(f"{name}, {level} rows: {results['runs'][-1]['tok_s']:.1f} tok/s, mean acceptance length "
                      f"{acceptance.mean_length:.2f}, compile {engine.warm_up_seconds:.0f} s", flush=True)
        engine.shutdown(drain_seconds=0)
        results["rows"][label] = {n: 1e3 * decode_program_seconds(engine, n, steps=1) for n in ROWS}
        for rows in (ROWS[0], ROWS[-1]) if args.profile else ():
            print(f"{label} program at {rows} rows, device time by operation:\n" +
                  op_table(device_op_times(decode_program_call(engine, rows, steps=1))), flush=True)
        print(f"{label} program ms at {', '.join(map(str, ROWS))} rows: "
              + ", ".join(f"{ms:.2f}" for ms in results["rows"][label].values()), flush=True)
        del engine
        gc.collect()  # the engine's cache and programs, before the next engine allocates its own
    for k in {int(k) for k in args.draft_tokens.split(",")}:
        results["verify_bytes_x_step"][k] = {n: decode_step_bytes(model, n, args.prompt_tokens, k + 1) /
                                             decode_step_bytes(model, n, args.prompt_tokens) for n in ROWS}
    return results


def oracle_fixed_point(engine: Engine, plan: dict, prompts: list[list[int]], first: dict, output_tokens: int,
                       max_passes: int = 12):
    """Greedy runs of an oracle engine whose drafter proposes `plan` (prompt -> continuation), starting from
    `first`, each next run with the last run's output as the plan, until a run's output is its plan: then every
    round accepted all its drafts. Returns that run's outputs and seconds, and the number of runs."""
    plan.clear()
    plan.update(first)
    for passes in range(1, max_passes + 1):
        outputs, seconds = timed_generate(engine, prompts, output_tokens)
        found = {tuple(p): o.token_ids for p, o in zip(prompts, outputs)}
        if all(found[key] == plan[key] for key in found):
            break
        plan.update(found)
    return outputs, seconds, passes


def report_throughput(args, results) -> None:
    print(stamp_line(results["stamp"]) + f"; preset {args.preset} + 1 random MTP depth, prompt {args.prompt_tokens}, "
          f"output {args.output_tokens}; routed experts in {args.expert_precision}; plain decoding at "
          f"{args.decode_steps} steps per call"
          f"{'; mesh ' + args.mesh if args.mesh else ''}")
    print("| program | " + " | ".join(f"{n} rows ms" for n in ROWS) + " | " +
          " | ".join(f"x plain at {n}" for n in ROWS) + " |")
    print("|---|" + "---:|" * (2 * len(ROWS)))
    plain = results["rows"]["plain"]
    for label, ms in results["rows"].items():
        print(f"| {label} | " + " | ".join(f"{ms[n]:.2f}" for n in ROWS) + " | " +
              " | ".join(f"{ms[n] / plain[n]:.2f}" for n in ROWS) + " |")
    for k, ratio in results["verify_bytes_x_step"].items():
        print(f"| least bytes, verify of {k + 1} | " + " | ".join("" for _ in ROWS) + " | " +
              " | ".join(f"{ratio[n]:.2f}" for n in ROWS) + " |")
    print("| engine | concurrency | output tok/s | x plain | mean acceptance length | oracle passes | compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = {r["concurrency"]: r["tok_s"] for r in results["runs"] if r["engine"] == "plain"}
    for r in results["runs"]:
        print(f"| {r['engine']} | {r['concurrency']} | {r['tok_s']:.1f} | {r['tok_s'] / base[r['concurrency']]:.2f} | "
              f"{r['mean_acceptance_length']:.2f} | {r['passes']} | {r['compile_s']:.0f} |")


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, evenly spaced over the held-out chapters' token stream."""
    ids = tokenizer.encode(open(HELDOUT).read())
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return [ids[s:s + length] for s in starts]


def acceptance(args) -> dict:
    directory = default_model_dir()
    model = load_pretrained(directory, dtype="float32", progress=False)
    prompts = heldout_prompts(load_tokenizer(directory), args.prompts, args.prompt_tokens)
    ks = [int(k) for k in (args.draft_tokens if args.draft_tokens != "3" else "1,2,3,4").split(",")]
    results = {"stamp": stamp(), "prompts": len(prompts), "runs": []}
    for k in ks:
        config = engine_config(args, SpeculativeConfig("mtp", k), max_num_seqs=len(prompts),
                               row_buckets=(1, len(prompts) + 1), max_num_batched_tokens=args.prompt_tokens + 32)
        engine = Engine(model, config, eos_token_id=model.config.eos_token_id)
        engine.start()
        outputs, seconds = timed_generate(engine, prompts, args.output_tokens, temperature=args.temperature,
                                          top_p=args.top_p, seed=0)
        engine.shutdown(drain_seconds=0)
        found = summarize(r for o in outputs for r in o.speculative_rounds)
        results["runs"].append({"k": k, "rounds": found.rounds, "mean_acceptance_length": found.mean_length,
                                "position_rates": found.position_rates, "seconds": seconds})
    return results


def report_acceptance(args, results) -> None:
    how = "greedy" if args.temperature == 0 else f"sampled (temperature {args.temperature}, top_p {args.top_p})"
    print(stamp_line(results["stamp"]) + f"; inkling-tiny (float32), {results['prompts']} held-out prompts of "
          f"{args.prompt_tokens} tokens, {args.output_tokens} {how} tokens each")
    print("| K | rounds | mean acceptance length | acceptance rate by draft position |")
    print("|---:|---:|---:|---|")
    for r in results["runs"]:
        print(f"| {r['k']} | {r['rounds']} | {r['mean_acceptance_length']:.3f} | " +
              ", ".join(f"{x:.3f}" for x in r["position_rates"]) + " |")


def main(argv=None):
    args = parse_args(argv)
    show_progress_logs()
    results = acceptance(args) if args.acceptance else throughput(args)
    (report_acceptance if args.acceptance else report_throughput)(args, results)
    if args.out:
        save_json(args.out, "speculative.json", results)


if __name__ == "__main__":
    main()
