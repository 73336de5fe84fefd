"""config.json parsing in both published and transformers forms, presets, and clear errors."""

import json

import pytest

from inkling_jax.config import ConfigError, load_config, parse_config, preset, to_published

PUBLISHED_TEXT = {  # the raw published form, as the spec transcribes it (shrunk to 12 layers)
    "vocab_size": 201024, "unpadded_vocab_size": 200058, "hidden_size": 6144, "num_hidden_layers": 12,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 16, "swa_head_dim": 128, "sliding_window_size": 512,
    "local_layer_ids": [i for i in range(12) if (i + 1) % 6], "d_rel": 16, "rel_extent": 1024,
    "log_scaling_n_floor": 128000, "log_scaling_alpha": 0.1, "model_max_length": 1048576, "rms_norm_eps": 1e-6,
    "use_embed_norm": True, "use_sconv": True, "sconv_kernel_size": 4, "dense_mlp_idx": 2,
    "dense_intermediate_size": 24576, "intermediate_size": 3072, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "shared_expert_sink": True, "gate_activation": "sigmoid",
    "norm_after_topk": True, "use_gate_bias": True, "use_global_scale": True, "route_scale": 8.0,
    "logits_mup_width_multiplier": 24.0, "final_logit_softcapping": None, "q_bias": False, "o_bias": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def published(**text_changes):
    text = dict(PUBLISHED_TEXT, **text_changes)
    return {"model_type": "inkling_mm_model", "architectures": ["InklingForConditionalGeneration"],
            "text_config": text,
            "vision_config": {"vision_encoder_type": "hmlp", "decoder_dmodel": 6144, "patch_size": 40,
                              "temporal_patch_size": 2, "n_channels": 3, "n_layers": 4, "use_vision_norm": True},
            "audio_config": {"audio_mode": "dmel", "decoder_dmodel": 6144, "n_mel_bins": 80, "mel_vocab_size": 16,
                             "dmel_min_value": -7.0, "dmel_max_value": 2.0, "use_audio_norm": True},
            "mtp_config": {"num_nextn_predict_layers": 8, "local_layer_ids": [0, 2, 4, 5, 6, 7],
                           "chain_hidden_post_norm": False},
            "eos_token_id": 200006}


def test_published_form_reads_expert_width_from_intermediate_size():
    cfg = parse_config(published())
    t = cfg.text
    assert t.moe_intermediate_size == 3072 and t.dense_intermediate_size == 24576
    assert t.dense_layer_ids == (0, 1)
    assert [i for i in range(12) if not t.is_local(i)] == [5, 11]
    assert t.attention(local=True).num_kv_heads == 16 and t.attention(local=False).num_kv_heads == 8
    assert t.attention(local=True).extent == 512 and t.attention(local=False).extent == 1024
    assert cfg.mtp.num_layers == 8 and cfg.mtp.local_layer_ids == (0, 2, 4, 5, 6, 7)
    assert cfg.audio.mel_vocab_size == 16 and cfg.vision.n_layers == 4


def test_transformers_form_matches(checkpoints):
    path, ref = checkpoints("base")
    cfg = load_config(path)
    hf = ref.config.text_config
    assert cfg.text.dense_intermediate_size == hf.intermediate_size
    assert cfg.text.moe_intermediate_size == hf.moe_intermediate_size
    assert cfg.text.local_layer_ids == (0, 1, 3)
    assert cfg.text.dense_layer_ids == (0,)
    assert cfg.image_token_id == 151


def test_round_trip_through_dict():
    for name in ("tiny", "bench", "inkling", "inkling-small"):
        cfg = preset(name)
        assert parse_config(json.loads(json.dumps(to_published(cfg)))) == cfg


def test_presets_have_the_released_shapes():
    t = preset("inkling").text
    assert (t.hidden_size, t.num_layers, t.num_experts, t.num_experts_per_tok) == (6144, 66, 256, 6)
    assert len(t.local_layer_ids) == 55
    b = preset("bench").text
    assert (b.num_layers, b.num_experts, b.swa_num_kv_heads, b.num_kv_heads) == (6, 32, 16, 8)
    s = preset("inkling-small").text
    assert (s.hidden_size, s.num_layers, s.swa_num_kv_heads, s.logits_mup_width_multiplier) == (4096, 42, 8, 16.0)


@pytest.mark.parametrize("change,message", [
    ({"brand_new_field": 1}, "unknown field"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"moe_intermediate_size": 2048}, "disagree"),
    ({"layer_types": ["hybrid"] * 12}, "local_layer_ids .* and layer_types disagree"),
    ({"mlp_layer_types": ["dense"] * 12}, "mlp_layer_types and dense_mlp_idx disagree"),
    ({"num_attention_heads": 60}, "cannot be grouped"),
])
def test_bad_fields_are_clear_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(published(**change))


def test_ambiguous_expert_width_is_an_error():
    text = dict(PUBLISHED_TEXT)
    del text["dense_intermediate_size"]
    with pytest.raises(ConfigError, match="expert width is ambiguous"):
        parse_config({"text_config": text})


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
