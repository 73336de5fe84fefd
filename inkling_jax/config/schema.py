"""The frozen configuration of Inkling: text decoder, towers, MTP, and the attention shape of a layer kind.

Built by `json_format.parse_config` from a model directory's `config.json` or by `presets.preset`.
"""

from __future__ import annotations

import dataclasses


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


def log_scaling_tau(positions, n_floor: int, alpha: float):
    """tau(p) = 1 + alpha * ln(max(1, (p + 1) / n_floor)) at 0-based positions, in fp32."""
    import jax.numpy as jnp

    n = (positions + 1).astype(jnp.float32)
    return 1.0 + alpha * jnp.log(jnp.maximum(n / n_floor, 1.0))
