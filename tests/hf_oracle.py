"""Tiny transformers Inkling models (the oracle) and their checkpoints, for the parity tests."""

import numpy as np
import torch

IMAGE_TOKEN, AUDIO_TOKEN = 151, 152

# Each variant exercises a different corner of the architecture; all are small enough for CPU tests.
VARIANTS = {  # text_config of each variant
    # window (8) and rel_extent (12) shorter than the test sequences; log-scaling from position 4;
    # 1 dense layer then MoE; explicit local ids with a global layer in the middle; 1 KV head on global
    # layers, 2 on local ones; padded vocabulary (160 rows, 150 real); image and audio towers.
    "base": dict(
        vocab_size=160, unpadded_vocab_size=150, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=12,
        log_scaling_n_floor=4, dense_mlp_idx=1, dense_intermediate_size=96, intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, local_layer_ids=[0, 1, 3]),
    # rel_extent (64) longer than the sequences, wider window, 4 KV heads on local and 2 on global layers,
    # two dense layers, an unpadded vocabulary, every sixth layer global by default.
    "long_extent": dict(
        vocab_size=128, hidden_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, swa_num_attention_heads=4, swa_num_key_value_heads=4,
        swa_head_dim=12, sliding_window_size=16, d_rel=3, rel_extent=64, log_scaling_n_floor=8,
        dense_mlp_idx=2, dense_intermediate_size=64, intermediate_size=24, n_routed_experts=6,
        num_experts_per_tok=3, n_shared_experts=2),
}


def build_model(name: str, seed: int = 0):
    from transformers import InklingConfig, InklingForConditionalGeneration

    # transformers always builds both towers (its vision defaults are huge), so every variant has small ones.
    kwargs = dict(text_config=VARIANTS[name], vision_config=dict(patch_size=10, temporal_patch_size=2, n_layers=3),
        audio_config=dict(n_mel_bins=80, mel_vocab_size=16), image_token_id=IMAGE_TOKEN,
        audio_token_id=AUDIO_TOKEN)
    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(InklingConfig(**kwargs)).eval()
    # Move every norm weight, scale, bias and conv tap off its trivial init (ones / zeros), so that a
    # mis-mapped or ignored tensor shows up in the logits.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim <= 1 or "sconv" in pname:
                base = 1.0 if ("norm" in pname or "scale" in pname) else 0.0
                p.copy_(base + 0.3 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.copy_(0.05 * torch.randn_like(b))
    return model


def write_checkpoint(name: str, directory):
    model = build_model(name)
    model.save_pretrained(directory, max_shard_size="40KB")  # several shards and an index
    return str(directory), model


def logits(model, input_ids, **media):
    with torch.no_grad():
        args = {k: torch.as_tensor(np.asarray(v)) for k, v in media.items() if v is not None}
        return model(input_ids=torch.as_tensor(np.asarray(input_ids)), **args).logits.float().numpy()


def relative_error(out, ref) -> float:
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())
