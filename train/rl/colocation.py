"""Where the rollout engine runs: on the trainer's own devices (colocated), on a mesh the server runs.

The engine's mesh keeps the trainer mesh's `tensor` and `expert` axes, over the same devices in the same order,
and puts every other device along `data`: each device holds the same tensor and expert slices of the serving
view as of the trainer's weights, whole along the trainer's `data` and `fsdp` axes (the server shards its weights
over `tensor` and `expert` only; an fsdp-sharded view would be gathered at every decode step).

A job of several processes runs one engine per process, on that process's devices (the server's programs take
and return host arrays of the devices they run on): the engine mesh's `data` rows held by the process. Every
tensor x expert group must then lie within one process (a multiple of tensor x expert devices per process,
`make_mesh`'s order). The weight sync computes the view on the whole job's engine mesh, each process's shards of
it on its own devices, and `local_arrays` takes those shards as the local engine's arrays, without a copy.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from inkling_jax.parallel.mesh import MeshError, make_mesh


def engine_mesh(trainer_mesh: Mesh) -> Mesh | None:
    """The engine's mesh over the trainer's devices (None: one device of one process, the engine's default)."""
    if trainer_mesh.size == 1 and jax.process_count() == 1:
        return None
    groups = {"tensor": trainer_mesh.shape["tensor"], "expert": trainer_mesh.shape["expert"]}
    if jax.local_device_count() % math.prod(groups.values()):
        raise MeshError(f"tensor x expert = {math.prod(groups.values())} does not divide the "
                        f"{jax.local_device_count()} devices of a process: each process's rollout engine needs "
                        "whole tensor x expert groups")
    return make_mesh(groups, list(trainer_mesh.devices.flat))


def local_mesh(mesh: Mesh | None) -> Mesh | None:
    """The rows of `mesh` along `data` whose devices this process holds: its rollout engine's mesh."""
    if mesh is None or jax.process_count() == 1:
        return mesh
    here = jax.process_index()
    rows = [row for row in mesh.devices if all(d.process_index == here for d in row.flat)]
    if len(rows) * mesh.devices[0].size != jax.local_device_count():
        raise MeshError("a tensor x expert group of the engine's mesh spans processes: give each process a "
                        "multiple of tensor x expert devices")
    return Mesh(np.stack(rows), mesh.axis_names)


def local_arrays(arrays: list, local: Mesh | None) -> list:
    """Arrays on a whole job's engine mesh, replicated along `data`, as arrays of the same shards on this
    process's engine mesh `local` (the shards this process holds; nothing is copied). One process: as they are."""
    if local is None or jax.process_count() == 1:
        return arrays
    out = []
    for x in arrays:
        sharding = NamedSharding(local, x.sharding.spec)
        shards = {s.device: s.data for s in x.addressable_shards}
        out.append(jax.make_array_from_single_device_arrays(x.shape, sharding,
                                                            [shards[d] for d in local.devices.flat]))
    return out


def global_sharding(sharding, mesh: Mesh | None):
    """The sharding over a whole job's engine mesh of a local engine's array placed by `sharding`."""
    return sharding if mesh is None else NamedSharding(mesh, sharding.spec)
