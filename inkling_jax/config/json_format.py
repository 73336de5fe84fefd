"""The hub's `config.json`, read and written. Two forms exist and both parse:
- the raw published one: `dense_intermediate_size`, `dense_mlp_idx`, `local_layer_ids`, `sconv_kernel_size`,
  `model_max_length`, a top-level `mtp_config`; there `intermediate_size` is the width of each expert;
- the one transformers' `save_pretrained` writes: `layer_types`, `mlp_layer_types`, `moe_intermediate_size`,
  `conv_kernel_size`; there `intermediate_size` is the dense MLP width.
Unknown fields, fields that contradict each other and fields of the wrong JSON type (`"64"` for 64, `1` for
true) are errors naming the field: a silent default or coercion here means wrong weights later.
`to_published` writes the published form.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from inkling_jax.config.generation import load_generation_config
from inkling_jax.config.schema import (AudioConfig, ConfigError, InklingConfig, MTPConfig, TextConfig,
                                       VisionConfig)

DEFAULT_EOS = 200006  # the release's `<|content_model_end_sampling|>`, for a config that names no EOS

# Fields that carry no information for this implementation, or whose only supported value is checked here.
_TEXT_FIXED = {
    "hidden_act": "silu", "tie_word_embeddings": False, "use_sconv": True, "use_embed_norm": True,
    "gate_activation": "sigmoid", "norm_after_topk": True, "use_gate_bias": True, "use_global_scale": True,
    "q_bias": False, "o_bias": False, "final_logit_softcapping": None, "inference_moe_w13_interleaved": True,
    "shared_expert_sink": True, "shared_experts_size": 1, "mtp_hidden_states_first": True,
    "number_of_conv_states": 4,
}
_TEXT_IGNORED = {
    "model_type", "initializer_range", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
    "torch_dtype", "dtype", "transformers_version", "rms_norm_eps_moe_gate", "architectures", "use_cache",
    "chain_hidden_post_norm", "num_mtp_layers", "mtp_local_layer_ids", "output_router_logits",
}
_TOP_IGNORED = {
    "model_type", "architectures", "torch_dtype", "dtype", "transformers_version", "image_bos_token_id",
    "audio_bos_token_id", "tie_word_embeddings", "pad_token_id", "bos_token_id", "use_cache",
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KINDS = {  # the JSON type of a field: (what an error calls it, the test)
    "size": ("a positive integer", lambda v: _is_int(v) and v > 0),
    "count": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "number": ("a finite number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v)),
    "flag": ("true or false", lambda v: isinstance(v, bool)),
    "ids": ("a list of non-negative integers", lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v)),
    "names": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v)),
    "object": ("a JSON object", lambda v: isinstance(v, dict)),
    "tokens": ("a token id or a non-empty list of them",
               lambda v: _is_int(v) and v >= 0 or _KINDS["ids"][1](v) and len(v) > 0),
}


def _checked(where: str, name: str, value, kind: str, default=...):
    """`value` if it is of `kind`; null is taken where the field's default is null."""
    what, test = _KINDS[kind]
    if not (test(value) or value is None and default is None):
        raise ConfigError(f"{where}.{name} must be {what}, got {value!r:.80}")
    return value


class _Fields:
    """Reads a dict once, field by field, so that leftovers (unknown fields) can be reported."""

    def __init__(self, data: dict, where: str):
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a JSON object, got {data!r:.80}")
        self.data, self.where, self.used = dict(data), where, set()

    def get(self, *names, kind: str, default=...):
        """The value of the first of `names` present (all present must agree), checked to be of `kind`."""
        found = [(n, _checked(self.where, n, self.data[n], kind, default)) for n in names if n in self.data]
        self.used.update(n for n, _ in found)
        values = {json.dumps(v, sort_keys=True) for _, v in found}
        if len(values) > 1:
            raise ConfigError(f"{self.where}: {' and '.join(n for n, _ in found)} disagree: "
                              + ", ".join(f"{n}={v!r}" for n, v in found))
        if found:
            return found[0][1]
        if default is ...:
            raise ConfigError(f"{self.where}: missing required field {names[0]!r}")
        return default

    def check_fixed(self, fixed: dict):
        for name, supported in fixed.items():
            if name in self.data:
                self.used.add(name)
                if json.dumps(self.data[name]) != json.dumps(supported):  # so that 1 is not taken for true
                    raise ConfigError(f"{self.where}: {name}={self.data[name]!r} is not supported "
                                      f"(Inkling uses {supported!r})")

    def finish(self, ignored=frozenset()):
        unknown = sorted(set(self.data) - self.used - set(ignored))
        if unknown:
            raise ConfigError(f"{self.where}: unknown field(s) {unknown}; refusing to guess what they mean")


def _ids_from_types(types, value, where, name):
    if not isinstance(types, list) or any(t not in value for t in types):
        raise ConfigError(f"{where}: {name} must be a list of {sorted(value)}, got {types!r}")
    return tuple(i for i, t in enumerate(types) if value[t])


def _parse_text(data: dict, mtp_block: dict) -> tuple[TextConfig, MTPConfig | None]:
    f = _Fields(data, "text_config")
    f.check_fixed(_TEXT_FIXED)
    num_layers = f.get("num_hidden_layers", kind="size")

    # Layer kinds: explicit ids, HF's per-layer type list, or the published default (every 6th is global).
    local = f.get("local_layer_ids", default=None, kind="ids")
    local = tuple(sorted(local)) if local is not None else None
    if "layer_types" in data:
        from_types = _ids_from_types(f.get("layer_types", kind="names"), {"hybrid_sliding": True, "hybrid": False},
                                     "text_config", "layer_types")
        if local is not None and local != from_types:
            raise ConfigError(f"text_config: local_layer_ids {list(local)} and layer_types disagree "
                              f"(layer_types make {list(from_types)} local)")
        local = from_types
    if local is None:
        local = tuple(i for i in range(num_layers) if (i + 1) % 6)

    dense = f.get("dense_layer_ids", default=None, kind="ids")
    dense = tuple(sorted(dense)) if dense is not None else None
    if "dense_mlp_idx" in data:
        from_idx = tuple(range(f.get("dense_mlp_idx", kind="count")))
        if dense is not None and dense != from_idx:
            raise ConfigError("text_config: dense_mlp_idx and dense_layer_ids disagree")
        dense = from_idx
    if "mlp_layer_types" in data:
        from_types = _ids_from_types(f.get("mlp_layer_types", kind="names"), {"dense": True, "sparse": False},
                                     "text_config", "mlp_layer_types")
        if dense is not None and dense != from_types:
            raise ConfigError("text_config: mlp_layer_types and dense_mlp_idx disagree")
        dense = from_types
    if dense is None:
        raise ConfigError("text_config: no dense_mlp_idx, dense_layer_ids or mlp_layer_types: "
                          "cannot tell dense layers from MoE layers")

    # The width trap: the raw form's `intermediate_size` is the expert width.
    if "dense_intermediate_size" in data:
        dense_width = f.get("dense_intermediate_size", kind="size")
        expert_width = f.get("intermediate_size", "moe_intermediate_size", kind="size")
    elif "moe_intermediate_size" in data:
        dense_width = f.get("intermediate_size", kind="size")
        expert_width = f.get("moe_intermediate_size", kind="size")
    else:
        raise ConfigError("text_config: neither dense_intermediate_size (published form) nor "
                          "moe_intermediate_size (transformers form): the expert width is ambiguous")

    def size(*names, default=...):
        return f.get(*names, kind="size", default=default)

    def number(name, default):
        return float(f.get(name, kind="number", default=default))

    vocab = size("vocab_size")
    unpadded = size("unpadded_vocab_size", default=None)
    text = TextConfig(
        vocab_size=vocab, unpadded_vocab_size=vocab if unpadded is None else unpadded,
        hidden_size=size("hidden_size"), num_layers=num_layers,
        num_heads=size("num_attention_heads"), num_kv_heads=size("num_key_value_heads"),
        head_dim=size("head_dim"), rel_extent=size("rel_extent"),
        swa_num_heads=size("swa_num_attention_heads"), swa_num_kv_heads=size("swa_num_key_value_heads"),
        swa_head_dim=size("swa_head_dim"), sliding_window=size("sliding_window_size", "sliding_window"),
        d_rel=size("d_rel"), local_layer_ids=local, dense_layer_ids=dense,
        dense_intermediate_size=dense_width, moe_intermediate_size=expert_width,
        num_experts=size("n_routed_experts", "num_local_experts"),
        num_experts_per_tok=size("num_experts_per_tok"), num_shared_experts=f.get("n_shared_experts", kind="count"),
        route_scale=number("route_scale", 8.0),
        logits_mup_width_multiplier=number("logits_mup_width_multiplier", 24.0),
        log_scaling_n_floor=size("log_scaling_n_floor", default=None),
        log_scaling_alpha=number("log_scaling_alpha", 0.1),
        max_position_embeddings=size("model_max_length", "max_position_embeddings", default=1048576),
        rms_norm_eps=number("rms_norm_eps", 1e-6),
        conv_kernel_size=size("sconv_kernel_size", "conv_kernel_size", default=4),
    )
    # MTP settings come from the top-level mtp_config (published) or from text_config (transformers).
    num_mtp = _mtp_field(mtp_block, "num_nextn_predict_layers", data, "num_mtp_layers", "count", None)
    if "num_mtp_layers" in data and mtp_block and data["num_mtp_layers"] != num_mtp:
        raise ConfigError("mtp_config.num_nextn_predict_layers and text_config.num_mtp_layers disagree")
    mtp = None
    if num_mtp:
        mtp_local = _mtp_field(mtp_block, "local_layer_ids", data, "mtp_local_layer_ids", "ids", None)
        mtp = MTPConfig(num_layers=num_mtp,
                        local_layer_ids=tuple(mtp_local) if mtp_local is not None else (),
                        chain_hidden_post_norm=_mtp_field(mtp_block, "chain_hidden_post_norm", data,
                                                          "chain_hidden_post_norm", "flag", False))
        if mtp.chain_hidden_post_norm:
            raise ConfigError("mtp chain_hidden_post_norm=true is not supported (the release has it off)")
    f.finish(_TEXT_IGNORED)
    return text, mtp


def _mtp_field(block: dict, name: str, text: dict, text_name: str, kind: str, default):
    """An MTP setting, from the top-level mtp_config (published form) or else from text_config (transformers)."""
    if name in block:
        return _checked("mtp_config", name, block[name], kind, default)
    if text_name in text:
        return _checked("text_config", text_name, text[text_name], kind, default)
    return default


def _tower_fields(data: dict, name: str, fixed: dict, hidden: int) -> _Fields:
    """The fields of a media tower's config, after the checks both towers share: the fixed choices of the
    release and an output width equal to the text model's."""
    f = _Fields(data, name)
    f.check_fixed(fixed)
    out = f.get("decoder_dmodel", "text_hidden_size", default=hidden, kind="size")
    if out != hidden:
        raise ConfigError(f"{name}: output width {out} != text hidden_size {hidden}")
    return f


def _parse_vision(data: dict, hidden: int) -> VisionConfig:
    f = _tower_fields(data, "vision_config", {"vision_encoder_type": "hmlp", "use_vision_norm": True}, hidden)
    cfg = VisionConfig(patch_size=f.get("patch_size", default=40, kind="size"),
                       temporal_patch_size=f.get("temporal_patch_size", default=2, kind="size"),
                       num_channels=f.get("n_channels", "num_channels", default=3, kind="size"),
                       n_layers=f.get("n_layers", "num_hidden_layers", default=4, kind="size"))
    # transformers writes ViT-like fields the HMLP never uses.
    f.finish({"model_type", "hidden_size", "num_attention_heads", "rms_norm_eps", "initializer_range",
              "dtype", "torch_dtype"})
    return cfg


def _parse_audio(data: dict, hidden: int) -> AudioConfig:
    f = _tower_fields(data, "audio_config", {"audio_mode": "dmel", "use_audio_norm": True}, hidden)
    cfg = AudioConfig(n_mel_bins=f.get("n_mel_bins", default=80, kind="size"),
                      mel_vocab_size=f.get("mel_vocab_size", default=16, kind="size"),
                      dmel_min_value=float(f.get("dmel_min_value", default=-7.0, kind="number")),
                      dmel_max_value=float(f.get("dmel_max_value", default=2.0, kind="number")))
    f.finish({"model_type", "rms_norm_eps", "initializer_range", "dtype", "torch_dtype"})
    return cfg


def parse_config(data: dict) -> InklingConfig:
    """An `InklingConfig` from a config.json dict in either form (multimodal or text-only)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config.json must be a JSON object, got {data!r:.80}")
    if "text_config" not in data:  # a text-only config: the whole dict is the text block
        text, mtp = _parse_text(data, {})
        eos = _checked("config.json", "eos_token_id", data.get("eos_token_id"), "tokens", None)
        return InklingConfig(text=text, mtp=mtp, eos_token_id=DEFAULT_EOS if eos is None else _first(eos))
    f = _Fields(data, "config.json")
    mtp_block = f.get("mtp_config", default=None, kind="object") or {}
    text_data = f.get("text_config", kind="object")
    # transformers' save_pretrained keeps EOS in text_config only; the published form has it at the top.
    eos = f.get("eos_token_id", default=None, kind="tokens")
    if eos is None:
        eos = _checked("config.json.text_config", "eos_token_id", text_data.get("eos_token_id"), "tokens", None)
    text, mtp = _parse_text(text_data, mtp_block)
    vision = f.get("vision_config", default=None, kind="object")
    audio = f.get("audio_config", default=None, kind="object")
    cfg = InklingConfig(
        text=text, mtp=mtp,
        vision=_parse_vision(vision, text.hidden_size) if vision is not None else None,
        audio=_parse_audio(audio, text.hidden_size) if audio is not None else None,
        image_token_id=f.get("image_token_id", default=200054, kind="count"),
        audio_token_id=f.get("audio_token_id", default=200053, kind="count"),
        eos_token_id=DEFAULT_EOS if eos is None else _first(eos),
    )
    f.finish(_TOP_IGNORED | {"quantization_config"})
    return cfg


def _first(value):
    return value[0] if isinstance(value, list) else value


def load_config(path: str | os.PathLike) -> InklingConfig:
    """Parse `config.json` in a model directory (or the file itself)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{file}: not found (is this an Inkling model directory?)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: binary data, not a JSON config (pass the model directory or its "
                          f"config.json)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read ({e.strerror})") from None
    try:
        config = parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None
    return _with_generation_eos(config, data, os.path.dirname(file))


def _with_generation_eos(config: InklingConfig, data: dict, directory: str) -> InklingConfig:
    """The EOS of generation_config.json when config.json names none; an error when the two disagree."""
    stops = load_generation_config(directory).eos_token_ids
    if not stops:
        return config
    named = data.get("eos_token_id", data.get("text_config", {}).get("eos_token_id"))
    if named is None:
        return dataclasses.replace(config, eos_token_id=stops[0])
    if config.eos_token_id not in stops:
        raise ConfigError(f"{directory}: config.json's eos_token_id {config.eos_token_id} is not among "
                          f"generation_config.json's {list(stops)}")
    return config


def to_published(cfg: InklingConfig) -> dict[str, Any]:
    """The raw published form of `cfg`; `parse_config(to_published(cfg)) == cfg`."""
    t = cfg.text
    text = {
        "vocab_size": t.vocab_size, "unpadded_vocab_size": t.unpadded_vocab_size,
        "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "swa_num_attention_heads": t.swa_num_heads, "swa_num_key_value_heads": t.swa_num_kv_heads,
        "swa_head_dim": t.swa_head_dim, "sliding_window_size": t.sliding_window, "d_rel": t.d_rel,
        "rel_extent": t.rel_extent, "local_layer_ids": list(t.local_layer_ids),
        # The release's field (and the one transformers reads) when the dense layers come first, as they do.
        **({"dense_mlp_idx": len(t.dense_layer_ids)} if t.dense_layer_ids == tuple(range(len(t.dense_layer_ids)))
           else {"dense_layer_ids": list(t.dense_layer_ids)}),
        "dense_intermediate_size": t.dense_intermediate_size, "intermediate_size": t.moe_intermediate_size,
        "n_routed_experts": t.num_experts, "num_experts_per_tok": t.num_experts_per_tok,
        "n_shared_experts": t.num_shared_experts, "route_scale": t.route_scale,
        "logits_mup_width_multiplier": t.logits_mup_width_multiplier,
        "log_scaling_n_floor": t.log_scaling_n_floor, "log_scaling_alpha": t.log_scaling_alpha,
        "model_max_length": t.max_position_embeddings, "rms_norm_eps": t.rms_norm_eps,
        "sconv_kernel_size": t.conv_kernel_size,
    }
    out: dict[str, Any] = {"model_type": "inkling_mm_model", "text_config": text,
                           "image_token_id": cfg.image_token_id, "audio_token_id": cfg.audio_token_id,
                           "eos_token_id": cfg.eos_token_id}
    if cfg.vision is not None:
        v = cfg.vision
        out["vision_config"] = {"vision_encoder_type": "hmlp", "patch_size": v.patch_size,
                                "temporal_patch_size": v.temporal_patch_size, "n_channels": v.num_channels,
                                "n_layers": v.n_layers}
    if cfg.audio is not None:
        a = cfg.audio
        out["audio_config"] = {"audio_mode": "dmel", "n_mel_bins": a.n_mel_bins,
                               "mel_vocab_size": a.mel_vocab_size, "dmel_min_value": a.dmel_min_value,
                               "dmel_max_value": a.dmel_max_value}
    if cfg.mtp is not None:
        out["mtp_config"] = {"num_nextn_predict_layers": cfg.mtp.num_layers,
                             "local_layer_ids": list(cfg.mtp.local_layer_ids),
                             "chain_hidden_post_norm": cfg.mtp.chain_hidden_post_norm}
    return out
