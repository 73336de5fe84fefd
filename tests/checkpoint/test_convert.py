"""The conversion CLI: hub -> orbax -> hub on tiny transformers-written checkpoints, NVFP4 sources, sharded
restore on 8 simulated devices, and every bad input ending in a one-line error with no output left behind."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from inkling_jax import load_pretrained, preset
from inkling_jax.checkpoint import chunks, nvfp4, orbax_io
from inkling_jax.checkpoint.convert import build_parser, main, run
from inkling_jax.checkpoint.destination import MARKER
from inkling_jax.checkpoint.loading import abstract_model, hub_layout, model_variables, save_pretrained
from inkling_jax.checkpoint.safetensors_io import HubCheckpoint, SafetensorsFile, write_safetensors
from inkling_jax.generate import StepFunctions
from inkling_jax.parallel.mesh import make_mesh
from inkling_jax.parallel.rules import batch_sharding, param_shardings

# Slabs of 10 KB and chunks of 4 KB: every tensor of the tiny models streams in several slabs and chunks.
SMALL = ["--slab-mb", "0.01", "--chunk-mb", "0.004", "--workers", "3", "--quiet"]
TARGET = "model.llm.layers.2.attn.wk_dv.weight"


def convert(*args):
    return run(build_parser().parse_args([str(a) for a in args]))


def cli(capsys, *args):
    capsys.readouterr()  # drop what fixtures printed
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def params(model):
    return {path: np.asarray(var.get_value()) for path, var in model_variables(model).items()}


def token_ids(model, shape=(1, 8)):  # the shape --verify uses: eager ops compile once per shape
    return np.random.default_rng(0).integers(0, model.config.text.unpadded_vocab_size, shape).astype(np.int32)


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    src, _ = checkpoints("base")
    dst = tmp_path_factory.mktemp("converted") / "orbax"
    convert("--src", src, "--dst", dst, *SMALL)
    return src, dst


@pytest.fixture(scope="module")
def hub_model(checkpoints):
    return load_pretrained(checkpoints("base")[0], progress=False)


def test_converted_checkpoint_loads_like_the_hub_directory(converted, hub_model):
    src, dst = converted
    loaded = load_pretrained(dst)
    expected = params(hub_model)
    for path, value in params(loaded).items():
        np.testing.assert_array_equal(value, expected[path], err_msg=str(path))
    ids = token_ids(hub_model)
    forward = nnx.jit(lambda model, ids: model(ids))  # one compiled program for both (op by op: ~20 s on CPU)
    np.testing.assert_array_equal(np.asarray(forward(loaded, ids)), np.asarray(forward(hub_model, ids)))

    manifest = orbax_io.read_manifest(dst)
    assert manifest["num_params"] == len(expected) and manifest["dtype"] == "float32"
    shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    assert len(shards) > 1 and {f: manifest["source"]["files"][f]["sha256"] for f in shards} == {
        f: sha256(os.path.join(src, f)) for f in shards}
    for side in ("config.json", "generation_config.json"):
        assert sha256(dst / side) == sha256(os.path.join(src, side))
    # Host memory: slabs held never exceed the budget by more than one slab (which may exceed it alone).
    memory = manifest["memory"]
    assert memory["budget_bytes"] == 2 * 3 * int(0.01 * 2**20)
    assert 0 < memory["peak_held_bytes"] <= memory["budget_bytes"] + memory["largest_slab_bytes"]
    for key, entry in manifest["params"].items():
        assert math.prod(entry["chunks"]) * np.dtype(entry["dtype"]).itemsize <= 0.004 * 2**20, key
    assert max(len(e["chunk_crc32"]) for e in manifest["params"].values()) > 4


def test_round_trip_to_the_hub_layout_is_byte_exact(converted, tmp_path, capsys):
    src, dst = converted
    back = tmp_path / "hub"
    code, out, err = cli(capsys, "--src", dst, "--dst", back, "--to", "hf", "--verify", *SMALL)
    assert code == 0, err
    assert "byte-identical" in out and "logits on 8 tokens are identical" in out
    assert sorted(os.listdir(back)) == sorted(os.listdir(src) + [MARKER])
    for file in os.listdir(src):
        assert sha256(back / file) == sha256(os.path.join(src, file)), file


def test_single_file_checkpoint(checkpoints, hub_model, tmp_path, capsys):
    _, torch_model = checkpoints("base")
    params_of_hub = params(hub_model)
    single = tmp_path / "single"
    torch_model.save_pretrained(single, max_shard_size="1GB")
    assert "model.safetensors" in os.listdir(single) and not (single / "model.safetensors.index.json").exists()
    # Buffered reads here (the other tests read as the host's default says: O_DIRECT on a small host)
    code, _, err = cli(capsys, "--src", single, "--dst", tmp_path / "orbax", "--quiet", "--reads", "buffered")
    assert code == 0, err
    for path, value in params(load_pretrained(tmp_path / "orbax")).items():
        np.testing.assert_array_equal(value, params_of_hub[path], err_msg=str(path))
    code, _, err = cli(capsys, "--src", tmp_path / "orbax", "--dst", tmp_path / "back", "--to", "hf", "--quiet")
    assert code == 0, err
    assert sha256(tmp_path / "back" / "model.safetensors") == sha256(single / "model.safetensors")
    assert not (tmp_path / "back" / "model.safetensors.index.json").exists()


def test_bfloat16_source_stored_as_float32_round_trips(tmp_path):
    model = abstract_model(preset("tiny"), ml_dtypes.bfloat16)  # random numpy weights: no jax op compiles
    rng = np.random.default_rng(5)
    for var in model_variables(model).values():
        var.set_value(rng.standard_normal(var.get_value().shape).astype(var.get_value().dtype))
    save_pretrained(model, tmp_path / "hub", max_shard_bytes=60_000)
    convert("--src", tmp_path / "hub", "--dst", tmp_path / "orbax", "--dtype", "float32", *SMALL)
    manifest = orbax_io.read_manifest(tmp_path / "orbax")
    assert manifest["dtype"] == "float32" and "mtp.layers.1.block.mlp.w_up" in manifest["params"]
    assert {e["dtype"] for e in manifest["params"].values()} == {"float32"}
    loaded = load_pretrained(tmp_path / "orbax", "bfloat16")
    original = params(model)
    for path, value in params(loaded).items():
        np.testing.assert_array_equal(value, original[path], err_msg=str(path))
    convert("--src", tmp_path / "orbax", "--dst", tmp_path / "back", "--to", "hf", *SMALL)
    for file in os.listdir(tmp_path / "hub"):
        assert sha256(tmp_path / "back" / file) == sha256(tmp_path / "hub" / file), file


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_restore_on_8_devices(checkpoints, hub_model, tmp_path):
    spec = "fsdp=2,tensor=2,expert=2"
    convert("--src", checkpoints("base")[0], "--dst", tmp_path / "orbax", "--mesh", spec, "--quiet")
    mesh = make_mesh(spec)
    shardings = param_shardings(hub_model, mesh)
    for key, entry in orbax_io.read_manifest(tmp_path / "orbax")["params"].items():
        path = next(p for p in shardings if orbax_io.param_key(p) == key)
        shard = shardings[path].shard_shape(tuple(entry["shape"]))
        assert all(s % c == 0 for s, c in zip(shard, entry["chunks"])), key  # chunks never straddle shards
    model = load_pretrained(tmp_path / "orbax", mesh=mesh)
    experts = model.layers[1].mlp.w_gate[...]
    assert len(experts.sharding.device_set) == 8 and not experts.sharding.is_fully_replicated
    ids = token_ids(hub_model, (4, 16))
    reference = np.asarray(StepFunctions(hub_model).forward(ids))
    out = np.asarray(StepFunctions(model).forward(jax.device_put(ids, batch_sharding(mesh, ids.shape))))
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)


def test_nvfp4_source_is_dequantised(checkpoints, hub_model, tmp_path, capsys):
    src = tmp_path / "nvfp4"
    quantised = nvfp4.quantize_checkpoint(checkpoints("base")[0], str(src))
    assert sorted(quantised) == ["model.llm.layers.3.mlp.experts.w13_weight",
                                 "model.llm.layers.3.mlp.experts.w2_weight"]
    code, out, err = cli(capsys, "--src", src, "--dst", tmp_path / "orbax", "--verify", *SMALL)
    assert code == 0 and "NVFP4 experts dequantised" in out and "logits on 8 tokens are identical" in out, err
    assert "quantization_config" not in json.loads((tmp_path / "orbax" / "config.json").read_text())
    assert not (tmp_path / "orbax" / "hf_quant_config.json").exists()

    hub = HubCheckpoint(str(src))
    rules = hub_layout(hub_model.config)
    original, loaded = params(hub_model), params(load_pretrained(tmp_path / "orbax"))
    for name in quantised:
        parts = [np.asarray(hub.read(f"{name}{suffix}")) for suffix in ("", ".scale", ".scale2")]
        expected = rules[name].to_model(nvfp4.dequantize(*parts))
        weights = rules[name].hub_shape([original[t].shape for t in rules[name].targets])
        bound = rules[name].to_model(nvfp4.error_bound(rules[name].to_hub([original[t] for t in rules[name].targets]),
                                                       parts[2]))
        assert weights == parts[0].shape[:-1] + (2 * parts[0].shape[-1],)
        for target, value, limit in zip(rules[name].targets, expected, bound):
            np.testing.assert_array_equal(loaded[target], value)
            assert np.all(np.abs(loaded[target] - original[target]) <= limit * (1 + 1e-6))
    quantised_targets = {t for n in quantised for t in rules[n].targets}
    for path, value in loaded.items():
        if path not in quantised_targets:
            np.testing.assert_array_equal(value, original[path], err_msg=str(path))

    code, _, err = cli(capsys, "--src", tmp_path / "orbax", "--dst", tmp_path / "dense", "--to", "hf", "--quiet")
    assert code == 0, err
    for path, value in params(load_pretrained(tmp_path / "dense", progress=False)).items():
        np.testing.assert_array_equal(value, loaded[path], err_msg=str(path))


# ----------------------------------------------------------------------------------------------------------
# Bad input: one line naming the file and the tensor, exit code 1, nothing that looks like a checkpoint.


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def _shard_of(path, name):
    return _index(path)["weight_map"][name]


def _missing_shard(path):
    os.remove(path / _shard_of(path, TARGET))
    return [_shard_of(path, TARGET), "file not found", "tensor model.llm.layers.2.attn"]


def _truncated_file(path):
    with open(path / _shard_of(path, TARGET), "r+b") as fh:
        fh.truncate(os.path.getsize(path / _shard_of(path, TARGET)) - 100)
    return [_shard_of(path, TARGET), "truncated: tensor model.llm.layers.2."]


def _index_names_an_absent_tensor(path):
    index = _index(path)
    index["weight_map"]["model.llm.ghost.weight"] = _shard_of(path, TARGET)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["model.safetensors.index.json", "names tensor model.llm.ghost.weight", _shard_of(path, TARGET)]


def _config_disagrees_with_shapes(path):
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["num_key_value_heads"] = 2
    (path / "config.json").write_text(json.dumps(config))
    sconv = "model.llm.layers.2.attn.k_sconv.weight"  # the first tensor the 1-KV-head global layer shapes
    return [_shard_of(path, sconv), f"tensor {sconv} has shape [16, 1, 4], the config needs [32, 1, 4]"]


def _nvfp4_scale_missing(path):
    file = _shard_of(path, "model.llm.layers.3.mlp.experts.w2_weight")
    st = SafetensorsFile(str(path / file))
    tensors = {n: np.array(st.read(n)) for n in st.names}
    tensors["model.llm.layers.3.mlp.experts.w2_weight"] = np.zeros((8, 64, 16), np.uint8)
    write_safetensors(str(path / file), tensors)
    return [file, "tensor model.llm.layers.3.mlp.experts.w2_weight is uint8",
            "companion model.llm.layers.3.mlp.experts.w2_weight.scale is missing"]


@pytest.mark.parametrize("damage", [_missing_shard, _truncated_file, _index_names_an_absent_tensor,
                                    _config_disagrees_with_shapes, _nvfp4_scale_missing])
def test_bad_input(damage, checkpoints, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(checkpoints("base")[0], src)
    expected = damage(src)
    code, out, err = cli(capsys, "--src", src, "--dst", tmp_path / "out", "--quiet")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("inkling-convert: error: "), err
    for part in expected:
        assert part in err, (part, err)
    assert os.listdir(tmp_path) == ["src"]


@pytest.mark.parametrize("direction", ["orbax", "hf"])
def test_no_space_left(direction, converted, tmp_path, capsys, monkeypatch):
    src, done = converted
    full = OSError(28, "No space left on device")
    calls = {"n": 0}
    if direction == "orbax":
        write, module, name, source = chunks.write_region, chunks, "write_region", src
    else:
        write, module, name, source = os.pwrite, os, "pwrite", done

    def write_until_full(*args):
        calls["n"] += 1
        if calls["n"] > 5:
            raise full
        return write(*args)

    monkeypatch.setattr(module, name, write_until_full)
    code, out, err = cli(capsys, "--src", source, "--dst", tmp_path / "out", "--to", direction, *SMALL)
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert ("cannot write parameter" if direction == "orbax" else "cannot write tensor model.") in err
    assert "hub tensor model." in err or direction == "hf"
    assert os.listdir(tmp_path) == []


def test_not_enough_free_space_is_refused_up_front(converted, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=10**9, used=10**9 - 40_000, free=40_000))
    code, _, err = cli(capsys, "--src", converted[0], "--dst", tmp_path / "out", "--quiet")
    assert code == 1 and "not enough free space" in err and "would run out at tensor model." in err, err
    assert os.listdir(tmp_path) == []


def test_work_folders_of_killed_runs_are_removed(converted, tmp_path, capsys):
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = tmp_path / f".out.inkling-partial-{finished.pid}.0a1b"  # what a SIGKILLed run leaves behind
    alive = tmp_path / f".out.inkling-partial-{os.getppid()}.2c3d"  # a run still going: not ours to delete
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "partial").write_text("x")
    code, _, err = cli(capsys, "--src", converted[0], "--dst", tmp_path / "out", "--quiet")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, "out"])


def test_cli_help_and_exit_code(tmp_path):
    text = build_parser().format_help()
    for flag in ("--src", "--dst", "--to", "--dtype", "--mesh", "--overwrite", "--verify", "--workers",
                 "--readers", "--slab-mb", "--chunk-mb", "--max-shard-gb", "--quiet"):
        assert flag in text
    result = subprocess.run([sys.executable, "-m", "inkling_jax.checkpoint.convert", "--src", tmp_path / "absent",
                             "--dst", tmp_path / "out"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"{tmp_path / 'absent'}: not a directory" in result.stderr and not (tmp_path / "out").exists()
