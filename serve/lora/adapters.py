"""LoRA adapters as a server reads them: what `train.run --lora-rank` writes (`train.lora`'s file, or the directory
holding it) and PEFT's layout (`adapter_config.json` + `adapter_model.safetensors`), both checked against the
weights the server adapts. Every tensor is named by its base weight the way `train.lora` names it
("layers.3.attn.wq.kernel"); PEFT's module names are the hub's (`inkling_jax.checkpoint.loading`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re

import numpy as np

from inkling_jax.checkpoint.safetensors_io import SafetensorsFile
from train import lora

TRAIN_FILE = "adapters.safetensors"  # the name `train.run` gives its adapters file
PEFT_CONFIG, PEFT_FILE = "adapter_config.json", "adapter_model.safetensors"

# PEFT module (the hub's name) -> the weights it adapts here. The hub's dense w13 interleaves gate and up by row,
# so its B [2 * width, r] splits into the gate's and the up's, which share its A.
_PEFT_MODULE = re.compile(r"^(?:base_model\.model\.)?model\.llm\.layers\.(\d+)\."
                          r"(attn\.(?:wq_du|wk_dv|wv_dv|wr_du|wo_ud)|mlp\.(?:w13_dn|w2_md))\.lora_([AB])\.weight$")
_PEFT_TARGETS = {"attn.wq_du": ("attn.wq.kernel",), "attn.wk_dv": ("attn.wk.kernel",),
                 "attn.wv_dv": ("attn.wv.kernel",), "attn.wr_du": ("attn.wr.kernel",),
                 "attn.wo_ud": ("attn.wo.kernel",), "mlp.w13_dn": ("mlp.w_gate", "mlp.w_up"),
                 "mlp.w2_md": ("mlp.w_down",)}


_loads = itertools.count()


@dataclasses.dataclass(eq=False)
class Adapter:
    """One load of an adapter: equal only to itself, so an adapter loaded again under the same name (new weights,
    say) shares neither device slots nor prefix-cache pages with the one it replaces. Its weights may leave host
    memory (`serve.lora.slots`) and be read again from `path` (`read_again`)."""
    name: str
    path: str
    rank: int
    scale: float  # alpha / rank
    weights: dict[str, tuple[np.ndarray, np.ndarray]] | None  # base weight -> (A [..., in, r], B [..., r, out]), fp32
    stamp: tuple  # (size, modification time) of each file read: what `read_again` must find
    key: bytes = dataclasses.field(default_factory=lambda: b"lora-%d" % next(_loads))  # unique to this load


def load_adapter(name: str, path: str, shapes: dict[str, tuple[int, ...]], max_rank: int) -> Adapter:
    """The adapter at `path` (a `train.run` adapters file or its directory, or a PEFT directory), checked against
    `shapes` (base weight -> shape, [in, out] or experts' [experts, in, out], of every weight this server adapts):
    an unknown target, a shape that does not fit its base weight or a rank above `max_rank` is a ValueError naming
    the adapter and the tensor."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, PEFT_CONFIG)):
            files = [os.path.join(path, PEFT_CONFIG), os.path.join(path, PEFT_FILE)]
            weights, alpha = _read_peft(name, path)
        elif os.path.exists(os.path.join(path, TRAIN_FILE)):
            files = [os.path.join(path, TRAIN_FILE)]
            weights, alpha = _read_train(name, files[0])
        else:
            raise ValueError(f"LoRA adapter {name!r}: {path} holds neither {TRAIN_FILE} nor {PEFT_CONFIG}")
    elif os.path.isfile(path):
        files = [path]
        weights, alpha = _read_train(name, path)
    else:
        raise ValueError(f"LoRA adapter {name!r}: no such file or directory: {path}")
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {path} holds no adapter tensors")
    rank = max(a.shape[-1] for a, _ in weights.values())
    for target, (a, b) in sorted(weights.items()):
        if target not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: {target} is not a weight this server adapts (attention q, k, "
                             "v, r, o, the dense MLP; with --lora-experts also the shared experts, and the routed "
                             "experts where they are held in the model's dtype)")
        *lead, fan_in, fan_out = shapes[target]
        if (a.shape[:-1], b.shape[:-2], b.shape[-1]) != ((*lead, fan_in), tuple(lead), fan_out) \
                or a.shape[-1] != b.shape[-2]:
            size = lambda *dims: "[" + ", ".join(map(str, (*lead, *dims))) + "]"  # noqa: E731
            raise ValueError(f"LoRA adapter {name!r}: {target} has A {a.shape} and B {b.shape}; the base weight is "
                             f"{size(fan_in, fan_out)}, so A must be {size(fan_in, 'r')} and B {size('r', fan_out)}")
        if a.shape[-1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {target} has rank {a.shape[-1]}, the adapter's others {rank}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    stamp = tuple((os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)
    return Adapter(name, path, rank, alpha / rank, weights, stamp)


def read_again(adapter: Adapter, shapes: dict[str, tuple[int, ...]], max_rank: int) -> dict:
    """`adapter`'s weights read again from its path, checked as at its load; a ValueError where its files changed
    since (they would be another adapter)."""
    again = load_adapter(adapter.name, adapter.path, shapes, max_rank)
    if again.stamp != adapter.stamp:
        raise ValueError(f"LoRA adapter {adapter.name!r}: {adapter.path} changed since it was loaded; load it "
                         "again under a name")
    return again.weights


def _read_train(name: str, path: str) -> tuple[dict, float]:
    try:
        tensors, alpha = lora.load_adapters(path)
    except ValueError as e:
        raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    targets = {lora.base_name(n) for n in tensors}
    missing = [t + part for t in targets for part in (lora.A, lora.B) if t + part not in tensors]
    if missing:
        raise ValueError(f"LoRA adapter {name!r}: {path} lacks {missing[0]}")
    return {t: (tensors[t + lora.A].astype(np.float32), tensors[t + lora.B].astype(np.float32))
            for t in targets}, alpha


def _read_peft(name: str, path: str) -> tuple[dict, float]:
    with open(os.path.join(path, PEFT_CONFIG)) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA" or "lora_alpha" not in config or config.get("use_rslora"):
        raise ValueError(f"LoRA adapter {name!r}: {PEFT_CONFIG} is not a plain LoRA config with lora_alpha "
                         "(rsLoRA and other PEFT types are not served)")
    f = SafetensorsFile(os.path.join(path, PEFT_FILE))
    factors: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for tensor in f.names:
        match = _PEFT_MODULE.match(tensor)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: {tensor} is not a LoRA factor of a module read from PEFT's "
                             f"layout (layers' {', '.join(_PEFT_TARGETS)}; adapters on the experts are read from "
                             f"`train.run`'s {TRAIN_FILE})")
        layer, module, part = match.groups()
        factors.setdefault((layer, module), {})[part] = np.asarray(f.read(tensor), np.float32)
    weights = {}
    for (layer, module), pair in factors.items():
        if set(pair) != {"A", "B"}:
            lacking = ({"A", "B"} - set(pair)).pop()
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {module} lacks lora_{lacking}")
        a, b = pair["A"].T, pair["B"].T  # PEFT holds torch's [r, in] and [out, r]
        targets = _PEFT_TARGETS[module]
        parts = [b] if len(targets) == 1 else [b[:, 0::2], b[:, 1::2]]  # w13's rows interleave gate and up
        weights.update({f"layers.{layer}.{t}": (a, part) for t, part in zip(targets, parts)})
    return weights, float(config["lora_alpha"])
