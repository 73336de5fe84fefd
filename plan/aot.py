"""The training plan beside XLA's own figures: `train.step.Trainer`'s step compiled ahead of time on a mesh of
simulated CPU devices, from shapes alone (no weight is made), at the released per-layer shapes with one layer of
each kind (`weights.probe`), and its `memory_analysis()` set beside `training_plan` for the same layers.

    python -m plan.aot --preset inkling --mesh fsdp=2,tensor=2,expert=2 --micro-batch 8 --seq-len 256

The arguments (masters, moments, frozen weights, biases, counters) agree to the byte: both count the same shapes
and shardings. The temporaries do not carry from a CPU compile to a GPU (docs/scale.md says why); `--platform
gpu` compiles the same step for this host's GPUs instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.config import preset
from inkling_jax.nn.model import REMAT_POLICIES, InklingModel
from inkling_jax.parallel.mesh import make_mesh, parse_mesh_spec
from inkling_jax.parallel.rules import activation_sharding
from plan.training import training_plan
from plan.weights import GIB, abstract_mesh, probe
from train.state import abstract_like, model_params
from train.step import BATCH_KEYS, StepConfig, Trainer

# The training plan's rows that are the step's arguments (the rest is made while it runs).
STATE = ("trained weights: fp32 masters", "AdamW moments (2 x fp32)", "frozen weights", "MoE selection biases (fp32)",
         "step, RNG key, optimizer counters")


def compiled_step(config, mesh, *, lora_rank: int, remat: str, micro_batch: int, seq_len: int, dtype: str):
    """The compiled training step of `config` on `mesh`, lowered from abstract arguments."""
    trainer = Trainer(config, mesh, StepConfig(compute_dtype=dtype, remat=remat, lora_rank=lora_rank))
    shardings = trainer.param_shardings()

    def init():
        params = model_params(InklingModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        return trainer.init({n: jax.lax.with_sharding_constraint(x, shardings[n]) for n, x in params.items()})

    state, frozen = jax.eval_shape(init)
    state = trainer.abstract_state(state)
    frozen = abstract_like(frozen, trainer.shardings.flat(frozen))
    shape = (1, micro_batch, seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=activation_sharding(mesh, "microbatches", shape))
             for k in BATCH_KEYS}
    batch_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in batch.values())
    return trainer._compiled("step", state, frozen, batch).lower(state, frozen, batch).compile(), batch_bytes


def compare(config, mesh_spec: str, *, lora_rank: int = 0, remat: str = "full", micro_batch: int = 8,
            seq_len: int = 256, dtype: str = "bfloat16") -> dict[str, tuple[int, int]]:
    """{"arguments": (plan, XLA), "temporaries": (plan, XLA)}, bytes per device of the step on this process's
    devices: XLA's arguments less the batch; its temporaries with the outputs that alias no argument."""
    compiled, batch_bytes = compiled_step(config, make_mesh(mesh_spec), lora_rank=lora_rank, remat=remat,
                                          micro_batch=micro_batch, seq_len=seq_len, dtype=dtype)
    m = compiled.memory_analysis()
    plan = training_plan(config, abstract_mesh(parse_mesh_spec(mesh_spec)), dtype=jnp.dtype(dtype),
                         lora_rank=lora_rank, remat=remat, micro_batch=micro_batch, seq_len=seq_len)
    state = sum(plan[k] for k in STATE if k in plan)
    return {"arguments": (state, m.argument_size_in_bytes - batch_bytes),
            "temporaries": (sum(plan.values()) - state,
                            m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m plan.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="inkling")
    p.add_argument("--mesh", default="fsdp=2,tensor=2,expert=2")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--remat", default="full", choices=sorted(REMAT_POLICIES))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"],
                   help="cpu: as many simulated devices as the mesh needs; gpu: this host's GPUs (nothing allocated)")
    args = p.parse_args(argv)
    if args.platform == "cpu":  # read when the backend starts, which nothing above has made it do
        count = math.prod(parse_mesh_spec(args.mesh).values())
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    jax.config.update("jax_platforms", "cuda" if args.platform == "gpu" else "cpu")
    # Text only: jit drops the arguments a step never reads (the media towers, an untrained MTP head).
    config = dataclasses.replace(probe(preset(args.preset))[0], vision=None, audio=None, mtp=None)
    rows = compare(config, args.mesh, lora_rank=args.lora_rank, remat=args.remat, micro_batch=args.micro_batch,
                   seq_len=args.seq_len)
    print(f"`{args.preset}`, one layer per kind ({config.text.num_layers}), text only; mesh {args.mesh}; "
          f"micro-batch {args.micro_batch} x {args.seq_len} tokens; remat {args.remat}; LoRA rank {args.lora_rank}\n")
    print(f"| per device, GiB | plan | XLA ({args.platform.upper()} compile) |\n|---|---:|---:|")
    for name, (plan, xla) in rows.items():
        print(f"| {name} | {plan / GIB:.3f} | {xla / GIB:.3f} |")


if __name__ == "__main__":
    main()
