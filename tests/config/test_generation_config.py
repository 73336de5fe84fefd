"""EOS and sampling defaults where transformers writes them: text_config and generation_config.json."""

import json

import pytest

from inkling_jax.config import ConfigError, GenerationConfig, load_config, load_generation_config
from inkling_jax.config.json_format import DEFAULT_EOS


def write(directory, config, generation=None):
    (directory / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


@pytest.fixture()
def published(checkpoints):
    """A config.json as transformers' save_pretrained writes it (EOS 2 in text_config only)."""
    path, _ = checkpoints("base")
    with open(f"{path}/config.json") as fh:
        return json.load(fh)


def test_eos_of_a_transformers_checkpoint(checkpoints):
    path, _ = checkpoints("base")
    assert load_config(path).eos_token_id == 2  # not the released model's 200006


def test_eos_from_generation_config_when_config_names_none(tmp_path, published):
    del published["text_config"]["eos_token_id"]
    assert load_config(write(tmp_path, published)).eos_token_id == DEFAULT_EOS
    assert load_config(write(tmp_path, published, {"eos_token_id": [7, 9]})).eos_token_id == 7


def test_disagreeing_eos_is_an_error(tmp_path, published):
    with pytest.raises(ConfigError, match="not among generation_config.json's"):
        load_config(write(tmp_path, published, {"eos_token_id": 5}))
    assert load_config(write(tmp_path, published, {"eos_token_id": [5, 2]})).eos_token_id == 2


def test_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 3, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "num_beams": 1}))
    stated = load_generation_config(tmp_path)
    assert stated == GenerationConfig(eos_token_ids=(3,), temperature=0.7, top_p=0.9)
    assert load_generation_config(tmp_path / "absent") == GenerationConfig()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert load_generation_config(tmp_path).temperature == 0.0  # transformers decodes greedily then
    assert GenerationConfig(eos_token_ids=(1,), temperature=0.8).to_dict() == {
        "eos_token_id": 1, "do_sample": True, "temperature": 0.8}


def test_server_takes_the_stated_defaults_only():
    from serve.app import sampling_defaults
    from serve.engine.sampling_params import SamplingParams

    defaults = sampling_defaults(GenerationConfig(temperature=0.5, top_k=40))
    assert defaults == SamplingParams(temperature=0.5, top_k=40)
