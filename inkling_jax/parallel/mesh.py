"""Device meshes: the four named axes, mesh specs such as "fsdp=4,tensor=2", and the check that a mesh can split
a model.

Mesh axes: `data` (replicas), `fsdp` (parameters sharded, gathered per layer), `tensor` (heads and MLP
widths), `expert` (routed experts). A mesh string names the axes it uses; the others have size 1.
"""

from __future__ import annotations

import logging
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from inkling_jax.parallel.kernel_sharding import head_shards

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor", "expert")

class MeshError(ValueError):
    """A mesh spec that names no mesh, needs more devices than there are, or cannot split the model."""


def parse_mesh_spec(spec: str | None) -> dict[str, int]:
    """"fsdp=4,tensor=2" -> {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, (spec or "").replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit() or int(value) < 1:
            raise MeshError(f"bad mesh axis {part!r}: use name=size with names from {MESH_AXES}")
        sizes[name] = int(value)
    return sizes


def make_mesh(spec: str | dict[str, int] | None = None, devices: Iterable | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with the four named axes. When the spec does not name `data`,
    devices left over go to data parallelism; otherwise the sizes must multiply to the device count."""
    sizes = parse_mesh_spec(spec) if not isinstance(spec, dict) else {**dict.fromkeys(MESH_AXES, 1), **spec}
    devices = list(jax.devices() if devices is None else devices)
    total = int(np.prod(list(sizes.values())))
    if total != len(devices):
        if len(devices) % total == 0 and (spec is None or "data" not in str(spec)):
            sizes["data"] *= len(devices) // total  # fill the rest with data parallelism
        else:
            raise MeshError(f"mesh {sizes} needs {total} devices, {len(devices)} available")
    grid = np.array(devices).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def check_mesh(mesh: Mesh, text) -> None:
    """Raise MeshError where `mesh` cannot split the model of TextConfig `text` (routed experts over `expert`);
    log what a `tensor` axis leaves whole (heads and KV caches that do not divide, the expert width)."""
    expert, tensor = mesh.shape["expert"], mesh.shape["tensor"]
    if text.num_experts % expert:
        raise MeshError(f"the model's {text.num_experts} routed experts do not split over expert={expert}")
    for local in sorted({text.is_local(i) for i in range(text.num_layers)}):
        shape = text.attention(local)
        if head_shards(mesh, (shape.num_heads, shape.num_kv_heads)) < tensor:
            log.warning("tensor=%d does not divide the %s-attention layers' %d query / %d KV heads: their attention "
                        "and KV cache stay whole on every device", tensor, "sliding" if local else "full",
                        shape.num_heads, shape.num_kv_heads)
    if tensor > 1 and text.moe_intermediate_size % tensor:
        log.warning("tensor=%d does not divide the expert width %d: every device runs whole experts", tensor,
                    text.moe_intermediate_size)
