"""One training step on one GPU: inkling-jax's jitted train step against transformers' Inkling (PyTorch) at the same
shape, with the bf16 matmul ceiling measured in the same run.

    python -m benchmarks.training [--layers 3] [--full-attention-layers 1] [--batch 8] [--seq 1024] [--steps 4]
                                  [--out DIR]
    python -m benchmarks.training --mesh tensor=2 --no-peer     # ours over several GPUs

Model: the first `--layers` layers of `preset("bench")` (Inkling's per-layer widths, 32 experts top-6 + 2
shared; as many layers as fit one H200 with fp32 master weights and fp32 AdamW moments), random weights; the last
`--full-attention-layers` of them attend over the full context (as every sixth Inkling layer does; the others keep
the preset's kind, the sliding window for `bench`'s first five), so that the step runs both attention kinds; the
first `--dense-layers` have a dense MLP (default the preset's: `bench`'s first two), the others the MoE.
Step: next-token loss on `batch x seq` tokens, backward, global-norm clipping, AdamW.
- ours: `train.step.Trainer`, bf16 compute over fp32 masters, rows packed with 2 segments each; the MoE backend
  and the remat policy are tried in `--attempts` order until one compiles and fits;
- peer: `InklingForCausalLM` in bf16 with `torch.optim.AdamW(fused=True)` (bf16 moments), plain causal rows.
MFU = model FLOPs per token (`train.metrics.train_flops_per_token`: 6 x active matmul parameters + attention,
no remat) x tokens/s / the bf16 ceiling: a jitted 8192^3 matmul on random data, timed in the ours process (one
GPU's, times the devices of `--mesh`).
Each side runs in its own process so neither sees the other's memory; the parent prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time


def parse_args(argv=None):
    from inkling_jax.backend import MOE_MATMUL_CHOICES

    p = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench", help="another preset (e.g. tiny) to try the script on a CPU")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--full-attention-layers", type=int, default=1,
                   help="how many of the kept layers, the last ones, use full attention (0: the preset's own kinds, "
                   "all sliding for bench's first 5 layers)")
    p.add_argument("--dense-layers", type=int,
                   help="how many of the kept layers, the first ones, have a dense MLP instead of the MoE (default: "
                   "the preset's; bench's first two, so that --layers 2 has no MoE layer)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="timed steps after the first (compiling) ones")
    p.add_argument("--mesh", help="train over a device mesh (e.g. tensor=2, expert=2); default: one GPU")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' Inkling (it runs on one GPU)")
    p.add_argument("--attempts", default="pallas:dots,dense:dots,dense:full", help="moe:remat pairs, in order")
    p.add_argument("--moe-backward", default="auto", choices=MOE_MATMUL_CHOICES,
                   help="the grouped matmuls of the MoE's backward under moe=pallas (inkling_jax/backend.py)")
    p.add_argument("--ceiling-n", type=int, default=8192, help="size of the square bf16 matmul ceiling")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--jax-timeout", type=int, default=185)
    p.add_argument("--torch-timeout", type=int, default=95)
    p.add_argument("--part", choices=["jax", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.full_attention_layers <= args.layers:
        p.error(f"--full-attention-layers must be between 0 and --layers ({args.layers})")
    return args


def bench_config(args):
    from inkling_jax import preset
    from train.run import first_layers

    config = first_layers(preset(args.preset), args.layers)
    first_full = args.layers - args.full_attention_layers
    dense = config.text.dense_layer_ids if args.dense_layers is None else tuple(range(args.dense_layers))
    return config.replace(local_layer_ids=tuple(i for i in config.text.local_layer_ids if i < first_full),
                          dense_layer_ids=tuple(i for i in dense if i < args.layers))


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------------------------
# ours


def packed_batch(config, batch: int, seq: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.text.unpadded_vocab_size, (1, batch, seq)).astype(np.int32)
    cut = seq // 2 + rng.integers(-seq // 4, seq // 4, batch)
    t = np.arange(seq)[None, :]
    seg = np.where(t < cut[:, None], 1, 2).astype(np.int32)[None]
    pos = np.where(t < cut[:, None], t, t - cut[:, None]).astype(np.int32)[None]
    return {"input_ids": ids, "segment_ids": seg, "positions": pos, "loss_mask": np.ones_like(ids)}


def train_jax(config, args, moe: str, remat: str) -> dict:
    import jax

    from inkling_jax.backend import Backend
    from inkling_jax.parallel.mesh import make_mesh
    from train.optim import OptimConfig
    from train.state import seeded_params
    from train.step import StepConfig, Trainer

    backend = Backend(moe=moe, moe_backward=args.moe_backward if moe == "pallas" else "auto")
    mesh = make_mesh(args.mesh) if args.mesh else make_mesh("data=1", devices=jax.devices()[:1])
    trainer = Trainer(config, mesh,
                      StepConfig(compute_dtype="bfloat16", remat=remat, loss_chunk=512, backend=backend),
                      OptimConfig(learning_rate=1e-4, warmup_steps=0, total_steps=1000))
    state, frozen = trainer.init(seeded_params(config, 0, trainer.param_shardings()))
    batch = trainer.place_batch(packed_batch(config, args.batch, args.seq))
    began = time.perf_counter()
    state, metrics = trainer.step(state, frozen, batch)
    losses = [float(metrics["loss"])]
    first_s = time.perf_counter() - began
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        state, metrics = trainer.step(state, frozen, batch)
        losses.append(float(metrics["loss"]))  # float() waits for the step
        times.append(time.perf_counter() - began)
    if not all(map(math.isfinite, losses)):
        raise FloatingPointError(f"non-finite loss with moe={moe}: {losses}")
    stats = jax.devices()[0].memory_stats() or {}
    return {"moe": backend.resolve().moe, "moe_backward": backend.resolve().moe_backward, "remat": remat,
            "dense_layers": len(config.text.dense_layer_ids),
            "step_s": statistics.median(times),
            "first_step_s": first_s, "losses": losses, "peak_bytes": stats.get("peak_bytes_in_use"),
            "grad_norm": float(metrics["grad_norm"]), "devices": mesh.size}


def part_jax(args) -> None:
    import gc

    import jax

    from benchmarks.timing import matmul_flops, stamp
    from train.metrics import train_flops_per_token

    config = bench_config(args)
    result = {"side": "jax", "stamp": stamp(), "ceiling_flops": matmul_flops(args.ceiling_n, data="normal"),
              "flops_per_token": train_flops_per_token(config.text, args.seq), "failures": []}
    for attempt in args.attempts.split(","):
        moe, remat = attempt.split(":")
        try:
            result.update(train_jax(config, args, moe, remat))
            break
        except Exception as e:  # a backend that does not compile here, or does not fit: try the next
            result["failures"].append(f"{attempt}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            jax.clear_caches()
            gc.collect()
    emit(result)


# --------------------------------------------------------------------------------------------------------------
# peer


def part_torch(args) -> None:
    import torch
    import transformers
    from transformers import InklingForCausalLM, InklingTextConfig

    t = bench_config(args).text
    cfg = InklingTextConfig(
        vocab_size=t.vocab_size, unpadded_vocab_size=t.unpadded_vocab_size, hidden_size=t.hidden_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
        head_dim=t.head_dim, swa_num_attention_heads=t.swa_num_heads, swa_num_key_value_heads=t.swa_num_kv_heads,
        swa_head_dim=t.swa_head_dim, sliding_window_size=t.sliding_window, d_rel=t.d_rel, rel_extent=t.rel_extent,
        intermediate_size=t.dense_intermediate_size, moe_intermediate_size=t.moe_intermediate_size,
        n_routed_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
        n_shared_experts=t.num_shared_experts, dense_mlp_idx=len(t.dense_layer_ids),
        local_layer_ids=list(t.local_layer_ids),
        log_scaling_n_floor=t.log_scaling_n_floor)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"side": "torch", "torch": torch.__version__, "transformers": transformers.__version__, "failures": []}
    for checkpointing in (False, True):
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            with torch.device(device):
                torch.set_default_dtype(torch.bfloat16)
                model = InklingForCausalLM(cfg).train()
            torch.set_default_dtype(torch.float32)
            if checkpointing:  # only when the plain step does not fit
                model.gradient_checkpointing_enable()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                    fused=device == "cuda")
            ids = torch.randint(0, t.unpadded_vocab_size, (args.batch, args.seq), device=device)

            def step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return float(loss)

            losses, times = [step()], []
            for _ in range(args.steps):
                began = time.perf_counter()
                losses.append(step())
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - began)
            result.update(step_s=statistics.median(times), losses=losses, checkpointing=checkpointing,
                          peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
                          attn=model.config._attn_implementation,
                          experts=getattr(model.config, "_experts_implementation", None))
            break
        except Exception as e:
            result["failures"].append(f"checkpointing={checkpointing}: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:300]}")
            model = opt = None
    emit(result)


# --------------------------------------------------------------------------------------------------------------
# parent


def run_part(part: str, args, timeout: int, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.training", "--part", part] + sys.argv[1:]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {timeout} s"
    with open(os.path.join(args.out, f"train_bench_{part}.log"), "w") as fh:
        fh.write(out if isinstance(out, str) else out.decode())
    for line in (out if isinstance(out, str) else out.decode()).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"side": part, "failures": [out.strip().splitlines()[-1][:300] if out.strip() else "no output"]}


def table(args, ours: dict, peer: dict) -> str:
    tokens = args.batch * args.seq
    ceiling, flops_tok = ours.get("ceiling_flops"), ours.get("flops_per_token")
    ceiling = ceiling * ours.get("devices", 1) if ceiling else ceiling
    rows = ["| side | setup | step ms | tokens/s | model TFLOP/s | MFU vs measured matmul | peak GiB | vs peer |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    if ceiling:
        rows.append(f"| bf16 matmul {args.ceiling_n}^3 (XLA) x {ours.get('devices', 1)} | ceiling | | | "
                    f"{ceiling / 1e12:.0f} | 1.00 | | |")
    peer_tps = tokens / peer["step_s"] if "step_s" in peer else None
    for side, r, setup in (("inkling-jax", ours, f"moe={ours.get('moe')} moe_backward={ours.get('moe_backward')} "
                                                 f"remat={ours.get('remat')}"),
                           ("transformers", peer, f"attn={peer.get('attn')} experts={peer.get('experts')} "
                                                  f"ckpt={peer.get('checkpointing')}")):
        if "step_s" not in r:
            rows.append(f"| {side} | failed: {'; '.join(r.get('failures', []))[:200]} | | | | | | |")
            continue
        tps = tokens / r["step_s"]
        tflops = tps * flops_tok / 1e12 if flops_tok else float("nan")
        mfu = f"{tps * flops_tok / ceiling:.3f}" if ceiling and flops_tok else ""
        ratio = f"{tps / peer_tps:.2f}" if peer_tps else ""
        rows.append(f"| {side} | {setup} | {r['step_s'] * 1e3:.1f} | {tps:,.0f} | {tflops:.0f} | {mfu} | "
                    f"{(r.get('peak_bytes') or 0) / 2**30:.1f} | {ratio} |")
    return "\n".join(rows)


def main():
    args = parse_args()
    if args.part == "jax":
        return part_jax(args)
    if args.part == "torch":
        return part_torch(args)
    # imports jax, which takes no device memory until a device is used
    from benchmarks.timing import save_json, stamp_line

    os.makedirs(args.out, exist_ok=True)
    ours = run_part("jax", args, args.jax_timeout, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"})
    peer = {"side": "torch", "failures": ["not run (--no-peer)"]} if args.no_peer else \
        run_part("torch", args, args.torch_timeout, {})
    save_json(args.out, "train_bench.json", {"args": vars(args), "ours": ours, "peer": peer})
    for r in (ours, peer):
        print(r.get("side"), "losses", [round(x, 3) for x in r.get("losses", [])], "failures", r.get("failures"))
    print(f"first {args.layers} layers of preset('{args.preset}') ({args.full_attention_layers} with full attention, "
          f"{ours.get('dense_layers', '?')} with a dense MLP, the others MoE), "
          f"batch {args.batch} x seq {args.seq}"
          f"{', mesh ' + args.mesh if args.mesh else ''}; "
          f"{stamp_line(ours['stamp']) if 'stamp' in ours else 'jax side failed'}; torch {peer.get('torch')}, "
          f"transformers {peer.get('transformers')}")
    print(table(args, ours, peer))


if __name__ == "__main__":
    main()
