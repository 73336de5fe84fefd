"""When `train.run` joins other processes, and which flags it refuses before anything waits on them: a cluster
launcher's environment of several tasks joins through `jax.distributed.initialize()`'s own detection with the
run's timeouts; one task, or no launcher and no flags, runs alone."""

import sys

import jax
import pytest

from train import distributed
from train.run import parse_args

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-4]", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
REQUIRED = ["--preset", "tiny", "--data", "d.txt", "--steps", "1", "--out", "o"]


@pytest.mark.parametrize("env,found", [
    ({}, None),
    ({**SLURM, "SLURM_NTASKS": "1"}, None),
    ({**SLURM, "SLURM_NTASKS": "4"}, "SLURM"),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, None),  # not what jax.distributed reads: no node list, no job
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
     "Open MPI"),
])
def test_launcher_environments(env, found):
    assert distributed.launcher(env) == found


@pytest.mark.parametrize("flags", [
    ["--coordinator", "127.0.0.1:1234"],
    ["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
    ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
    ["--num-processes", "2", "--process-id", "0"],
    ["--heartbeat-timeout", "0"],
])
def test_flags_that_cannot_start_a_job_are_refused(flags, capsys):
    with pytest.raises(SystemExit):
        parse_args(REQUIRED + flags)
    assert "error" in capsys.readouterr().err


def test_joins_by_the_launchers_environment_and_alone_without(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after: `initialize` replaces it
    for name in list(SLURM) + ["SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri"]:
        monkeypatch.delenv(name, raising=False)
    assert not distributed.initialize(parse_args(REQUIRED)) and not calls
    for name, value in {**SLURM, "SLURM_NTASKS": "4"}.items():
        monkeypatch.setenv(name, value)
    assert distributed.initialize(parse_args(REQUIRED + ["--heartbeat-timeout", "7"]))
    assert calls == [((), {"initialization_timeout": 300, "heartbeat_timeout_seconds": 7})]
