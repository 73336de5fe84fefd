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


def _text(**changes):
    return published(**changes)


def _top(**changes):
    return dict(published(), **changes)


def _vision(**changes):
    config = published()
    config["vision_config"].update(changes)
    return config


def _mtp(**changes):
    config = published()
    config["mtp_config"].update(changes)
    return config


# Wrong JSON types, each named with its field, the type wanted and the value found (not "64 != 64" or a TypeError
# further on).
@pytest.mark.parametrize("config, message", [
    (_text(hidden_size="6144"), "text_config.hidden_size must be a positive integer, got '6144'"),
    (_text(num_hidden_layers=12.0), "text_config.num_hidden_layers must be a positive integer, got 12.0"),
    (_text(num_attention_heads=True), "text_config.num_attention_heads must be a positive integer, got True"),
    (_text(num_key_value_heads=0), "text_config.num_key_value_heads must be a positive integer, got 0"),
    (_text(vocab_size=None), "text_config.vocab_size must be a positive integer, got None"),
    (_text(dense_mlp_idx=-1), "text_config.dense_mlp_idx must be a non-negative integer, got -1"),
    (_text(route_scale="8"), "text_config.route_scale must be a finite number, got '8'"),
    (_text(rms_norm_eps=float("nan")), "text_config.rms_norm_eps must be a finite number, got nan"),
    (_text(log_scaling_n_floor="128000"), "text_config.log_scaling_n_floor must be a positive integer"),
    (_text(local_layer_ids="0,1"), "text_config.local_layer_ids must be a list of non-negative integers, got '0,1'"),
    (_text(local_layer_ids=[0, -1]), "text_config.local_layer_ids must be a list of non-negative integers"),
    (_text(layer_types=[{}, 1]), "text_config.layer_types must be a list of strings"),
    (_text(use_sconv=1), "use_sconv=1 is not supported \\(Inkling uses True\\)"),
    (_text(shared_experts_size=1.0), "shared_experts_size=1.0 is not supported"),
    (_vision(decoder_dmodel="6144"), "vision_config.decoder_dmodel must be a positive integer, got '6144'"),
    (_vision(patch_size=[40]), "vision_config.patch_size must be a positive integer"),
    (_mtp(num_nextn_predict_layers="8"), "mtp_config.num_nextn_predict_layers must be a non-negative integer"),
    (_mtp(local_layer_ids=[0.5]), "mtp_config.local_layer_ids must be a list of non-negative integers"),
    (_mtp(chain_hidden_post_norm=0), "mtp_config.chain_hidden_post_norm must be true or false, got 0"),
    (_top(eos_token_id=[]), "config.json.eos_token_id must be a token id or a non-empty list of them, got \\[\\]"),
    (_top(eos_token_id="200006"), "config.json.eos_token_id must be a token id"),
    (_top(image_token_id=-5), "config.json.image_token_id must be a non-negative integer, got -5"),
    (_top(text_config=[]), "config.json.text_config must be a JSON object, got \\[\\]"),
    (_top(audio_config="dmel"), "config.json.audio_config must be a JSON object"),
    (["a", "list"], "config.json must be a JSON object, got \\['a', 'list'\\]"),
])
def test_fields_of_the_wrong_type_are_named(config, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_a_transformers_config_with_a_quoted_width(checkpoints, tmp_path):
    """The issue's example: hidden_size "64" in a transformers-written config gave "output width 64 != 64"."""
    path, _ = checkpoints("base")
    config = json.loads(open(f"{path}/config.json").read())
    config["text_config"]["hidden_size"] = "64"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'config.json'}: text_config.hidden_size must be a positive "
                                          f"integer, got '64'"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\x00\xff\x12 binary")
    with pytest.raises(ConfigError, match="binary data, not a JSON config"):
        load_config(tmp_path)
