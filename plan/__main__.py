"""`python -m plan`: what a model takes on each device, for serving or training, before any device
is touched (docs/scale.md).

    python -m plan --preset inkling --devices 8 --device-memory-gib 140 --mesh tensor=2,expert=4 \\
        --expert-precision nvfp4 --max-num-seqs 32 --max-model-len 32768
    python -m plan --preset inkling --devices 256 --device-memory-gib 140 --mesh fsdp=32,expert=8 \\
        --train --lora-rank 16 --micro-batch 32 --seq-len 4096

Serving: the weights in the served form, the KV pool the server would size for the memory left
(`serve.engine.memory_plan`), the slots' rings and ShortConv states and the step buffers. Training: the state
`train.step.Trainer` keeps and an estimate of the activations. Exits 1 where it does not fit, saying what to
change.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

from inkling_jax.config import preset
from inkling_jax.nn.model import REMAT_POLICIES
from inkling_jax.parallel.mesh import MeshError, parse_mesh_spec
from plan.serving import mtp_drafter, served_config, serving_plan
from plan.training import training_plan
from plan.weights import GIB, abstract_mesh, bytes_by_kind, model_weights
from inkling_jax.quant.config import DENSE_PRECISIONS, EXPERT_PRECISIONS, QuantConfig
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.engine.memory_plan import cache_layers
from serve.runner.speculative import check_speculative



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m plan", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--preset", required=True, help="a named configuration: inkling, inkling-small, bench, tiny, ...")
    a("--devices", type=int, required=True)
    a("--device-memory-gib", type=float, required=True, help="memory of one device (H200: 140, B200: 180)")
    a("--allocator-fraction", type=float, default=float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)),
      help="share of it JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.75, as JAX's)")
    a("--mesh", help="e.g. tensor=2,expert=4; must use every device (default: expert=N serving, fsdp=N training)")
    a("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the weights' and compute dtype")
    a("--expert-precision", default="bf16", choices=EXPERT_PRECISIONS)
    a("--dense-precision", default="bf16", choices=DENSE_PRECISIONS)
    a("--fp8-twins", action="store_true")
    a("--max-num-seqs", type=int, help="serving: slots (sequences at once)")
    a("--max-model-len", type=int, help="serving: prompt + output tokens per sequence")
    a("--max-num-batched-tokens", type=int, default=256, help="serving: token budget of one step (as serve.app)")
    a("--chunk-buckets", default="1,16,64,256", help="serving: as serve.app on GPU")
    a("--row-buckets", help="serving: as serve.app (default powers of 2, then every row)")
    a("--page-size", type=int, default=16)
    a("--memory-fraction", type=float, default=EngineConfig.memory_fraction, help="serving: as serve.app")
    a("--num-snapshots", type=int, help="serving: prefix snapshots (default 2 per slot)")
    a("--no-prefix-caching", action="store_true")
    a("--no-fuse-projections", action="store_true")
    a("--speculative-num-draft-tokens", type=int, default=0, help="serving: as serve.app with --speculative-algorithm "
      "mtp (the MTP depths it drafts with and their cache; default 0: no drafting)")
    a("--train", action="store_true", help="plan a training step instead of the server")
    a("--lora-rank", type=int, default=0, help="training: LoRA adapters of this rank (0: full parameters)")
    a("--remat", default="full", choices=sorted(REMAT_POLICIES), help="training: rematerialisation")
    a("--micro-batch", type=int, default=1, help="training: rows per microbatch (--batch / --accum of train.run)")
    a("--seq-len", type=int, default=4096, help="training: tokens per row")
    a("--loss-chunk", type=int, default=1024)
    args = p.parse_args(argv)
    try:
        sizes = parse_mesh_spec(args.mesh or ("fsdp" if args.train else "expert") + f"={args.devices}")
    except MeshError as exc:
        p.error(str(exc))
    if args.devices < 1 or args.device_memory_gib <= 0 or not 0 < args.allocator_fraction <= 1:
        p.error("--devices, --device-memory-gib and --allocator-fraction must be positive (the fraction <= 1)")
    total = 1
    for size in sizes.values():
        total *= size
    if total != args.devices:
        p.error(f"--mesh {args.mesh} uses {total} devices, not --devices {args.devices}")
    args.sizes = sizes
    if not args.train and (args.max_num_seqs is None or args.max_model_len is None):
        p.error("serving plans need --max-num-seqs and --max-model-len (or --train)")
    try:
        args.quant = QuantConfig(args.expert_precision, args.dense_precision, args.fp8_twins)
        args.config = preset(args.preset)
        args.engine = None if args.train else engine_config(args)
        if args.engine is not None:
            check_speculative(args.config, args.engine.speculative)
    except ValueError as exc:
        p.error(str(exc))
    return args


def engine_config(args) -> EngineConfig:
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                        memory_fraction=args.memory_fraction, chunk_buckets=ints(args.chunk_buckets),
                        row_buckets=ints(args.row_buckets) if args.row_buckets else None,
                        prefix_caching=not args.no_prefix_caching, num_snapshots=args.num_snapshots,
                        fuse_projections=not args.no_fuse_projections,
                        speculative=SpeculativeConfig("mtp", args.speculative_num_draft_tokens)
                        if args.speculative_num_draft_tokens else None)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def table(title: str, rows: dict[str, float], whole: dict[str, float] | None = None) -> list[str]:
    head = f"| {title} | GiB per device |" + (" GiB in all |" if whole else "")
    lines = [head, "|---|---:|" + ("---:|" if whole else "")]
    for name, value in rows.items():
        lines.append(f"| {name} | {gib(value)} |" + (f" {gib(whole[name])} |" if whole else ""))
    total = sum(rows.values())
    lines.append(f"| **total** | **{gib(total)}** |" + (f" **{gib(sum(whole.values()))}** |" if whole else ""))
    return lines


def serve_report(args, mesh, limit) -> tuple[list[str], bool]:
    engine, text = args.engine, args.config.text
    fuse = engine.fuse_projections and mesh.shape["tensor"] == 1  # `Placement.fuses_projections`
    weights = model_weights(served_config(args.config, engine), args.dtype, args.quant, fuse=fuse)
    plan = serving_plan(args.config, mesh, engine, args.quant, limit, jnp.dtype(args.dtype), weights)
    full_layers = sum(layers.num_layers - len(layers.local_layer_ids)
                      for layers in cache_layers(text, mtp_drafter(args.config, engine)))
    out = table("weights", plan.weights, bytes_by_kind(weights)) + [""]
    out += [f"KV of the full-attention layers ({full_layers}): {plan.kv_per_token / 1024:,.2f} KiB per token per "
            f"device; {engine.max_num_seqs} slots x {engine.max_model_len} tokens need {gib(plan.kv_needed)} GiB "
            f"({plan.pages_needed:,} pages of {engine.page_size})", ""]
    steps = {f"{k} (estimate)": v for k, v in plan.beside_pool.items() if k.startswith("step")}
    out += table(f"beside the KV pool ({engine.max_num_seqs} slots + 1 scratch)",
                 {**plan.state, "sampler state": plan.beside_pool["sampler state"], **steps}) + [""]
    out.append(f"The server sizes its pool from {gib(plan.budget)} GiB per device (after the weights, x "
               f"{engine.memory_fraction}) less {gib(sum(plan.beside_pool.values()))} GiB beside it (its rule "
               f"counts rings, states and snapshots whole on every device): {max(plan.pages, 0):,} pages = "
               f"{max(plan.pages, 0) * engine.page_size:,} tokens, {gib(max(plan.pages, 0) * plan.page_bytes)} GiB.")
    if plan.fits:
        out.append(f"FITS: every slot can hold {engine.max_model_len} tokens at once; "
                   f"{plan.pages * engine.page_size // engine.max_model_len} sequences of that length would.")
        return out, True
    slots = max(plan.pages, 0) // engine.pages_per_row
    out.append(f"DOES NOT FIT: {plan.pages_needed:,} pages needed. Change: " + "; ".join(filter(None, [
        f"--max-num-seqs {slots} at this length" if slots else "",
        "a smaller --max-model-len, fewer --num-snapshots",
        {"bf16": "fp8 or nvfp4 experts", "fp8": "nvfp4 experts"}.get(args.expert_precision, ""),
        "" if args.dense_precision != "bf16" else "fp8 dense weights (--dense-precision)",
        "`tensor` in the mesh (attention, shared experts and dense MLPs split only over it)"
        if mesh.shape["tensor"] == 1 else "", "more devices"])))
    return out, False


def train_report(args, mesh, limit) -> tuple[list[str], bool]:
    rows = training_plan(args.config, mesh, dtype=jnp.dtype(args.dtype), lora_rank=args.lora_rank,
                         remat=args.remat, micro_batch=args.micro_batch, seq_len=args.seq_len,
                         loss_chunk=args.loss_chunk)
    out = table("training step", rows) + [""]
    total = sum(rows.values())
    if total <= limit:
        out.append(f"FITS: {gib(total)} of {gib(limit)} GiB per device.")
        return out, True
    out.append(f"DOES NOT FIT: {gib(total)} GiB per device, {gib(limit)} GiB available. Change: " + "; ".join(
        filter(None, ["more devices on fsdp (masters, moments and gradients split over it)",
                      "" if args.lora_rank else "LoRA (--lora-rank): no masters, moments or gradients of the base",
                      "" if args.remat == "full" else "--remat full", "a smaller --micro-batch or --seq-len"])))
    return out, False


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = abstract_mesh(args.sizes)
    limit = args.device_memory_gib * GIB * args.allocator_fraction
    mesh_text = ",".join(f"{a}={n}" for a, n in args.sizes.items() if n > 1) or "one device"
    print(f"`{args.preset}` on {args.devices} x {args.device_memory_gib:g} GiB (the allocator's "
          f"{args.allocator_fraction:g}: {gib(limit)} GiB), mesh {mesh_text}, {args.dtype}" +
          ("" if args.train else f", experts {args.expert_precision}, dense {args.dense_precision}"))
    print()
    lines, fits = (train_report if args.train else serve_report)(args, mesh, limit)
    print("\n".join(lines))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
