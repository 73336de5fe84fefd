"""Training memory on each device of a mesh, as `train.step.Trainer` holds it: the fp32 master copies of the
trained weights, AdamW's two fp32 moments, the gradients, the frozen weights in the compute dtype (with LoRA,
the base model; else the media towers and the MTP head), the MoE selection biases, and the activations a step
keeps for its backward pass under the chosen rematerialisation.

Weights, masters, moments and gradients are exact (shapes and the rules table's splits). With `fsdp`, each
layer's weights are gathered whole over it while the layer runs, and its weight gradients exist whole before
they are reduce-scattered: the largest layer's, twice, in the compute dtype. Activations are an estimate: per
token and layer, the tensors each policy keeps (`REMAT_POLICIES`) in the compute dtype, with heads and MLP
widths split over `tensor` and rows over the batch axes, not the attention scores (the attention kernels
recompute them), plus one loss chunk's logits and their gradient in fp32. The AOT cross-check
(`plan.aot`) sets them beside what XLA's compiled step says.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from inkling_jax.config import InklingConfig, TextConfig
from inkling_jax.parallel.rules import logical_axes, spec_for
from plan.weights import Weight, model_weights
from train.lora import TARGETS, adapter_axes
from train.optim import OptimConfig, make_optimizer
from train.state import BIAS_NAME, is_trainable

FP32 = 4


def _name(w: Weight) -> str:
    return ".".join(str(p) for p in w.path)


def adapters(w: Weight, rank: int) -> list[Weight]:
    """The fp32 LoRA factors of a target weight W [..., in, out]: A [..., in, r] and B [..., r, out]."""
    *lead, fan_in, fan_out = w.shape
    axes = logical_axes(w.path, len(w.shape))
    return [Weight(w.path + (part,), shape, jnp.dtype(jnp.float32), w.count, adapter_axes(part, axes))
            for part, shape in ((".lora_a", (*lead, fan_in, rank)), (".lora_b", (*lead, rank, fan_out)))]


def layer_activation_bytes(text: TextConfig, layer: int, tensor: int, remat: str, itemsize: int) -> int:
    """Bytes per token that one layer keeps for the backward pass (module docstring)."""
    s = text.attention(text.is_local(layer))
    split = tensor if s.num_heads % tensor == 0 and s.num_kv_heads % tensor == 0 else 1
    h = text.hidden_size
    projections = (2 * s.num_heads * s.head_dim + 2 * s.num_kv_heads * s.head_dim + s.num_heads * text.d_rel) // split
    if text.is_dense(layer):
        mlp = 2 * text.dense_intermediate_size // tensor  # gate and up products
    else:
        active = text.num_experts_per_tok + text.num_shared_experts
        mlp = active * (2 * text.moe_intermediate_size // tensor + h)  # each chosen expert's products and output
        mlp += (text.num_experts + text.num_shared_experts) * FP32 // itemsize  # the router's fp32 scores
    if remat == "dots":  # the matmul outputs: projections, o-projection and MLP products
        return (projections + h + mlp + h) * itemsize
    # everything: the norms' inputs and outputs, convs and residuals (8 x hidden), projections, the attention
    # output, the MLP's activation product (as wide as its gate)
    return (8 * h + projections + s.num_heads * s.head_dim // split + mlp + mlp // 2) * itemsize


def activation_bytes(text: TextConfig, mesh: AbstractMesh, remat: str, micro_batch: int, seq_len: int,
                     dtype, loss_chunk: int) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    rows = micro_batch // math.prod(mesh.shape[a] for a in _axes(spec_for(("batch",), (micro_batch,), mesh)[0]))
    tokens = rows * seq_len
    per_layer = [layer_activation_bytes(text, i, mesh.shape["tensor"], remat if remat != "full" else "none",
                                        itemsize) for i in range(text.num_layers)]
    if remat == "full":  # the layer inputs, and one layer's intermediates while it is recomputed
        kept = text.num_layers * text.hidden_size * itemsize + max(per_layer)
    else:
        kept = sum(per_layer)
    vocab = text.vocab_size // (mesh.shape["tensor"] if text.vocab_size % mesh.shape["tensor"] == 0 else 1)
    return tokens * kept + 2 * rows * min(loss_chunk, seq_len) * vocab * FP32


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def counter_bytes() -> int:
    """The state's scalars, whole on every device: the step, the RNG key and the optimizer's counters."""
    leaves = jax.tree.leaves(jax.eval_shape(make_optimizer(OptimConfig()).init,
                                            {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)}))
    leaves += [jax.ShapeDtypeStruct((), jnp.int32), jax.eval_shape(lambda: jax.random.PRNGKey(0))]
    return sum(x.size * x.dtype.itemsize for x in leaves if x.shape != (2, 2))


def gathered_layer_bytes(weights: list[Weight], mesh: AbstractMesh) -> int:
    """The largest decoder layer's weights per device as the step uses them: gathered over `fsdp` (each layer's
    in turn), still split over the other axes."""
    whole_fsdp = AbstractMesh(tuple(1 if a == "fsdp" else n for a, n in mesh.shape.items()), mesh.axis_names)
    layers: dict[int, int] = {}
    for w in weights:
        if w.path[0] == "layers":
            layers[w.path[1]] = layers.get(w.path[1], 0) + w.nbytes(whole_fsdp) // w.count
    return max(layers.values())


def training_plan(config: InklingConfig, mesh: AbstractMesh, *, dtype=jnp.bfloat16, lora_rank: int = 0,
                  remat: str = "full", micro_batch: int = 1, seq_len: int = 4096, loss_chunk: int = 1024,
                  weights: list[Weight] | None = None) -> dict[str, int]:
    """{what: bytes per device} of a training step's state and activations."""
    weights = model_weights(config, dtype) if weights is None else weights
    bias = [w for w in weights if _name(w).endswith(BIAS_NAME)]
    rest = [w for w in weights if not _name(w).endswith(BIAS_NAME)]
    elements = lambda ws: sum(w.nbytes(mesh) // w.dtype.itemsize for w in ws)  # noqa: E731
    nbytes = lambda ws: sum(w.nbytes(mesh) for w in ws)  # noqa: E731
    if lora_rank:
        targets = [w for w in rest if TARGETS.match(_name(w)) and len(w.shape) >= 2]
        trained = [a for w in targets for a in adapters(w, lora_rank)]
        frozen = rest
    else:
        trained = [w for w in rest if is_trainable(_name(w), w.dtype)]
        frozen = [w for w in rest if not is_trainable(_name(w), w.dtype)]
    n = elements(trained)
    out = {"trained weights: fp32 masters": FP32 * n, "AdamW moments (2 x fp32)": 2 * FP32 * n,
           "gradients (fp32)": FP32 * n}
    itemsize = jnp.dtype(dtype).itemsize
    if lora_rank:
        out["merged weights W + s A B (compute dtype)"] = itemsize * elements(targets)
    else:
        out["trained weights in the compute dtype"] = itemsize * n
    if mesh.shape["fsdp"] > 1:
        out["one layer gathered over fsdp, with its gradients"] = 2 * gathered_layer_bytes(weights, mesh)
    out["frozen weights"] = nbytes(frozen)
    out["MoE selection biases (fp32)"] = nbytes(bias)
    out["step, RNG key, optimizer counters"] = counter_bytes()
    out[f"activations (remat {remat}, estimate)"] = activation_bytes(
        config.text, mesh, remat, micro_batch, seq_len, dtype, loss_chunk)
    return out
