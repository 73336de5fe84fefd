"""Frozen configuration of Inkling, parsed from a model directory's `config.json` or taken from a preset.

Two `config.json` forms exist and both parse here:
- the raw published one: `dense_intermediate_size`, `dense_mlp_idx`, `local_layer_ids`, `sconv_kernel_size`,
  `model_max_length`, a top-level `mtp_config`; there `intermediate_size` is the width of each expert;
- the one transformers' `save_pretrained` writes: `layer_types`, `mlp_layer_types`, `moe_intermediate_size`,
  `conv_kernel_size`; there `intermediate_size` is the dense MLP width.
Unknown fields and fields that contradict each other are errors: a silent default here means wrong weights later.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe an Inkling model."""


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    unpadded_vocab_size: int
    hidden_size: int
    num_layers: int
    # Full-attention ("global") layers.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rel_extent: int
    # Sliding-window ("local") layers; their relative extent is the window.
    swa_num_heads: int
    swa_num_kv_heads: int
    swa_head_dim: int
    sliding_window: int
    d_rel: int
    local_layer_ids: tuple[int, ...]
    dense_layer_ids: tuple[int, ...]
    dense_intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    route_scale: float = 8.0
    logits_mup_width_multiplier: float = 24.0
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4

    def __post_init__(self):
        for name in ("local_layer_ids", "dense_layer_ids"):
            ids = getattr(self, name)
            if any(not 0 <= i < self.num_layers for i in ids):
                raise ConfigError(f"{name} {list(ids)} has ids outside [0, {self.num_layers})")
        for heads, kv in ((self.num_heads, self.num_kv_heads), (self.swa_num_heads, self.swa_num_kv_heads)):
            if heads % kv:
                raise ConfigError(f"{heads} query heads cannot be grouped over {kv} KV heads")
        if self.unpadded_vocab_size > self.vocab_size:
            raise ConfigError(f"unpadded_vocab_size {self.unpadded_vocab_size} > vocab_size {self.vocab_size}")

    def is_local(self, layer: int) -> bool:
        return layer in self.local_layer_ids

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layer_ids

    def attention(self, local: bool) -> "AttentionShape":
        """The attention shape of one layer kind."""
        if local:
            return AttentionShape(self.swa_num_heads, self.swa_num_kv_heads, self.swa_head_dim,
                                  window=self.sliding_window, extent=self.sliding_window, log_scaling=False)
        return AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim, window=None,
                              extent=self.rel_extent, log_scaling=self.log_scaling_n_floor is not None)


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # None: full causal attention
    extent: int  # relative-bias range E
    log_scaling: bool


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The HMLP patch encoder: one token per patch_size x patch_size x temporal_patch_size patch."""

    patch_size: int = 40
    temporal_patch_size: int = 2
    num_channels: int = 3
    n_layers: int = 4


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """dMel audio: each of n_mel_bins log-mel values is quantised to one of mel_vocab_size levels."""

    n_mel_bins: int = 80
    mel_vocab_size: int = 16
    dmel_min_value: float = -7.0
    dmel_max_value: float = 2.0


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    num_layers: int = 8
    local_layer_ids: tuple[int, ...] = (0, 2, 4, 5, 6, 7)
    chain_hidden_post_norm: bool = False


@dataclasses.dataclass(frozen=True)
class InklingConfig:
    text: TextConfig
    vision: VisionConfig | None = None
    audio: AudioConfig | None = None
    mtp: MTPConfig | None = None
    image_token_id: int = 200054
    audio_token_id: int = 200053
    eos_token_id: int = 200006

    def replace(self, **text_changes) -> "InklingConfig":
        """A copy with some text fields changed (for tests and presets)."""
        return dataclasses.replace(self, text=dataclasses.replace(self.text, **text_changes))

    def to_dict(self) -> dict[str, Any]:
        """The raw published form; `parse_config(cfg.to_dict()) == cfg`."""
        t = self.text
        text = {
            "vocab_size": t.vocab_size, "unpadded_vocab_size": t.unpadded_vocab_size,
            "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "swa_num_attention_heads": t.swa_num_heads, "swa_num_key_value_heads": t.swa_num_kv_heads,
            "swa_head_dim": t.swa_head_dim, "sliding_window_size": t.sliding_window, "d_rel": t.d_rel,
            "rel_extent": t.rel_extent, "local_layer_ids": list(t.local_layer_ids),
            "dense_layer_ids": list(t.dense_layer_ids),
            "dense_intermediate_size": t.dense_intermediate_size, "intermediate_size": t.moe_intermediate_size,
            "n_routed_experts": t.num_experts, "num_experts_per_tok": t.num_experts_per_tok,
            "n_shared_experts": t.num_shared_experts, "route_scale": t.route_scale,
            "logits_mup_width_multiplier": t.logits_mup_width_multiplier,
            "log_scaling_n_floor": t.log_scaling_n_floor, "log_scaling_alpha": t.log_scaling_alpha,
            "model_max_length": t.max_position_embeddings, "rms_norm_eps": t.rms_norm_eps,
            "sconv_kernel_size": t.conv_kernel_size,
        }
        out: dict[str, Any] = {"model_type": "inkling_mm_model", "text_config": text,
                               "image_token_id": self.image_token_id, "audio_token_id": self.audio_token_id,
                               "eos_token_id": self.eos_token_id}
        if self.vision is not None:
            v = self.vision
            out["vision_config"] = {"vision_encoder_type": "hmlp", "patch_size": v.patch_size,
                                    "temporal_patch_size": v.temporal_patch_size, "n_channels": v.num_channels,
                                    "n_layers": v.n_layers}
        if self.audio is not None:
            a = self.audio
            out["audio_config"] = {"audio_mode": "dmel", "n_mel_bins": a.n_mel_bins,
                                   "mel_vocab_size": a.mel_vocab_size, "dmel_min_value": a.dmel_min_value,
                                   "dmel_max_value": a.dmel_max_value}
        if self.mtp is not None:
            out["mtp_config"] = {"num_nextn_predict_layers": self.mtp.num_layers,
                                 "local_layer_ids": list(self.mtp.local_layer_ids),
                                 "chain_hidden_post_norm": self.mtp.chain_hidden_post_norm}
        return out


# ----------------------------------------------------------------------------------------------------------
# Parsing

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
            raise ConfigError(f"text_config: dense_mlp_idx and dense_layer_ids disagree")
        dense = from_idx
    if "mlp_layer_types" in data:
        from_types = _ids_from_types(f.get("mlp_layer_types"), {"dense": True, "sparse": False},
                                     "text_config", "mlp_layer_types")
        if dense is not None and dense != from_types:
            raise ConfigError(f"text_config: mlp_layer_types and dense_mlp_idx disagree")
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


def _parse_vision(data: dict, hidden: int) -> VisionConfig:
    f = _Fields(data, "vision_config")
    f.check_fixed({"vision_encoder_type": "hmlp", "use_vision_norm": True})
    out = f.get("decoder_dmodel", "text_hidden_size", default=hidden)
    if out != hidden:
        raise ConfigError(f"vision_config: output width {out} != text hidden_size {hidden}")
    cfg = VisionConfig(patch_size=f.get("patch_size", default=40),
                       temporal_patch_size=f.get("temporal_patch_size", default=2),
                       num_channels=f.get("n_channels", "num_channels", default=3),
                       n_layers=f.get("n_layers", "num_hidden_layers", default=4))
    # transformers writes ViT-like fields the HMLP never uses.
    f.finish({"model_type", "hidden_size", "num_attention_heads", "rms_norm_eps", "initializer_range",
              "dtype", "torch_dtype"})
    return cfg


def _parse_audio(data: dict, hidden: int) -> AudioConfig:
    f = _Fields(data, "audio_config")
    f.check_fixed({"audio_mode": "dmel", "use_audio_norm": True})
    out = f.get("decoder_dmodel", "text_hidden_size", default=hidden)
    if out != hidden:
        raise ConfigError(f"audio_config: output width {out} != text hidden_size {hidden}")
    cfg = AudioConfig(n_mel_bins=f.get("n_mel_bins", default=80), mel_vocab_size=f.get("mel_vocab_size", default=16),
                      dmel_min_value=float(f.get("dmel_min_value", default=-7.0)),
                      dmel_max_value=float(f.get("dmel_max_value", default=2.0)))
    f.finish({"model_type", "rms_norm_eps", "initializer_range", "dtype", "torch_dtype"})
    return cfg


def parse_config(data: dict) -> InklingConfig:
    """An `InklingConfig` from a config.json dict in either form (multimodal or text-only)."""
    if "text_config" not in data:  # a text-only config: the whole dict is the text block
        text, mtp = _parse_text(data, {})
        return InklingConfig(text=text, mtp=mtp)
    f = _Fields(data, "config.json")
    mtp_block = f.get("mtp_config", default=None) or {}
    text, mtp = _parse_text(f.get("text_config"), mtp_block)
    vision = f.get("vision_config", default=None)
    audio = f.get("audio_config", default=None)
    cfg = InklingConfig(
        text=text, mtp=mtp,
        vision=_parse_vision(vision, text.hidden_size) if vision is not None else None,
        audio=_parse_audio(audio, text.hidden_size) if audio is not None else None,
        image_token_id=f.get("image_token_id", default=200054),
        audio_token_id=f.get("audio_token_id", default=200053),
        eos_token_id=_first(f.get("eos_token_id", default=200006)),
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
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# Presets


def _every_sixth_global(n: int) -> tuple[int, ...]:
    return tuple(i for i in range(n) if (i + 1) % 6)


def _inkling_text(**changes) -> TextConfig:
    base = dict(
        vocab_size=201024, unpadded_vocab_size=200058, hidden_size=6144, num_layers=66,
        num_heads=64, num_kv_heads=8, head_dim=128, rel_extent=1024,
        swa_num_heads=64, swa_num_kv_heads=16, swa_head_dim=128, sliding_window=512, d_rel=16,
        local_layer_ids=_every_sixth_global(66), dense_layer_ids=(0, 1),
        dense_intermediate_size=24576, moe_intermediate_size=3072, num_experts=256, num_experts_per_tok=6,
        num_shared_experts=2, route_scale=8.0, logits_mup_width_multiplier=24.0, log_scaling_n_floor=128000,
        log_scaling_alpha=0.1, max_position_embeddings=1048576,
    )
    base.update(changes)
    return TextConfig(**base)


def preset(name: str) -> InklingConfig:
    """Named configurations: `tiny` (CPU tests), `bench` (one H200), `inkling`, `inkling-small`."""
    if name == "inkling":
        return InklingConfig(text=_inkling_text(), vision=VisionConfig(), audio=AudioConfig(), mtp=MTPConfig())
    if name == "inkling-small":
        text = _inkling_text(hidden_size=4096, num_layers=42, num_heads=32, num_kv_heads=8, swa_num_heads=32,
                             swa_num_kv_heads=8, local_layer_ids=_every_sixth_global(42),
                             dense_intermediate_size=16384, moe_intermediate_size=2048,
                             logits_mup_width_multiplier=16.0)
        return InklingConfig(text=text, vision=VisionConfig(), audio=AudioConfig(), mtp=MTPConfig())
    if name == "bench":
        # The released per-layer widths, but 6 layers and 32 routed experts so it fits one H200.
        text = _inkling_text(num_layers=6, local_layer_ids=_every_sixth_global(6), num_experts=32)
        return InklingConfig(text=text)
    if name == "tiny":
        text = TextConfig(
            vocab_size=384, unpadded_vocab_size=380, hidden_size=64, num_layers=4,
            num_heads=4, num_kv_heads=1, head_dim=16, rel_extent=12,
            swa_num_heads=4, swa_num_kv_heads=2, swa_head_dim=16, sliding_window=8, d_rel=4,
            local_layer_ids=(0, 1, 3), dense_layer_ids=(0,),
            dense_intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            num_shared_experts=2, log_scaling_n_floor=16, max_position_embeddings=4096,
        )
        return InklingConfig(text=text, vision=VisionConfig(patch_size=10, n_layers=3), audio=AudioConfig(),
                             mtp=MTPConfig(num_layers=2, local_layer_ids=(0,)),
                             image_token_id=300, audio_token_id=301, eos_token_id=257)
    raise ConfigError(f"unknown preset {name!r}; choose from tiny, bench, inkling, inkling-small")


def log_scaling_tau(positions, n_floor: int, alpha: float):
    """tau(p) = 1 + alpha * ln(max(1, (p + 1) / n_floor)) at 0-based positions, in fp32."""
    import jax.numpy as jnp

    n = (positions + 1).astype(jnp.float32)
    return 1.0 + alpha * jnp.log(jnp.maximum(n / n_floor, 1.0))


__all__ = ["InklingConfig", "TextConfig", "VisionConfig", "AudioConfig", "MTPConfig", "AttentionShape",
           "ConfigError", "parse_config", "load_config", "preset", "log_scaling_tau"]
