"""Taking a checkpoint writer's destination: the output appears only at the end and only where nothing appeared
meanwhile, --overwrite replaces only an earlier output of inkling-convert, a destination overlapping the source is
refused, two writers of one destination give one success and one clear failure, and nothing the user had is ever
deleted. Most cases run `destination.taken` with a trivial writer; the rest run real conversions."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from inkling_jax.checkpoint import destination, orbax_io, to_hub, to_orbax
from inkling_jax.checkpoint.convert import main
from inkling_jax.checkpoint.destination import MARKER, DestinationError, taken

SMALL = ["--slab-mb", "0.01", "--chunk-mb", "0.004", "--workers", "3", "--quiet"]


@pytest.fixture(params=["renameat2", "plain rename"])
def rename_mode(request, monkeypatch):
    """Every case also runs where renameat2 is missing (other C libraries, file systems without its flags)."""
    if request.param == "plain rename":
        monkeypatch.setattr(destination, "_renameat2", None)
    return request.param


def write_output(dst, text="new", **kwargs):
    """A trivial writer: one file, with the converter's marker."""
    with taken(dst, marker={"direction": "test"}, **kwargs) as work:
        (open(os.path.join(work, "weights.bin"), "w")).write(text)


def _entry(path):
    if os.path.islink(path):
        return os.readlink(path)
    return None if os.path.isdir(path) else open(path, "rb").read()


def snapshot(path):
    """Everything at and under `path`: {relative path: file bytes, a link's target, or None for a directory}."""
    if not os.path.isdir(path) or os.path.islink(path):
        return {".": _entry(path)}
    return {os.path.relpath(os.path.join(root, name), path): _entry(os.path.join(root, name))
            for root, dirs, files in os.walk(path) for name in dirs + files}


def test_the_output_appears_only_at_the_end(tmp_path, rename_mode):
    dst = tmp_path / "out"
    with taken(dst, marker={"direction": "test"}) as work:
        assert not dst.exists() and os.path.dirname(work) == str(tmp_path) and os.listdir(work) == []
        (open(os.path.join(work, "weights.bin"), "w")).write("x")
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no lock, no work directory left
    assert sorted(os.listdir(dst)) == [MARKER, "weights.bin"]
    assert json.loads((dst / MARKER).read_text())["entries"] == ["weights.bin"]
    with pytest.raises(RuntimeError, match="writer failed"):
        with taken(tmp_path / "failed"):
            raise RuntimeError("writer failed")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _file_in_a_new_directory(dst):
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")


def _empty_directory(dst):
    dst.mkdir()


def _plain_file(dst):
    dst.write_text("mine")


def _symbolic_link(dst):
    (dst.parent / "elsewhere").mkdir()
    dst.symlink_to(dst.parent / "elsewhere")


@pytest.mark.parametrize("appear", [_file_in_a_new_directory, _empty_directory, _plain_file, _symbolic_link])
def test_what_appears_at_dst_during_the_run_is_kept(appear, tmp_path, rename_mode):
    dst = tmp_path / "out"
    with pytest.raises(DestinationError, match="appeared during the run; left as it is"):
        with taken(dst) as work:
            (open(os.path.join(work, "weights.bin"), "w")).write("new")
            appear(dst)
            before = snapshot(dst)
    assert snapshot(dst) == before
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]


def _user_directory(dst):
    _file_in_a_new_directory(dst)


def _earlier_output_plus_a_user_file(dst):
    write_output(dst, "old")
    (dst / "notes.txt").write_text("mine")


def _link_to_an_earlier_output(dst):
    write_output(dst.parent / "real", "old")
    dst.symlink_to(dst.parent / "real")


def _marker_of_another_format(dst):
    write_output(dst, "old")
    (dst / MARKER).write_text(json.dumps({"format": "something/else", "entries": ["weights.bin"]}))


@pytest.mark.parametrize("existing, reason", [
    (_user_directory, f"has no {MARKER} of ours"), (_plain_file, "is a file"),
    (_link_to_an_earlier_output, "is a symbolic link"), (_earlier_output_plus_a_user_file, "holds notes.txt"),
    (_marker_of_another_format, f"has no {MARKER} of ours")])
def test_overwrite_replaces_only_an_earlier_output(existing, reason, tmp_path, rename_mode):
    dst = tmp_path / "out"
    existing(dst)
    before = snapshot(dst)
    with pytest.raises(DestinationError, match=f"--overwrite replaces only an earlier output .* {reason}"):
        write_output(dst, overwrite=True)
    assert snapshot(dst) == before
    with pytest.raises(DestinationError, match="already exists"):
        write_output(dst)
    assert snapshot(dst) == before


def test_overwrite_swaps_an_earlier_output_out(tmp_path, rename_mode):
    dst = tmp_path / "out"
    write_output(dst, "old")
    write_output(dst, "new", overwrite=True)
    assert (dst / "weights.bin").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["out"]
    # what was at dst is checked again after the swap: a user's directory put there meanwhile is swapped back
    with pytest.raises(DestinationError, match="changed during the run and now has no"):
        with taken(dst, overwrite=True, marker={"direction": "test"}) as work:
            (open(os.path.join(work, "weights.bin"), "w")).write("newer")
            os.rename(dst, tmp_path / "moved-away")
            _file_in_a_new_directory(dst)
    assert snapshot(dst) == {"notes.txt": b"mine"}
    assert (tmp_path / "moved-away" / "weights.bin").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["moved-away", "out"]


@pytest.mark.parametrize("dst, how", [("models/hub", "is"), ("models/hub/orbax", "lies inside"),
                                      ("models", "contains"), ("link/hub/orbax", "lies inside"), ("to-hub", "is")])
def test_a_destination_overlapping_the_source_is_refused(dst, how, tmp_path):
    src = tmp_path / "models" / "hub"
    src.mkdir(parents=True)
    (src / "model.safetensors").write_text("weights")
    (tmp_path / "link").symlink_to(tmp_path / "models")
    (tmp_path / "to-hub").symlink_to(src)
    before = snapshot(tmp_path)
    with pytest.raises(DestinationError, match=re.escape(f"the destination {how} the source {src};")):
        write_output(tmp_path / dst, src=src, overwrite=True)
    assert snapshot(tmp_path) == before


def test_a_second_writer_of_one_destination_fails_at_once(tmp_path):
    (tmp_path / "same").symlink_to(tmp_path)
    with taken(tmp_path / "out") as work:
        for spelling in (tmp_path / "out", tmp_path / "same" / "out", f"{tmp_path}/./x/../out"):
            with pytest.raises(DestinationError, match=re.escape(f"{tmp_path / 'out'}: another process (process "
                                                                 f"{os.getpid()}) is writing it")):
                write_output(spelling)
        (open(os.path.join(work, "weights.bin"), "w")).write("first")
    assert (tmp_path / "out" / "weights.bin").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["out", "same"]


# ----------------------------------------------------------------------------------------------------------
# Real conversions.


def cli(capsys, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_two_conversions_to_one_destination_at_once(checkpoints, tmp_path):
    src, _ = checkpoints("base")
    command = [sys.executable, "-m", "inkling_jax.checkpoint.convert", "--src", src, "--dst", str(tmp_path / "out"),
               *SMALL]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = sorted((run.returncode, err) for run in runs for _, err in [run.communicate(timeout=600)])
    assert [code for code, _ in results] == [0, 1], results
    err = results[1][1]
    assert err.count("\n") == 1 and err.startswith(f"inkling-convert: error: {tmp_path / 'out'}: "), err
    assert "another process (process " in err or "already exists" in err, err
    assert orbax_io.is_converted(tmp_path / "out") and sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("direction", ["orbax", "hf"])
def test_a_file_created_in_dst_during_a_conversion_survives(direction, checkpoints, tmp_path, capsys, monkeypatch):
    src = checkpoints("base")[0]
    if direction == "hf":
        assert cli(capsys, "--src", src, "--dst", tmp_path / "orbax", "--quiet")[0] == 0
        src = tmp_path / "orbax"
    dst = tmp_path / "out"
    module, name = (to_orbax, "convert") if direction == "orbax" else (to_hub, "export")
    write = getattr(module, name)

    def write_then_meddle(*args, **kwargs):
        result = write(*args, **kwargs)
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
        return result

    monkeypatch.setattr(module, name, write_then_meddle)
    code, out, err = cli(capsys, "--src", src, "--dst", dst, "--to", direction, "--quiet")
    assert code == 1 and out == "" and err.count("\n") == 1 and f"{dst}: appeared during the run" in err, err
    assert snapshot(dst) == {"notes.txt": b"mine"}
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]


def test_overwrite_of_an_earlier_conversion_and_of_what_is_not_one(checkpoints, tmp_path, capsys):
    src = tmp_path / "models" / "hub"
    shutil.copytree(checkpoints("base")[0], src)
    source = snapshot(src)
    dst = tmp_path / "out"
    assert cli(capsys, "--src", src, "--dst", dst, "--dtype", "float32", "--quiet")[0] == 0
    code, _, err = cli(capsys, "--src", src, "--dst", dst, "--dtype", "bfloat16", "--overwrite", "--quiet")
    assert code == 0, err
    assert orbax_io.read_manifest(dst)["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["models", "out"]
    # --overwrite never takes the source or its parent, nor another hub checkpoint
    for target in (src, src.parent, tmp_path):
        code, _, err = cli(capsys, "--src", src, "--dst", target, "--overwrite", "--quiet")
        assert code == 1 and "the source" in err, err
    other = tmp_path / "other-hub"
    shutil.copytree(src, other)
    code, _, err = cli(capsys, "--src", dst, "--dst", other, "--to", "hf", "--overwrite", "--quiet")
    assert code == 1 and f"has no {MARKER} of ours" in err, err
    assert snapshot(src) == source and snapshot(other) == source
