"""One training job over several processes (hosts), joined by `jax.distributed` into one device mesh.

Either every process is given `--coordinator HOST:PORT --num-processes N --process-id I`, or a cluster launcher
says so in the environment and no flag is needed: under SLURM (`srun`, one task per host or per GPU) and Open
MPI (`mpirun`), a job of more than one task joins by itself (`jax.distributed.initialize()`'s own detection,
which gives each task the one GPU of its local rank unless JAX_LOCAL_DEVICE_IDS names more); `--distributed`
asks for that detection elsewhere (Cloud TPU, Kubernetes). A single process, or a launcher's job of one task,
runs alone as before.

A process that dies must not leave the others waiting in a collective for ever: the coordination service misses
its heartbeats for `--heartbeat-timeout` seconds and stops every other process with an error naming the task.
An exception in one process ends it at once (after its traceback), without the exit barrier that would hold its
heartbeats up while the others wait for it. Only process 0 logs below warnings.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import traceback

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

# (tasks variable, variables jax.distributed reads) of the launchers whose jobs join without flags.
LAUNCHERS = {
    "SLURM": ("SLURM_NTASKS", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")),
    "Open MPI": ("OMPI_COMM_WORLD_SIZE", ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_RANK")),
}


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (multi-host) runs")
    g.add_argument("--coordinator", help="HOST:PORT of process 0, the same for every process")
    g.add_argument("--num-processes", type=int, help="processes in the job (with --coordinator)")
    g.add_argument("--process-id", type=int, help="this process's index, 0 to N-1 (with --coordinator)")
    g.add_argument("--distributed", action="store_true", help="join through jax.distributed's detection of the "
                   "cluster where it is not SLURM or Open MPI (which join by themselves)")
    g.add_argument("--init-timeout", type=int, default=300, help="seconds to wait for every process to join")
    g.add_argument("--heartbeat-timeout", type=int, default=100,
                   help="seconds without a heartbeat after which a process counts as dead and the others stop")


def launcher(environ=os.environ) -> str | None:
    """The cluster launcher whose environment describes a job of more than one task, or None."""
    for name, (tasks, needed) in LAUNCHERS.items():
        if all(v in environ for v in needed) and environ.get(tasks, "1").isdigit() and int(environ[tasks]) > 1:
            return name
    return None


def check_distributed_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Errors for flags that cannot start a job (before anything waits on other processes)."""
    given = [f for f in ("coordinator", "num_processes", "process_id") if getattr(args, f) is not None]
    if given and len(given) < 3:
        p.error("--coordinator, --num-processes and --process-id go together")
    if args.coordinator is not None:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--coordinator {args.coordinator!r}: give HOST:PORT")
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            p.error(f"--process-id {args.process_id} is not in [0, --num-processes {args.num_processes})")
    if args.init_timeout < 1 or args.heartbeat_timeout < 1:
        p.error("--init-timeout and --heartbeat-timeout are seconds >= 1")


def initialize(args: argparse.Namespace) -> bool:
    """Join the job's processes when the flags or a launcher say there are several; returns whether it did.
    Call before anything touches a device."""
    found = launcher()
    if args.coordinator is None and not args.distributed and found is None:
        return False
    timeouts = {"initialization_timeout": args.init_timeout, "heartbeat_timeout_seconds": args.heartbeat_timeout}
    if args.coordinator is not None:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id, **timeouts)
    else:
        jax.distributed.initialize(**timeouts)
    if jax.process_index() != 0:
        for name in ("", "train"):  # the root logger and the command's
            logging.getLogger(name).setLevel(logging.WARNING)
    sys.excepthook = _exit_at_once
    via = f" ({found}'s environment)" if args.coordinator is None and found else ""
    log.info("process %d of %d joined%s; %d of its %d devices are here", jax.process_index(),
             jax.process_count(), via, jax.local_device_count(), jax.device_count())
    return True


def host_copy(tree):
    """Every array of `tree` whole on the host of every process (arrays other processes hold shards of too)."""
    return multihost_utils.process_allgather(tree, tiled=True)


def gather_objects(obj) -> list:
    """Every process's `obj` (picklable), in process order, in every process."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(data.size))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    every = multihost_utils.process_allgather(padded)
    return [pickle.loads(every[i, :size].tobytes()) for i, size in enumerate(sizes)]


def _exit_at_once(kind, value, tb) -> None:
    """An uncaught exception in a joined process: its traceback and a last line saying which process stopped and
    why, then exit without the shutdown barrier."""
    traceback.print_exception(kind, value, tb)
    hint = ""
    if issubclass(kind, jax.errors.JaxRuntimeError):  # a collective whose peer went away, most often
        hint = " (a device program failed: if a collective, another process of the job may have died; see its log)"
    first = str(value).strip().splitlines()[0] if str(value).strip() else ""
    print(f"process {jax.process_index()} of {jax.process_count()} stopped: {kind.__name__}: {first}{hint}",
          file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)
