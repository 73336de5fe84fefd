"""The serving plan beside the server itself, on this machine's first GPU: a preset's model made there with
random weights, the allocator's figures once it is in, and the KV pool the engine sizes, each next to the plan's.

    python -m plan.server_check --preset bench --max-num-seqs 32 --max-model-len 208

The plan is given the allocator's own limit (`bytes_limit`), so the weights and the pool compare directly; the
engine is built but not started (its warm-up may still shrink the pool where a compiled program needs more than
the plan's estimate: it logs so).
"""

from __future__ import annotations

import argparse
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.config import preset
from inkling_jax.quant import QuantConfig
from plan.serving import serving_plan
from plan.weights import GIB, abstract_mesh
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.random_weights import random_weights
from serve.runner.placement import Placement


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m plan.server_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=208)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--expert-precision", default="bf16")
    p.add_argument("--dense-precision", default="bf16")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    config, quant = preset(args.preset), QuantConfig(args.expert_precision, args.dense_precision)
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                 max_num_batched_tokens=args.max_num_batched_tokens, chunk_buckets=(1, 128),
                                 row_buckets=(1, args.max_num_seqs + 1), prefix_caching=False)
    model = random_weights(config, jnp.bfloat16, quant=quant)  # as serve.app --random-weights makes them
    jax.block_until_ready(nnx.state(model))
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise SystemExit(f"{jax.devices()[0]} keeps no memory statistics: run this on a GPU")
    placement = Placement()
    model = placement.model_view(model, engine_config)  # as serve.app: unfused weights freed
    runner = Engine(model, engine_config, eos_token_id=config.eos_token_id, placement=placement).runner
    plan = serving_plan(config, abstract_mesh({}), engine_config, quant, stats["bytes_limit"])
    print(f"| {args.preset} on {jax.devices()[0].device_kind} | plan | server |\n|---|---:|---:|")
    print(f"| weights, GiB (server: allocator bytes in use) | {sum(plan.weights.values()) / GIB:.2f} | "
          f"{stats['bytes_in_use'] / GIB:.2f} |")
    print(f"| KV pages | {plan.pages} | {runner.num_pages} |")
    print(f"| KV pool, GiB | {plan.pages * plan.page_bytes / GIB:.2f} | "
          f"{runner.num_pages * runner.page_bytes_per_device() / GIB:.2f} |")


if __name__ == "__main__":
    main()
