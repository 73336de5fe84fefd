"""What an RL step needs on one device, trainer and rollout engine side by side, and the layers of a preset that
fit (`benchmarks.rl`); the model FLOPs per trained token its MFU divides by.

The trainer (`train.rl.step.PolicyTrainer`) keeps fp32 master weights and two fp32 AdamW moments of what it trains
and fp32 copies of what it freezes (the seeded parameters as they are); its step is not donated (the engine may
hold some of the state's arrays), so the new state is written beside the old one. The engine holds the serving
view in the compute dtype and a KV pool sized for a step's sequences. Resident: state, view, pool; on top, the
largest of the step's backward pass (compute-dtype copies of the weights, with LoRA the merged weights too, fp32
gradients, activations), its update (gradients and the new state) and the weight sync (a second view while the
engine still holds the first). The activations are a rough count: per token and layer a dozen hidden-size
vectors and the MLP's intermediates in the compute dtype, and the head's logits chunk in fp32 a few times over.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from inkling_jax.config import InklingConfig
from serve.engine.config import EngineConfig
from serve.engine.memory_plan import page_bytes
from train import lora
from train.metrics import active_matmul_params, train_flops_per_token
from train.state import ModelParts, trainable_names

FIT_SHARE = 0.9  # of the device's memory a default layer count may plan for: headroom for XLA's temporaries
HIDDEN_VECTORS = 12  # hidden-size activations kept per token and layer for the backward pass (a rough count)
LOGITS_COPIES = 4  # fp32 logits, log-softmax, tempered log-softmax, its exp: of one chunk at a time


def parameter_counts(config: InklingConfig, freeze: tuple[str, ...], lora_rank: int) -> dict:
    """Parameters of the model: all, those the optimizer updates (with LoRA the adapters), those kept frozen."""
    parts = ModelParts(config, "float32")
    sizes = {n: math.prod(s) for n, s in parts.shapes.items()}
    total = sum(sizes.values())
    if lora_rank:
        adapters = jax.eval_shape(lambda: lora.init_adapters(parts.shapes, lora_rank, jax.random.key(0)))
        trained = sum(math.prod(x.shape) for x in adapters.values())
        return {"total": total, "trained": trained, "frozen": total}
    trained = sum(sizes[n] for n in trainable_names(parts, freeze))
    return {"total": total, "trained": trained, "frozen": total - trained}


def activation_bytes(config: InklingConfig, rows: int, seq_len: int, logits_chunk: int, dtype) -> int:
    """The backward pass's activations (module doc: an estimate)."""
    t, width = config.text, jnp.dtype(dtype).itemsize
    per_token = 0
    for layer in range(t.num_layers):
        mlp = (t.dense_intermediate_size if t.is_dense(layer)
               else (t.num_experts_per_tok + t.num_shared_experts) * t.moe_intermediate_size)
        per_token += (HIDDEN_VECTORS * t.hidden_size + 3 * mlp) * width
    logits = rows * min(logits_chunk, seq_len) * t.vocab_size * 4 * LOGITS_COPIES
    return rows * seq_len * per_token + logits


def memory_plan(config: InklingConfig, engine: EngineConfig, *, rows: int, seq_len: int, logits_chunk: int,
                dtype, freeze: tuple[str, ...] = (), lora_rank: int = 0) -> dict:
    """Bytes of each part of an RL step on one device (module doc), and `peak`, their sum at the worst moment."""
    counts = parameter_counts(config, freeze, lora_rank)
    width = jnp.dtype(dtype).itemsize
    total, trained, frozen = counts["total"], counts["trained"], counts["frozen"]
    plan = {"trainer_state": 12 * trained + 4 * frozen, "engine_view": width * total,
            "kv_pool": engine.num_pages * page_bytes(config.text, engine, dtype)}
    copies = width * total  # the weights in the compute dtype; with LoRA also the merged targets, fp32 as the base
    if lora_rank:
        shapes = ModelParts(config, "float32").shapes
        copies += 4 * sum(math.prod(shapes[n]) for n in lora.target_names(shapes))
    plan["step_backward"] = copies + 4 * trained + activation_bytes(config, rows, seq_len, logits_chunk, dtype)
    plan["step_update"] = 4 * trained + 12 * trained
    plan["weight_sync"] = width * total
    plan["peak"] = (plan["trainer_state"] + plan["engine_view"] + plan["kv_pool"]
                    + max(plan["step_backward"], plan["step_update"], plan["weight_sync"]))
    return {"parameters": counts, "bytes": plan}


def device_bytes(device=None) -> int | None:
    """The memory XLA may allocate on the device (None where it does not say: CPU)."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    return stats.get("bytes_limit")


def layers_that_fit(config_of, most: int, budget: int, **plan_args) -> int:
    """The most layers n <= `most` whose `memory_plan(config_of(n), ...)` peak is within FIT_SHARE of `budget`
    bytes (at least 1)."""
    fitting = [n for n in range(1, most + 1)
               if memory_plan(config_of(n), **plan_args)["bytes"]["peak"] <= FIT_SHARE * budget]
    return max(fitting, default=1)


def plan_lines(plan: dict, budget: int | None) -> list[str]:
    """The plan as a markdown table, in GB."""
    counts, parts = plan["parameters"], plan["bytes"]
    limit = f"{budget / 1e9:.1f}" if budget else "(not reported)"
    return [(f"parameters: {counts['total'] / 1e9:.3f} B, trained {counts['trained'] / 1e9:.3f} B, frozen "
             f"{counts['frozen'] / 1e9:.3f} B"), "| memory (GB) | " + " | ".join(parts) + " | device |",
            "|---|" + "---:|" * (len(parts) + 1),
            "| planned | " + " | ".join(f"{v / 1e9:.1f}" for v in parts.values()) + f" | {limit} |"]


def model_flops_per_token(config: InklingConfig, seq_len: int, freeze: tuple[str, ...], lora_rank: int) -> float:
    """Training FLOPs per token (`train.metrics.train_flops_per_token`) less the weight gradients not computed:
    all of them with LoRA, the head's when it is frozen (a frozen embedding is a lookup, no matmul)."""
    text = config.text
    flops = train_flops_per_token(text, seq_len)
    if lora_rank:
        return flops - 2 * active_matmul_params(text)
    parts = ModelParts(config, "float32")
    head_frozen = "unembed" in parts.shapes and "unembed" not in trainable_names(parts, freeze)
    return flops - (2 * text.hidden_size * text.unpadded_vocab_size if head_frozen else 0)
