"""Strict loading: every way a checkpoint can be wrong gives an error that names the tensor and the file."""

import json
import os
import shutil

import numpy as np
import pytest

from inkling_jax import CheckpointError, ConfigError, load_pretrained
from inkling_jax.checkpoint import nvfp4
from inkling_jax.checkpoint.convert import main
from inkling_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors

TARGET = "model.llm.layers.1.attn.wq_du.weight"


@pytest.fixture
def copy(checkpoints, tmp_path):
    source, _ = checkpoints("base")
    dst = tmp_path / "ckpt"
    shutil.copytree(source, dst)
    return dst


def _index(path):
    with open(path / "model.safetensors.index.json") as fh:
        return json.load(fh)


def _rewrite(path, file, change):
    """Rewrite one shard with `change(tensors)` applied, and the index to match."""
    st = SafetensorsFile(path / file)
    tensors = {n: np.array(st.read(n)) for n in st.names}
    change(tensors)
    write_safetensors(str(path / file), tensors)
    index = _index(path)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file}
    index["weight_map"].update({n: file for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_of(path, name):
    return _index(path)["weight_map"][name]


def test_missing_tensor(copy):
    _rewrite(copy, _shard_of(copy, TARGET), lambda t: t.pop(TARGET))
    with pytest.raises(CheckpointError, match=f"missing tensor {TARGET}"):
        load_pretrained(copy, progress=False)


def test_unexpected_tensor(copy):
    file = _shard_of(copy, TARGET)
    _rewrite(copy, file, lambda t: t.update({"model.llm.layers.9.attn.wq_du.weight": np.ones((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=f"{file}: unexpected tensor model.llm.layers.9.attn.wq_du.weight"):
        load_pretrained(copy, progress=False)


def test_misshaped_tensor(copy):
    file = _shard_of(copy, TARGET)
    _rewrite(copy, file, lambda t: t.update({TARGET: t[TARGET][:-1]}))
    with pytest.raises(CheckpointError, match=f"{file}: tensor {TARGET} has shape \\[63, 64\\]"):
        load_pretrained(copy, progress=False)


def test_truncated_shard(copy):
    file = copy / _shard_of(copy, TARGET)
    size = os.path.getsize(file)
    with open(file, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match="truncated: tensor .* ends at byte"):
        load_pretrained(copy, progress=False)


def test_index_names_an_absent_tensor(copy):
    index = _index(copy)
    index["weight_map"]["model.llm.ghost.weight"] = _shard_of(copy, TARGET)
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names tensor model.llm.ghost.weight"):
        load_pretrained(copy, progress=False)


def test_config_that_disagrees_with_the_weights(copy):
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["num_key_value_heads"] = 2  # the checkpoint has 1 KV head on global layers
    (copy / "config.json").write_text(json.dumps(config))
    # layer 2 is the global layer: its K projection and K conv are half the size the config now asks for
    with pytest.raises(CheckpointError, match="tensor model.llm.layers.2.attn.\\w+.weight has shape \\[16, "):
        load_pretrained(copy, progress=False)
    config["text_config"]["num_hidden_layers"] = 5
    config["text_config"]["layer_types"].append("hybrid_sliding")
    config["text_config"]["local_layer_ids"].append(4)
    config["text_config"]["mlp_layer_types"].append("sparse")
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing tensor model.llm.layers.4"):
        load_pretrained(copy, progress=False)


def test_missing_shard_file(copy):
    os.remove(copy / _shard_of(copy, TARGET))
    with pytest.raises(CheckpointError, match="file not found"):
        load_pretrained(copy, progress=False)


# ----------------------------------------------------------------------------------------------------------
# Unclear errors made clear: one line naming the file and the tensor, whoever reads the checkpoint.

EMBED = "model.llm.embed.weight"


def _one_line(error, *parts):
    text = str(error.value)
    assert "\n" not in text, text
    for part in parts:
        assert str(part) in text, (part, text)


@pytest.mark.parametrize("tensor", [TARGET, EMBED])
def test_a_tensor_missing_from_shard_and_index(tensor, copy, capsys):
    """The converter read the embedding's dtype before checking names: a KeyError."""
    _rewrite(copy, _shard_of(copy, tensor), lambda t: t.pop(tensor))
    with pytest.raises(CheckpointError) as error:
        load_pretrained(copy, progress=False)
    _one_line(error, copy, f"missing tensor {tensor}")
    capsys.readouterr()
    assert main(["--src", str(copy), "--dst", str(copy.parent / "out"), "--quiet"]) == 1
    assert f"{copy}: missing tensor {tensor}" in capsys.readouterr().err
    assert not (copy.parent / "out").exists()


def _index_not_json(path, index):
    return "{not json", ["not a safetensors index"]


def _index_a_list(path, index):
    return "[]", ["not a safetensors index (no weight_map object)"]


def _weight_map_a_list(path, index):
    return json.dumps({"weight_map": list(index["weight_map"])}), ["no weight_map object"]


def _file_outside_the_directory(path, index):
    index["weight_map"][TARGET] = "../" + index["weight_map"][TARGET]
    return json.dumps(index), [f"puts tensor {TARGET} in '../", "not a file name"]


def _absolute_file(path, index):
    index["weight_map"][TARGET] = "/etc/passwd"
    return json.dumps(index), [f"puts tensor {TARGET} in '/etc/passwd'"]


def _file_not_a_string(path, index):
    index["weight_map"][TARGET] = 5
    return json.dumps(index), [f"puts tensor {TARGET} in 5"]


def _tensor_left_out(path, index):
    file = index["weight_map"].pop(TARGET)
    return json.dumps(index), [f"{path / file}: holds tensor {TARGET}, which the index does not list there"]


def _file_a_directory(path, index):
    (path / "shards").mkdir()
    index["weight_map"][TARGET] = "shards"
    return json.dumps(index), [f"{path / 'shards'}: a directory, where a safetensors file was expected"]


@pytest.mark.parametrize("damage", [_index_not_json, _index_a_list, _weight_map_a_list, _file_outside_the_directory,
                                    _absolute_file, _file_not_a_string, _tensor_left_out, _file_a_directory])
def test_a_bad_index(damage, copy):
    text, parts = damage(copy, _index(copy))
    (copy / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError) as error:
        load_pretrained(copy, progress=False)
    _one_line(error, *parts)


def test_paths_of_the_wrong_kind(copy, tmp_path):
    shard = copy / _shard_of(copy, TARGET)
    with pytest.raises(ConfigError) as error:  # was a UnicodeDecodeError
        load_pretrained(shard, progress=False)
    _one_line(error, shard, "binary data, not a JSON config (pass the model directory")
    with pytest.raises(CheckpointError) as error:
        load_pretrained(copy / "config.json", progress=False)
    _one_line(error, copy / "config.json", "not a directory (a model directory is expected")
    with pytest.raises(ConfigError) as error:
        load_pretrained(tmp_path / "absent", progress=False)
    _one_line(error, tmp_path / "absent", "not found")
    os.remove(copy / "config.json")
    (copy / "config.json").mkdir()
    with pytest.raises(ConfigError) as error:
        load_pretrained(copy, progress=False)
    _one_line(error, copy / "config.json", "cannot read (Is a directory)")


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])  # uint8 reads as packed NVFP4
def test_a_tensor_of_a_non_float_dtype(dtype, copy, capsys):
    """Values that cast silently to floats, but are no weights."""
    file = _shard_of(copy, TARGET)
    _rewrite(copy, file, lambda t: t.update({TARGET: np.ones(t[TARGET].shape, dtype)}))
    expected = f"{copy / file}: tensor {TARGET} is {np.dtype(dtype)}, not a float type"
    with pytest.raises(CheckpointError) as error:
        load_pretrained(copy, progress=False)
    _one_line(error, expected)
    capsys.readouterr()
    assert main(["--src", str(copy), "--dst", str(copy.parent / "out"), "--quiet"]) == 1
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"quantization": [1]}'])
def test_a_bad_quantisation_config(text, checkpoints, tmp_path):
    src = tmp_path / "nvfp4"
    nvfp4.quantize_checkpoint(checkpoints("base")[0], str(src))
    (src / "hf_quant_config.json").write_text(text)
    with pytest.raises(CheckpointError) as error:
        load_pretrained(src, progress=False)
    _one_line(error, src / "hf_quant_config.json")
