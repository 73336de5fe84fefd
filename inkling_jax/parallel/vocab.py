"""The embedding lookup of a table whose vocabulary rows are split over a mesh axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from inkling_jax.parallel.rules import spec_for


def take_rows(table, ids, mesh: Mesh | None):
    """table[ids] for a [vocab, embed] table placed by the rules ("vocab" rows over `tensor`): the embedding
    lookup. With the rows split, each device looks up the ids in its own slice (zeros for the others) and the
    slices' results are summed, which moves [..., embed] activations. Left to XLA, the partitioner may gather
    the whole table instead, gigabytes per token in a decode step."""
    axis = None if mesh is None else spec_for(("vocab", "embed"), table.shape, mesh)[0]
    if axis is None:
        return jnp.take(table, ids, axis=0)
    rows = spec_for(("batch",) + (None,) * (ids.ndim - 1), ids.shape, mesh)

    def local(table, ids):
        start = jax.lax.axis_index(axis) * table.shape[0]
        mine = (ids >= start) & (ids < start + table.shape[0])
        found = jnp.take(table, jnp.where(mine, ids - start, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], found, jnp.zeros((), table.dtype)), axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(axis, None), rows),
                         out_specs=PartitionSpec(*rows, None), check_vma=False)(table, ids)
