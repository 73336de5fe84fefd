"""Loading the hub checkpoint layout (`model.llm.layers.N.attn.wq_du.weight`, ...) into the module tree.

`hub_layout(config)` is the single table of how every hub tensor maps onto model parameters (renaming,
transposing `[out, in]` to `[in, out]`, de-interleaving the gate/up rows). Loading is strict: a missing,
unexpected, mis-shaped or non-float tensor, or a truncated shard, is an error naming the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
    from tqdm.auto import tqdm
except ImportError:  # a declared dependency, but loading works without its progress bar
    def tqdm(items, **_):
        return items

from inkling_jax.checkpoint.destination import taken
from inkling_jax.checkpoint.hub_source import HubSource
from inkling_jax.checkpoint.safetensors_io import (
    INDEX,
    CheckpointError,
    group_into_shards,
    index_text,
    shard_name,
    write_safetensors,
)
from inkling_jax.config import InklingConfig, load_config, to_published
from inkling_jax.checkpoint.serving_load import hold_in_nvfp4, packed_moe_layers, quantize_when_complete
from inkling_jax.nn.model import InklingModel
from inkling_jax.nn.moe import MoE
from inkling_jax.nn.moe_dispatch import ROUTED_BF16, ROUTED_NVFP4
from inkling_jax.nn.towers import plan_scales
from inkling_jax.parallel.rules import param_shardings
from inkling_jax.quant.config import QuantConfig
from inkling_jax.quant.view import serving_view

log = logging.getLogger(__name__)

PACKED_KINDS = ("packed_gate_up", "packed_down")
Path = tuple  # a parameter's path in the module tree, e.g. ("layers", 3, "attn", "wq", "kernel")

# Tensors some checkpoints carry that this model has no use for (SGLang skips the same ones).
IGNORED_PREFIXES = ("model.audio.decoder.", "model.audio.logits_processor.")
FLOATS = ("bfloat16", "float16", "float32", "float64")  # the dtypes a hub tensor may hold


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one hub tensor becomes one or two parameters, and back."""

    kind: str  # copy | linear | conv | interleaved | experts_down, or for NVFP4 as stored: packed_gate_up | packed_down
    targets: tuple[Path, ...]

    def hub_shape(self, target_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        s = target_shapes[0]
        return {
            "copy": lambda: s,
            "linear": lambda: s[::-1],  # [in, out] <- [out, in]
            "conv": lambda: (s[0], 1, s[1]),
            "interleaved": lambda: s[:-2] + (2 * s[-1], s[-2]),  # gate [.., H, I] <- [.., 2I, H]
            "experts_down": lambda: (s[0], s[2], s[1]),  # [E, I, H] <- [E, H, I]
        }[self.kind]()

    def to_model(self, x) -> list[np.ndarray]:
        """x: the hub tensor, or for the packed kinds the (packed, scale, scale2) HubSource.read_packed gives."""
        if self.kind in PACKED_KINDS:
            from pallas_kernels.moe.nvfp4 import from_checkpoint

            return list(from_checkpoint(*x, gate_up=self.kind == "packed_gate_up"))
        if self.kind == "copy":
            return [x]
        if self.kind == "linear":
            return [x.T]
        if self.kind == "conv":
            return [x[:, 0, :]]
        if self.kind == "interleaved":  # row 2i is gate_i, row 2i+1 is up_i
            return [np.swapaxes(x[..., 0::2, :], -1, -2), np.swapaxes(x[..., 1::2, :], -1, -2)]
        return [np.swapaxes(x, -1, -2)]  # experts_down

    def to_hub(self, xs: list[np.ndarray]) -> np.ndarray:
        if self.kind == "copy":
            return xs[0]
        if self.kind == "linear":
            return xs[0].T
        if self.kind == "conv":
            return xs[0][:, None, :]
        if self.kind == "interleaved":
            gate, up = (np.swapaxes(x, -1, -2) for x in xs)
            out = np.empty(gate.shape[:-2] + (2 * gate.shape[-2], gate.shape[-1]), gate.dtype)
            out[..., 0::2, :], out[..., 1::2, :] = gate, up
            return out
        return np.swapaxes(xs[0], -1, -2)


def _layer_rules(prefix: str, path: Path, dense: bool) -> dict[str, Rule]:
    p = f"{prefix}."
    rules = {
        p + "attn_norm.weight": Rule("copy", (path + ("attn_norm", "weight"),)),
        p + "mlp_norm.weight": Rule("copy", (path + ("mlp_norm", "weight"),)),
        p + "attn_sconv.weight": Rule("conv", (path + ("attn_sconv", "weight"),)),
        p + "mlp_sconv.weight": Rule("conv", (path + ("mlp_sconv", "weight"),)),
        p + "attn.q_norm.weight": Rule("copy", (path + ("attn", "q_norm", "weight"),)),
        p + "attn.k_norm.weight": Rule("copy", (path + ("attn", "k_norm", "weight"),)),
        p + "attn.k_sconv.weight": Rule("conv", (path + ("attn", "k_sconv", "weight"),)),
        p + "attn.v_sconv.weight": Rule("conv", (path + ("attn", "v_sconv", "weight"),)),
        p + "attn.rel_logits_proj.proj": Rule("copy", (path + ("attn", "rel_proj"),)),
    }
    for hub, ours in (("wq_du", "wq"), ("wk_dv", "wk"), ("wv_dv", "wv"), ("wr_du", "wr"), ("wo_ud", "wo")):
        rules[f"{p}attn.{hub}.weight"] = Rule("linear", (path + ("attn", ours, "kernel"),))
    mlp = path + ("mlp",)
    if dense:
        rules[p + "mlp.w13_dn.weight"] = Rule("interleaved", (mlp + ("w_gate",), mlp + ("w_up",)))
        rules[p + "mlp.w2_md.weight"] = Rule("linear", (mlp + ("w_down",),))
        rules[p + "mlp.global_scale"] = Rule("copy", (mlp + ("global_scale",),))
    else:
        rules[p + "mlp.gate.weight"] = Rule("linear", (mlp + ("router",),))
        rules[p + "mlp.gate.bias"] = Rule("copy", (mlp + ("router_bias",),))
        rules[p + "mlp.gate.global_scale"] = Rule("copy", (mlp + ("router_scale",),))
        rules[p + "mlp.experts.w13_weight"] = Rule("interleaved", (mlp + ("w_gate",), mlp + ("w_up",)))
        rules[p + "mlp.experts.w2_weight"] = Rule("experts_down", (mlp + ("w_down",),))
        rules[p + "mlp.shared_experts.shared_w13_weight"] = Rule("interleaved",
                                                                 (mlp + ("shared_gate",), mlp + ("shared_up",)))
        rules[p + "mlp.shared_experts.shared_w2_weight"] = Rule("experts_down", (mlp + ("shared_down",),))
    return rules


def hub_layout(config: InklingConfig) -> dict[str, Rule]:
    """Every tensor a hub checkpoint of this config holds, and where it goes."""
    text = config.text
    rules = {
        "model.llm.embed.weight": Rule("copy", (("embed",),)),
        "model.llm.embed_norm.weight": Rule("copy", (("embed_norm", "weight"),)),
        "model.llm.norm.weight": Rule("copy", (("norm", "weight"),)),
        "model.llm.unembed.weight": Rule("copy", (("unembed",),)),
    }
    for i in range(text.num_layers):
        rules.update(_layer_rules(f"model.llm.layers.{i}", ("layers", i), text.is_dense(i)))
    if config.vision is not None:
        stages = len(plan_scales(config.vision)) - 1
        for i in range(stages):
            rules[f"model.visual.layers.linear_{i}.weight"] = Rule("linear", (("vision", "linears", i, "kernel"),))
            if i < stages - 1:
                rules[f"model.visual.layers.norm_{i}.weight"] = Rule("copy", (("vision", "norms", i, "weight"),))
        rules["model.visual.final_norm.weight"] = Rule("copy", (("vision", "final_norm", "weight"),))
    if config.mtp is not None:
        for k in range(config.mtp.num_layers):
            prefix, path = f"model.mtp.layers.{k}", ("mtp", "layers", k)
            rules[f"{prefix}.embed_norm.weight"] = Rule("copy", (path + ("embed_norm", "weight"),))
            rules[f"{prefix}.hidden_norm.weight"] = Rule("copy", (path + ("hidden_norm", "weight"),))
            rules[f"{prefix}.input_proj.weight"] = Rule("linear", (path + ("input_proj", "kernel"),))
            rules.update(_layer_rules(f"{prefix}.transformer_block", path + ("block",), dense=True))
    if config.audio is not None:
        rules["model.audio.encoder.weight"] = Rule("copy", (("audio", "embedding"),))
        rules["model.audio.final_norm.weight"] = Rule("copy", (("audio", "final_norm", "weight"),))
    return rules


def abstract_model(config: InklingConfig, dtype) -> InklingModel:
    """The module tree with shapes and dtypes only (no memory), to be filled by a loader."""
    return nnx.eval_shape(lambda: InklingModel(config, dtype=dtype, rngs=nnx.Rngs(0)))


def packed_expert_rules(layers: list[int], rules: dict[str, Rule]) -> dict[str, Rule]:
    """Rules that take those layers' packed experts into NVFP4 experts as they are stored (codes and scales
    unchanged: no dequantise and quantise again), and their shared experts (`rules`' own) into the stacks of
    the ServingMoE `hold_in_nvfp4` made."""
    out = {}
    for i in layers:
        prefix, mlp = f"model.llm.layers.{i}.mlp", ("layers", i, "mlp")
        experts = [mlp + ("experts", name) for name in ROUTED_NVFP4]
        out[f"{prefix}.experts.w13_weight"] = Rule("packed_gate_up", tuple(experts[:3]))
        out[f"{prefix}.experts.w2_weight"] = Rule("packed_down", tuple(experts[3:]))
        for name in (f"{prefix}.shared_experts.shared_w13_weight", f"{prefix}.shared_experts.shared_w2_weight"):
            shared = tuple(mlp + ("shared", target[-1]) for target in rules[name].targets)
            out[name] = dataclasses.replace(rules[name], targets=shared)
    return out


def model_variables(model: nnx.Module) -> dict[Path, nnx.Variable]:
    return {path: node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)}


def load_pretrained(path: str | os.PathLike, dtype="float32", *, config: InklingConfig | None = None,
                    progress: bool = True, place: Callable[[Path, np.ndarray], jax.Array] | None = None,
                    mesh: jax.sharding.Mesh | None = None, quant: QuantConfig = QuantConfig(),
                    verify_checksums: bool = True):
    """Build an `InklingModel` from a model directory: the hub layout, or one `python -m inkling_jax.checkpoint.convert`
    wrote (an orbax checkpoint, restored straight into the shardings; each process reads what it holds).

    dtype: parameter dtype ("float32" or "bfloat16"); ShortConv taps and the router's bias and scale stay fp32.
    mesh: shard every parameter by the `sharding` table on this mesh (default: one device).
    place: hub directories only: how a host array becomes a device array (default: by `mesh`, else
    `jnp.asarray`).
    quant: for serving, the weights held as it says (`inkling_jax.quant.serving_view`, unfused: the server fuses
    where its mesh allows). With NVFP4 experts, the experts an NVFP4 checkpoint stores packed are taken as they
    are stored (`packed_expert_rules`); otherwise they are dequantised as they are read. Each MoE layer's
    routed experts are quantised as soon as they are in (a converted checkpoint is restored in parts for that),
    so the devices never hold more than one layer's experts in `dtype`; the rest once all weights are in.
    verify_checksums: converted directories only: before restoring, check the chunk files this process will read
    against the checksums the converter recorded (one more read and crc32 of those bytes).
    """
    if not isinstance(quant, QuantConfig):
        raise TypeError(f"quant must be an inkling_jax.quant.QuantConfig, not {type(quant).__name__}")
    path = os.fspath(path)
    config = config or load_config(path)
    model = abstract_model(config, jnp.dtype(dtype))
    variables = model_variables(model)
    from inkling_jax.checkpoint import orbax_io  # orbax is imported only when a converted directory is loaded

    checkpoint = None if orbax_io.is_converted(path) else HubSource(path)
    if checkpoint is not None:  # NVFP4 experts are dequantised as they are read, unless taken as stored
        rules = hub_layout(config)
        check_tensor_names(checkpoint, rules, config)
        check_shapes(checkpoint, rules, variables)
        packed = packed_moe_layers(checkpoint, model) if quant.expert_precision == "nvfp4" else []
        if packed:
            hold_in_nvfp4(model, packed)
            variables = model_variables(model)
            rules.update(packed_expert_rules(packed, rules))
    shardings = None if mesh is None else param_shardings(model, mesh)
    filled = quantize_when_complete(model, variables, quant) if quant.expert_precision != "bf16" else None
    if checkpoint is None:
        batches = None
        if filled is not None:  # everything but the routed experts, then one MoE layer's experts at a time
            experts = [[("layers", i, "mlp", name) for name in ROUTED_BF16]
                       for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
            routed = {p for batch in experts for p in batch}
            batches = [[p for p in variables if p not in routed]] + experts
        orbax_io.load_converted(path, variables, shardings, batches=batches, restored=filled, verify=verify_checksums)
    else:
        if place is None:
            place = ((lambda _, x: jnp.asarray(x)) if mesh is None
                     else (lambda p, x: jax.device_put(x, shardings[p])))
        fill_variables(checkpoint, rules, variables, place, progress, filled=filled)
    return model if quant == QuantConfig() else serving_view(model, quant, fuse=False)


def fill_variables(checkpoint, rules: dict[str, Rule], variables: dict[Path, nnx.Variable],
                   place: Callable[[Path, np.ndarray], jax.Array], progress: bool = False,
                   filled: Callable[[Path], None] | None = None) -> None:
    """Set every variable from a checked checkpoint (anything with `names`, `read(name)` and `path_of(name)`);
    `filled(path)` after each."""
    names = [n for n in checkpoint.names if n in rules]
    for name in tqdm(names, desc="loading weights", unit="tensor", disable=not progress):
        rule = rules[name]
        try:
            stored = checkpoint.read_packed(name) if rule.kind in PACKED_KINDS else np.asarray(checkpoint.read(name))
            arrays = rule.to_model(stored)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{checkpoint.path_of(name)}: cannot read tensor {name}: {e}") from None
        for target, array in zip(rule.targets, arrays):
            var = variables[target]
            var.set_value(place(target, np.asarray(array, dtype=var.get_value().dtype)))
            if filled is not None:
                filled(target)


def check_tensor_names(checkpoint: HubSource, rules: dict[str, Rule], config: InklingConfig) -> None:
    present = set(checkpoint.names)
    missing = sorted(set(rules) - present)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{checkpoint.directory}: missing tensor {missing[0]}{more}; the config "
                              f"({config.text.num_layers} layers) expects it")
    extra = sorted(n for n in present - set(rules) if not n.startswith(IGNORED_PREFIXES))
    if extra:
        raise CheckpointError(f"{checkpoint.path_of(extra[0])}: unexpected tensor {extra[0]}"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                              + "; the config does not describe it")
    skipped = [n for n in present - set(rules)]
    if skipped:
        log.info("skipping %d tensors this model does not use (e.g. %s)", len(skipped), skipped[0])


def check_shapes(checkpoint: HubSource, rules: dict[str, Rule], variables: dict[Path, nnx.Variable]) -> None:
    for name, rule in rules.items():
        expected = rule.hub_shape([tuple(variables[t].get_value().shape) for t in rule.targets])
        found = checkpoint.shape(name)
        if tuple(found) != tuple(expected):
            raise CheckpointError(f"{checkpoint.path_of(name)}: tensor {name} has shape {list(found)}, the config "
                                  f"needs {list(expected)}")
        if checkpoint.dtype(name).name not in FLOATS:
            raise CheckpointError(f"{checkpoint.path_of(name)}: tensor {name} is {checkpoint.dtype(name)}, not a "
                                  f"float type")


def save_pretrained(model: InklingModel, directory: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int = 4 << 30) -> None:
    """Write `model` in the hub layout: config.json, *.safetensors shards and their index.

    The directory is built under a temporary name and renamed into place at the end, only if nothing appeared
    there meanwhile (`destination.taken`), so a failed write never leaves a directory that looks like a
    checkpoint. dtype: cast the weights (default: as they are).
    """
    import json

    with taken(directory) as tmp:
        variables = model_variables(model)
        tensors = {}
        for name, rule in hub_layout(model.config).items():
            tensor = rule.to_hub([np.asarray(variables[t].get_value()) for t in rule.targets])
            tensors[name] = tensor if dtype is None or keeps_fp32(name) else tensor.astype(jnp.dtype(dtype))
        shards = group_into_shards(list(tensors), lambda name: tensors[name].nbytes, max_shard_bytes)
        weight_map = {}
        for i, names in enumerate(shards):
            file = shard_name(i, len(shards))
            write_safetensors(os.path.join(tmp, file), {n: tensors[n] for n in names}, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        with open(os.path.join(tmp, INDEX), "w") as fh:
            fh.write(index_text(weight_map, sum(t.nbytes for t in tensors.values())))
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(to_published(model.config), fh, indent=1)


def keeps_fp32(name: str) -> bool:
    """Tensors the reference keeps in fp32 whatever the checkpoint dtype (router bias and scale)."""
    return name.endswith(("mlp.gate.bias", "mlp.gate.global_scale"))
