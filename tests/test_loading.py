"""Strict loading: every way a checkpoint can be wrong gives an error that names the tensor and the file."""

import json
import os
import shutil

import numpy as np
import pytest

from inkling_jax import CheckpointError, load_pretrained
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
