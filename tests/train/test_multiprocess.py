"""`python -m train.run` as one job of two processes on 127.0.0.1, 4 simulated CPU devices each, one 8-device
mesh (fsdp=2 across the processes, tensor=2 and expert=2 within each): its losses equal this (single-process,
8-device) process's run of the same command; a process that dies stops the other with an error naming it, within
a few heartbeat timeouts, whether it is the coordinator or not; the job restarted from its last checkpoint
continues exactly. Two launches in all, each combining checks, since every one starts JAX and compiles the step
twice over (one per process) on CI's two cores: the first loses process 1 a step past its checkpoint, the second
resumes from it and loses process 0, the coordinator, once past the steps compared.

Between processes the all-reduces run through Gloo, which sums the devices' partial results in another order
than one process's CPU collectives: the job's losses match the single process's to float32 rounding (a relative
1e-5; they differ from step 1 by about 1e-7), and the resumed job's match the interrupted job's exactly. (A job
that ends by itself exits 0 in every process: tests/train/test_rl_mesh.py's two-process job.)
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from train.run import main

pytestmark = pytest.mark.heavy  # see conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT = 10  # seconds: how long a dead process goes unnoticed (5 was once missed by both live processes
# while CI's two cores compiled the heavy files: the coordinator then ended the job)
SAVE_EVERY = 4
MESH = "fsdp=2,tensor=2,expert=2"
COMMON = ["--preset", "tiny", "--layers", "3", "--steps", "50", "--seq-len", "32", "--batch", "8", "--lr", "1e-2",
          "--warmup", "2", "--save-every", str(SAVE_EVERY), "--fast-compile", "--bias-update-rate", "1e-3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    sentences = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.",
                 "How vexingly quick daft zebras jump!", "Sphinx of black quartz, judge my vow."]
    path.write_text("\n\n".join(sentences * 6))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(module: str, out, args: list[str]) -> list[subprocess.Popen]:
    """Both processes of a job of `python -m module *args`, with this process's XLA flags but 4 devices each;
    process i logs to `{out}.{i}.log`."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4"}
    port = free_port()
    procs = []
    for i in range(2):
        joined = [*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                  "--heartbeat-timeout", str(HEARTBEAT)]
        log = open(f"{out}.{i}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", module, *joined], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def launch(out, data, mesh, *extra) -> list[subprocess.Popen]:
    return spawn("train.run", out, [*COMMON, "--data", str(data), "--out", str(out), "--mesh", mesh,
                                    "--no-tensorboard", *extra])


def rows(out) -> list[dict]:
    """The complete lines of metrics.jsonl so far (a process may be writing the next one)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh.read().split("\n")[:-1]]


def losses(out) -> dict[int, float]:
    """The loss last written for each step (a resumed run writes again the steps after its checkpoint)."""
    return {row["step"]: row["loss"] for row in rows(out)}


def wait_for(condition, procs, what, timeout=240.0) -> None:
    """Poll until `condition()`; fail with the processes' logs if one exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def finish(procs, timeout=240.0) -> list[int]:
    """The exit codes, each process given `timeout` seconds (then killed: a hang fails the test, not CI)."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    return codes


def log_of(out, i) -> str:
    with open(f"{out}.{i}.log") as fh:
        return fh.read()


def reference(tmp_path, data, mesh, stop_at) -> dict[int, float]:
    """The same run in this process, on its 8 devices."""
    out = tmp_path / f"reference-{mesh}"
    main([*COMMON, "--data", str(data), "--out", str(out), "--mesh", mesh, "--no-tensorboard",
          "--stop-at", str(stop_at)])
    return losses(out)


def assert_dead_peer_stops(procs, out, dead, survivor, began):
    """The survivor exits non-zero within a few heartbeats of the kill, saying why: the coordination service
    names the task that stopped (or, when the coordinator's socket closes first, ends the process saying that
    another task died), or a collective fails first and `train.distributed` says what that means."""
    code = finish([procs[survivor]], timeout=6 * HEARTBEAT + 30)[0]
    assert code not in (0, None), (code, log_of(out, survivor)[-3000:])
    assert time.monotonic() - began < 6 * HEARTBEAT + 30
    text = log_of(out, survivor)
    assert ("stopped sending heartbeats" in text or "another task died" in text
            or f"process {survivor} of 2 stopped" in text and "another process of the job may have died" in text), \
        text[-3000:]
    procs[dead].wait(30)


def assert_close(got: dict, expected: dict) -> None:
    assert got and set(got) <= set(expected), (sorted(got), sorted(expected))
    assert [got[s] for s in sorted(got)] == pytest.approx([expected[s] for s in sorted(got)], rel=1e-5, abs=0)


def test_a_job_equals_one_process_survives_either_death_and_resumes_exactly(tmp_path, corpus):
    stop = 2 * SAVE_EVERY
    expected = reference(tmp_path, corpus, MESH, stop)
    assert sorted(expected) == list(range(1, stop + 1))
    out = tmp_path / "job"

    procs = launch(out, corpus, MESH)
    # A step past checkpoint SAVE_EVERY (committed), SAVE_EVERY - 1 steps before the next: the resumed job redoes it.
    wait_for(lambda: len(rows(out)) > SAVE_EVERY and os.path.isdir(out / "checkpoints" / str(SAVE_EVERY)), procs,
             f"step {SAVE_EVERY + 1} and checkpoint {SAVE_EVERY}")
    procs[1].send_signal(signal.SIGKILL)
    assert_dead_peer_stops(procs, out, dead=1, survivor=0, began=time.monotonic())
    interrupted = losses(out)
    assert_close(interrupted, expected)
    saved = max(int(d) for d in os.listdir(out / "checkpoints") if d.isdigit())
    assert saved == SAVE_EVERY < max(interrupted) < stop

    written = len(rows(out))
    procs = launch(out, corpus, MESH)
    wait_for(lambda: len(rows(out)) >= written + stop - saved, procs, f"steps {saved + 1} to {stop} resumed")
    procs[0].send_signal(signal.SIGKILL)
    assert_dead_peer_stops(procs, out, dead=0, survivor=1, began=time.monotonic())
    resumed = losses(out)
    assert_close({s: resumed[s] for s in expected}, expected)
    assert all(resumed[s] == interrupted[s] for s in interrupted)
    steps = [row["step"] for row in rows(out)]
    assert steps[written:] == list(range(saved + 1, max(steps) + 1))  # written once, by process 0 alone
    assert "resuming from checkpoint" in log_of(out, 0) and "resuming from checkpoint" not in log_of(out, 1)
