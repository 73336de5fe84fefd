"""Integrity: safetensors headers are checked at least as strictly as the reference reader (the `safetensors`
package) checks them, and a converted checkpoint's recorded chunk checksums are checked when it is loaded,
verified or exported, so damaged bytes are a `CheckpointError` naming the file and the tensor, never a silently
wrong model."""

import json
import os
import re
import shutil
import struct

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import load_file

from inkling_jax import CheckpointError, load_pretrained
from inkling_jax.checkpoint import orbax_io
from inkling_jax.checkpoint.convert import build_parser, main, run
from inkling_jax.checkpoint.safetensors_io import SafetensorsFile
from inkling_jax.checkpoint.verify import VerificationError, verify_orbax

F32 = np.arange(6, dtype=np.float32)


def raw_file(path, header=None, data=F32.tobytes(), text=None):
    """A safetensors file from a header dict (or its exact JSON text) and data bytes."""
    blob = text if text is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def entry(begin, end, shape=None, dtype="F32"):
    return {"dtype": dtype, "shape": [(end - begin) // 4] if shape is None else shape, "data_offsets": [begin, end]}


# Headers the reference reader rejects: (header or raw JSON text, data, what our error says, the tensor it names).
REJECTED = {
    "overlapping tensors": ({"a": entry(0, 16), "b": entry(8, 24)}, "b at data bytes 8..24 overlaps tensor a", "b"),
    "a tensor inside another": ({"a": entry(0, 24), "b": entry(4, 8)}, "overlaps tensor", "b"),
    "two tensors on the same bytes": ({"a": entry(0, 24), "b": entry(0, 24)}, "overlaps tensor a", "b"),
    "a gap between tensors": ({"a": entry(0, 8), "b": entry(12, 24)}, "leaves bytes 8..12 unused", "b"),
    "data not starting at byte 0": ({"a": entry(4, 24)}, "leaves bytes 0..4 unused", "a"),
    "bytes after the last tensor": ({"a": entry(0, 16)}, "8 bytes follow the last tensor's data", None),
    "a tensor past the end of the file": ({"a": entry(0, 32)}, "truncated: tensor a ends at byte", "a"),
    "end before begin": ({"a": {"dtype": "F32", "shape": [0], "data_offsets": [24, 0]}}, "not \\[begin, end\\]",
                         "a"),
    "three offsets": ({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24, 24]}}, "not \\[begin, end\\]", "a"),
    "offsets as strings": ({"a": {"dtype": "F32", "shape": [6], "data_offsets": ["0", "24"]}}, "not \\[begin", "a"),
    "offsets as floats": ({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24.0]}}, "not \\[begin", "a"),
    "shape and bytes disagree": ({"a": entry(0, 24, shape=[5])}, "spans 24 bytes, its shape needs 20", "a"),
    "shape and dtype disagree": ({"a": entry(0, 24, dtype="F16")}, "spans 24 bytes, its shape needs 12", "a"),
    "negative dimension": ({"a": entry(0, 24, shape=[-6])}, "not a list of non-negative integers", "a"),
    "boolean dimension": ({"a": entry(0, 24, shape=[True, 6])}, "not a list of non-negative integers", "a"),
    "fractional dimension": ({"a": entry(0, 24, shape=[6.0])}, "not a list of non-negative integers", "a"),
    "unknown dtype": ({"a": entry(0, 24, dtype="F33")}, "unsupported dtype 'F33'", "a"),
    "no dtype": ({"a": {"shape": [6], "data_offsets": [0, 24]}}, "unsupported dtype None", "a"),
    "an entry that is not an object": ({"a": [0, 24]}, "header entry .* is not an object", "a"),
    "a header that is a list": (b"[]", "a JSON list, not an object", None),
    "non-string metadata": ({"__metadata__": {"format": 1}, "a": entry(0, 24)}, "does not map names to strings", None),
    "bytes after the JSON": (b'{"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}} x', "corrupt", None),
    "a header that is not UTF-8": (b'{"a\xff": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}',
                                   "not UTF-8", None),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_headers_the_reference_rejects_are_rejected(case, tmp_path):
    header, message, tensor = REJECTED[case]
    path = raw_file(tmp_path / "bad.safetensors", **({"text": header} if isinstance(header, bytes) else
                                                      {"header": header}))
    with pytest.raises(SafetensorError):
        load_file(path)
    with pytest.raises(CheckpointError, match=message) as error:
        SafetensorsFile(path)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)
    if tensor is not None:
        assert f"tensor {tensor}" in str(error.value)


@pytest.mark.parametrize("prefix, message", [
    (b"", "truncated \\(no safetensors header\\)"), (b"\x05\x00", "truncated \\(no safetensors header\\)"),
    (struct.pack("<Q", 10**9), "header length 1000000000 is over the safetensors limit"),
    (struct.pack("<Q", 4096) + b"{}", "truncated \\(header")])
def test_files_too_short_for_their_header(prefix, message, tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(prefix)
    with pytest.raises(SafetensorError):
        load_file(path)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path))}: {message}"):
        SafetensorsFile(path)


ACCEPTED = {  # headers the reference reads, and so must we
    "two tensors": {"a": entry(0, 16), "b": entry(16, 24)},
    "tensors listed out of order": {"b": entry(16, 24), "a": entry(0, 16)},
    "a scalar": {"s": entry(0, 4, shape=[]), "a": entry(4, 24)},
    "an empty tensor sharing its offset": {"z": entry(0, 0, shape=[0, 3]), "a": entry(0, 24)},
    "metadata null": {"__metadata__": None, "a": entry(0, 24)},
    "metadata": {"__metadata__": {"format": "pt"}, "a": entry(0, 24)},
    "an extra field in an entry": {"a": dict(entry(0, 24), extra=1)},
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_headers_the_reference_accepts_read_the_same(case, tmp_path):
    path = raw_file(tmp_path / "good.safetensors", ACCEPTED[case])
    reference, ours = load_file(path), SafetensorsFile(path)
    assert sorted(ours.names) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(ours.read(name), value)
    padded = raw_file(tmp_path / "padded.safetensors", text=json.dumps(ACCEPTED[case]).encode() + b"    ")
    assert sorted(SafetensorsFile(padded).names) == sorted(load_file(padded))


def test_a_tensor_listed_twice_is_rejected(tmp_path):
    """The reference keeps the last of two entries of one name; which bytes are the tensor is then ambiguous."""
    text = b'{"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}, "a": {"dtype": "F32", "shape": [6], ' \
           b'"data_offsets": [0, 24]}}'
    with pytest.raises(CheckpointError, match="key 'a' appears twice"):
        SafetensorsFile(raw_file(tmp_path / "twice.safetensors", text=text))


# ----------------------------------------------------------------------------------------------------------
# A hub checkpoint whose shard has overlapping offsets: the issue's example, which loaded a silently wrong model.

def _point_at_neighbour(path):
    """Rewrite a shard so that one tensor reads the bytes of another of its dtype and shape (its own bytes are
    then a gap); returns (file, tensor)."""
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        data = (path / file).read_bytes()
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + size])
        header.pop("__metadata__", None)
        kinds = {}
        for name in sorted(header, key=lambda n: header[n]["data_offsets"]):
            kinds.setdefault((header[name]["dtype"], str(header[name]["shape"])), []).append(name)
        twins = next((names for names in kinds.values() if len(names) > 1), None)
        if twins:
            header[twins[1]]["data_offsets"] = header[twins[0]]["data_offsets"]
            raw_file(path / file, header, data=data[8 + size:])
            return file, twins[1]
    raise AssertionError("no shard holds two tensors of one shape")


def test_an_overlapping_shard_is_refused_by_load_and_convert(checkpoints, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(checkpoints("base")[0], src)
    file, tensor = _point_at_neighbour(src)
    with pytest.raises(SafetensorError):
        load_file(src / file)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(src / file))}: tensor {tensor} at data bytes .* "
                                              f"overlaps tensor"):
        load_pretrained(src, progress=False)
    capsys.readouterr()  # drop what fixtures printed
    code = main(["--src", str(src), "--dst", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and f"{src / file}: tensor {tensor} at data bytes" in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]


# ----------------------------------------------------------------------------------------------------------
# The chunk checksums of a converted checkpoint.

@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    src, _ = checkpoints("base")
    dst = tmp_path_factory.mktemp("converted") / "orbax"
    run(build_parser().parse_args(["--src", src, "--dst", str(dst), "--chunk-mb", "0.004", "--quiet"]))
    return src, dst


def _chunk(directory, key, which=1):
    files = sorted(f for f in os.listdir(directory / "params" / key) if not f.startswith("."))
    return directory / "params" / key / files[which % len(files)]


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return "has checksum [0-9a-f]{8}, [0-9a-f]{8} was written: the file is damaged"


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:-4])
    return "bytes, but a chunk of parameter .* has"


def _one_byte_more(path):
    path.write_bytes(path.read_bytes() + b"\0")
    return "bytes, but a chunk of parameter .* has"


def _deleted(path):
    os.remove(path)  # tensorstore would read the zarr fill value (zeros) in its place
    return "chunk file of parameter .* is missing"


def _swapped_with_its_neighbour(path):
    files = sorted(p for p in path.parent.iterdir() if not p.name.startswith("."))
    other = files[files.index(path) + 1]
    a, b = path.read_bytes(), other.read_bytes()
    path.write_bytes(b)
    other.write_bytes(a)
    return "has checksum"


@pytest.mark.parametrize("damage, key", [  # experts (3-D), the embedding, a kernel, a norm (a single chunk)
    (_flip_a_byte, "layers.1.mlp.w_down"), (_flip_a_byte, "norm.weight"), (_cut_short, "embed"),
    (_one_byte_more, "layers.0.attn.wq.kernel"), (_deleted, "layers.1.mlp.w_down"),
    (_swapped_with_its_neighbour, "embed")])
def test_a_damaged_chunk_is_an_error_on_load(damage, key, converted, tmp_path):
    _, done = converted
    copy = tmp_path / "copy"
    shutil.copytree(done, copy)
    chunk = _chunk(copy, key)
    message = damage(chunk)
    with pytest.raises(CheckpointError, match=re.escape(f"{chunk}: ") + ".*" + message) as error:
        load_pretrained(copy, progress=False)
    assert f"parameter {key}" in str(error.value) and "\n" not in str(error.value)


def test_checksums_can_be_skipped_and_verify_and_export_check_them(converted, tmp_path, capsys):
    src, done = converted
    copy = tmp_path / "copy"
    shutil.copytree(done, copy)
    chunk = _chunk(copy, "layers.1.mlp.w_down")
    intact = load_pretrained(copy, progress=False)
    _flip_a_byte(chunk)
    damaged = load_pretrained(copy, progress=False, verify_checksums=False)  # what loading did before
    assert not np.array_equal(np.asarray(damaged.layers[1].mlp.w_down[...]),
                              np.asarray(intact.layers[1].mlp.w_down[...]))
    with pytest.raises(VerificationError, match=re.escape(f"{chunk}: chunk of parameter layers.1.mlp.w_down")):
        verify_orbax(str(copy), src)
    capsys.readouterr()
    code = main(["--src", str(copy), "--dst", str(tmp_path / "hub"), "--to", "hf", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and f"{chunk}: chunk of parameter layers.1.mlp.w_down has checksum" in err, err
    assert sorted(os.listdir(tmp_path)) == ["copy"]


def test_only_the_chunks_a_process_holds_are_read(converted, monkeypatch):
    """The check reads what the restore reads: here one device holds everything, so every chunk once."""
    _, done = converted
    manifest = orbax_io.read_manifest(done)
    seen = []
    read = orbax_io.check_chunks

    def counting(arrays, held=None):
        seen.extend((a.name, where) for a in arrays for where in held[a.name])
        return read(arrays, held)

    monkeypatch.setattr(orbax_io, "check_chunks", counting)
    load_pretrained(done, progress=False)
    assert len(seen) == len(set(seen)) == sum(len(e["chunk_crc32"]) for e in manifest["params"].values())


# ----------------------------------------------------------------------------------------------------------
# A malformed manifest: one line naming the manifest and the field, from loading and from `--to hf`.

def _param(manifest):
    return manifest["params"]["layers.1.mlp.w_down"]


MANIFESTS = {
    "not JSON": (lambda m: "{not json", "cannot read the manifest \\(Expecting"),
    "a JSON list": (lambda m: "[]", "format 'a JSON list', expected"),
    "an older format": (lambda m: dict(m, format="inkling-jax/orbax-params/1"),
                        "format 'inkling-jax/orbax-params/1', expected .* \\(convert the source again\\)"),
    "no params": (lambda m: {k: v for k, v in m.items() if k != "params"},
                  "field params is None, expected an object"),
    "a shape of text": (lambda m: _param(m).update(shape="64") or m,
                        "field params.layers.1.mlp.w_down.shape is '64', expected a list of sizes"),
    "a checksum short": (lambda m: _param(m).update(chunk_crc32=_param(m)["chunk_crc32"][1:]) or m,
                         "field params.layers.1.mlp.w_down.chunk_crc32 is .*, expected a list of \\d+ checksums"),
    "an integer dtype": (lambda m: _param(m).update(dtype="int8") or m,
                         "field params.layers.1.mlp.w_down.dtype is 'int8', expected bfloat16 or float32"),
    "chunks of zero": (lambda m: _param(m).update(chunks=[0, 1, 1]) or m,
                       "field params.layers.1.mlp.w_down.chunks is \\[0, 1, 1\\], expected a chunk size per axis"),
    "no layout": (lambda m: m["source"].pop("layout") and m, "field source.layout is None, expected an object"),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_malformed_manifest(case, converted, tmp_path, capsys):
    _, done = converted
    copy = tmp_path / "copy"
    shutil.copytree(done, copy)
    change, message = MANIFESTS[case]
    changed = change(json.loads((copy / orbax_io.MANIFEST).read_text()))
    (copy / orbax_io.MANIFEST).write_text(changed if isinstance(changed, str) else json.dumps(changed))
    expected = re.escape(f"{copy / orbax_io.MANIFEST}: ") + message
    with pytest.raises(CheckpointError, match=expected) as error:
        load_pretrained(copy, progress=False)
    assert "\n" not in str(error.value)
    capsys.readouterr()
    assert main(["--src", str(copy), "--dst", str(tmp_path / "hub"), "--to", "hf", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(expected, err), err
    assert sorted(os.listdir(tmp_path)) == ["copy"]
