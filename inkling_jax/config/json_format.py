"""The hub's `config.json`, read and written. Two forms exist and both parse:
- the raw published one: `dense_intermediate_size`, `dense_mlp_idx`, `local_layer_ids`, `sconv_kernel_size`,
  `model_max_length`, a top-level `mtp_config`; there `intermediate_size` is the width of each expert;
- the one transformers' `save_pretrained` writes: `layer_types`, `mlp_layer_types`, `moe_intermediate_size`,
  `conv_kernel_size`; there `intermediate_size` is the dense MLP width.
Unknown fields and fields that contradict each other are errors: a silent default here means wrong weights later.
`to_published` writes the published form.
"""

from __future__ import annotations

import dataclasses
import json
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


class _Fields:
    """Reads a dict once, field by field, so that leftovers (unknown fields) can be reported."""

    def __init__(self, data: dict, where: str):
        self.data, self.where, self.used = dict(data), where, set()

    def get(self, *names, default=...):
        found = [(n, self.data[n]) for n in names if n in self.data]
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
                if self.data[name] != supported:
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
    num_layers = f.get("num_hidden_layers")

    # Layer kinds: explicit ids, HF's per-layer type list, or the published default (every 6th is global).
    local = f.get("local_layer_ids", default=None)
    local = tuple(sorted(local)) if local is not None else None
    if "layer_types" in data:
        from_types = _ids_from_types(f.get("layer_types"), {"hybrid_sliding": True, "hybrid": False},
                                     "text_config", "layer_types")
        if local is not None and local != from_types:
            raise ConfigError(f"text_config: local_layer_ids {list(local)} and layer_types disagree "
                              f"(layer_types make {list(from_types)} local)")
        local = from_types
    if local is None:
        local = tuple(i for i in range(num_layers) if (i + 1) % 6)

    dense = f.get("dense_layer_ids", default=None)
    dense = tuple(sorted(dense)) if dense is not None else None
    if "dense_mlp_idx" in data:
        from_idx = tuple(range(f.get("dense_mlp_idx")))
        if dense is not None and dense != from_idx:
            raise ConfigError("text_config: dense_mlp_idx and dense_layer_ids disagree")
        dense = from_idx
    if "mlp_layer_types" in data:
        from_types = _ids_from_types(f.get("mlp_layer_types"), {"dense": True, "sparse": False},
                                     "text_config", "mlp_layer_types")
        if dense is not None and dense != from_types:
            raise ConfigError("text_config: mlp_layer_types and dense_mlp_idx disagree")
        dense = from_types
    if dense is None:
        raise ConfigError("text_config: no dense_mlp_idx, dense_layer_ids or mlp_layer_types: "
                          "cannot tell dense layers from MoE layers")

    # The width trap: the raw form's `intermediate_size` is the expert width.
    if "dense_intermediate_size" in data:
        dense_width = f.get("dense_intermediate_size")
        expert_width = f.get("intermediate_size", "moe_intermediate_size")
    elif "moe_intermediate_size" in data:
        dense_width = f.get("intermediate_size")
        expert_width = f.get("moe_intermediate_size")
    else:
        raise ConfigError("text_config: neither dense_intermediate_size (published form) nor "
                          "moe_intermediate_size (transformers form): the expert width is ambiguous")

    vocab = f.get("vocab_size")
    unpadded = f.get("unpadded_vocab_size", default=None)
    text = TextConfig(
        vocab_size=vocab, unpadded_vocab_size=vocab if unpadded is None else unpadded,
        hidden_size=f.get("hidden_size"), num_layers=num_layers,
        num_heads=f.get("num_attention_heads"), num_kv_heads=f.get("num_key_value_heads"),
        head_dim=f.get("head_dim"), rel_extent=f.get("rel_extent"),
        swa_num_heads=f.get("swa_num_attention_heads"), swa_num_kv_heads=f.get("swa_num_key_value_heads"),
        swa_head_dim=f.get("swa_head_dim"), sliding_window=f.get("sliding_window_size", "sliding_window"),
        d_rel=f.get("d_rel"), local_layer_ids=local, dense_layer_ids=dense,
        dense_intermediate_size=dense_width, moe_intermediate_size=expert_width,
        num_experts=f.get("n_routed_experts", "num_local_experts"),
        num_experts_per_tok=f.get("num_experts_per_tok"), num_shared_experts=f.get("n_shared_experts"),
        route_scale=float(f.get("route_scale", default=8.0)),
        logits_mup_width_multiplier=float(f.get("logits_mup_width_multiplier", default=24.0)),
        log_scaling_n_floor=f.get("log_scaling_n_floor", default=None),
        log_scaling_alpha=float(f.get("log_scaling_alpha", default=0.1)),
        max_position_embeddings=f.get("model_max_length", "max_position_embeddings", default=1048576),
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        conv_kernel_size=f.get("sconv_kernel_size", "conv_kernel_size", default=4),
    )
    # MTP settings come from the top-level mtp_config (published) or from text_config (transformers).
    num_mtp = mtp_block.get("num_nextn_predict_layers", data.get("num_mtp_layers"))
    if "num_mtp_layers" in data and mtp_block and data["num_mtp_layers"] != num_mtp:
        raise ConfigError("mtp_config.num_nextn_predict_layers and text_config.num_mtp_layers disagree")
    mtp = None
    if num_mtp:
        mtp_local = mtp_block.get("local_layer_ids", data.get("mtp_local_layer_ids"))
        mtp = MTPConfig(num_layers=num_mtp,
                        local_layer_ids=tuple(mtp_local) if mtp_local is not None else (),
                        chain_hidden_post_norm=bool(mtp_block.get("chain_hidden_post_norm",
                                                                  data.get("chain_hidden_post_norm", False))))
        if mtp.chain_hidden_post_norm:
            raise ConfigError("mtp chain_hidden_post_norm=true is not supported (the release has it off)")
    f.finish(_TEXT_IGNORED)
    return text, mtp


def _tower_fields(data: dict, name: str, fixed: dict, hidden: int) -> _Fields:
    """The fields of a media tower's config, after the checks both towers share: the fixed choices of the
    release and an output width equal to the text model's."""
    f = _Fields(data, name)
    f.check_fixed(fixed)
    out = f.get("decoder_dmodel", "text_hidden_size", default=hidden)
    if out != hidden:
        raise ConfigError(f"{name}: output width {out} != text hidden_size {hidden}")
    return f


def _parse_vision(data: dict, hidden: int) -> VisionConfig:
    f = _tower_fields(data, "vision_config", {"vision_encoder_type": "hmlp", "use_vision_norm": True}, hidden)
    cfg = VisionConfig(patch_size=f.get("patch_size", default=40),
                       temporal_patch_size=f.get("temporal_patch_size", default=2),
                       num_channels=f.get("n_channels", "num_channels", default=3),
                       n_layers=f.get("n_layers", "num_hidden_layers", default=4))
    # transformers writes ViT-like fields the HMLP never uses.
    f.finish({"model_type", "hidden_size", "num_attention_heads", "rms_norm_eps", "initializer_range",
              "dtype", "torch_dtype"})
    return cfg


def _parse_audio(data: dict, hidden: int) -> AudioConfig:
    f = _tower_fields(data, "audio_config", {"audio_mode": "dmel", "use_audio_norm": True}, hidden)
    cfg = AudioConfig(n_mel_bins=f.get("n_mel_bins", default=80), mel_vocab_size=f.get("mel_vocab_size", default=16),
                      dmel_min_value=float(f.get("dmel_min_value", default=-7.0)),
                      dmel_max_value=float(f.get("dmel_max_value", default=2.0)))
    f.finish({"model_type", "rms_norm_eps", "initializer_range", "dtype", "torch_dtype"})
    return cfg


def parse_config(data: dict) -> InklingConfig:
    """An `InklingConfig` from a config.json dict in either form (multimodal or text-only)."""
    if "text_config" not in data:  # a text-only config: the whole dict is the text block
        text, mtp = _parse_text(data, {})
        eos = _first(data.get("eos_token_id"))
        return InklingConfig(text=text, mtp=mtp, eos_token_id=DEFAULT_EOS if eos is None else eos)
    f = _Fields(data, "config.json")
    mtp_block = f.get("mtp_config", default=None) or {}
    # transformers' save_pretrained keeps EOS in text_config only; the published form has it at the top.
    eos = _first(f.get("eos_token_id", default=None))
    if eos is None:
        eos = _first(f.get("text_config").get("eos_token_id"))
    text, mtp = _parse_text(f.get("text_config"), mtp_block)
    vision = f.get("vision_config", default=None)
    audio = f.get("audio_config", default=None)
    cfg = InklingConfig(
        text=text, mtp=mtp,
        vision=_parse_vision(vision, text.hidden_size) if vision is not None else None,
        audio=_parse_audio(audio, text.hidden_size) if audio is not None else None,
        image_token_id=f.get("image_token_id", default=200054),
        audio_token_id=f.get("audio_token_id", default=200053),
        eos_token_id=DEFAULT_EOS if eos is None else eos,
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
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
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
