"""Named configurations: the released sizes and the reduced ones the tests and benchmarks run."""

from inkling_jax.config.schema import AudioConfig, ConfigError, InklingConfig, MTPConfig, TextConfig, VisionConfig


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
    """Named configurations: `tiny` (CPU tests), `inkling-tiny` (the shipped default's architecture), `bench`
    (one H200), `inkling`, `inkling-small`."""
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
    if name == "inkling-tiny":
        # The shipped default model (inkling_jax/assets/inkling-tiny): the release's layout at ~5M parameters.
        # Layers 0-4 slide and layer 5 is full (every sixth, as released), layer 0 is dense and the rest MoE with
        # the shared-expert sink; fewer KV heads on the full layer than on the sliding ones; one MTP depth. The
        # vocabulary is its 4096-entry BPE (train/default_model.py), the window and extent scaled to its
        # 512-token training rows, where log-scaling starts.
        text = TextConfig(
            vocab_size=4096, unpadded_vocab_size=4096, hidden_size=192, num_layers=6,
            num_heads=4, num_kv_heads=1, head_dim=64, rel_extent=512,
            swa_num_heads=4, swa_num_kv_heads=2, swa_head_dim=64, sliding_window=128, d_rel=16,
            local_layer_ids=_every_sixth_global(6), dense_layer_ids=(0,),
            dense_intermediate_size=384, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
            num_shared_experts=2, logits_mup_width_multiplier=192 / 256, log_scaling_n_floor=512,
            max_position_embeddings=4096,
        )
        return InklingConfig(text=text, mtp=MTPConfig(num_layers=1, local_layer_ids=(0,)), eos_token_id=1)
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
    raise ConfigError(f"unknown preset {name!r}; choose from tiny, inkling-tiny, bench, inkling, "
                      "inkling-small")
