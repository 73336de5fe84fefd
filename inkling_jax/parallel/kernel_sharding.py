"""Running the attention and ShortConv kernels on a sharded model: one call per device through `shard_map`.

A Pallas kernel is a custom call that XLA's SPMD partitioner cannot split. Given operands sharded by heads (the
`tensor` axis) or by batch (`data` x `fsdp`), XLA would gather every operand onto every device and run the whole
kernel there: every KV cache and every head, on every device, in every layer. So `kernels` wraps each call in
`shard_map` with the layout the sharding rules give its operands; each device then runs the kernel on its own heads
and rows, which needs no communication (attention and ShortConv are independent per head, channel and row).

Heads split only when both the query and the KV head counts divide by `tensor`, so that each device holds whole
GQA groups; otherwise they stay whole, and XLA gathers them first (the cache placement makes the same choice).
"""

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from inkling_jax.parallel.rules import RULES, spec_for

HEADS = RULES["kv_heads"]  # the axis of query and KV heads alike (RULES' "q_heads" and "kv_heads")


class Split:
    """How one kernel call is split over `mesh`: `heads` ("tensor" or None) for head (or channel) dimensions,
    `batch` (mesh axes or None) for batch dimensions."""

    def __init__(self, mesh: Mesh, heads: str | None, batch: str | tuple[str, ...] | None):
        self.mesh, self.heads, self.batch = mesh, heads, batch

    def __bool__(self) -> bool:
        return bool(self.heads or self.batch)

    def spec(self, heads_dim: int | None = None, batch_dim: int | None = None) -> PartitionSpec:
        """The spec of an operand whose heads sit at `heads_dim` and batch at `batch_dim` (None: not split)."""
        parts = [None] * (1 + max(d for d in (heads_dim, batch_dim, -1) if d is not None))
        if heads_dim is not None:
            parts[heads_dim] = self.heads
        if batch_dim is not None:
            parts[batch_dim] = self.batch
        return PartitionSpec(*parts)

    def run(self, fn, in_specs, out_specs):
        """`fn` once per device, its operands and results laid out as the specs say."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def head_shards(mesh: Mesh | None, head_counts) -> int:
    """The devices heads split over: `tensor` when it divides every count in `head_counts` (query, KV), so each
    device holds whole GQA groups; else 1."""
    tensor = 1 if mesh is None else mesh.shape[HEADS]
    return tensor if all(n % tensor == 0 for n in head_counts) else 1


def split(mesh: Mesh | None, head_counts=(), batch: int | None = None) -> Split | None:
    """The split of a call whose operands have `head_counts` heads (query, KV) and `batch` rows (None: rows stay
    whole, as the cache-indexed calls of the server need). None when nothing splits."""
    if mesh is None:
        return None
    heads = HEADS if head_counts and head_shards(mesh, head_counts) > 1 else None
    rows = None if batch is None else spec_for(("batch",), (batch,), mesh)[0]  # as the batch's own sharding
    out = Split(mesh, heads, rows)
    return out if out else None


def pin_heads(mesh: Mesh | None, head_counts, x, heads_dim: int):
    """x laid out as the kernels and the cache split heads: its dimension `heads_dim` over `tensor` where
    `head_shards` splits them, every other dimension whole. Left free, XLA may split the new K/V by head_dim (as
    their projection's columns are) and then the whole cache pool they are written into, gathering the pool at
    every step (seen on CPU with a single KV head on a tensor=2 mesh)."""
    if mesh is None:
        return x
    parts = [None] * x.ndim
    parts[heads_dim] = HEADS if head_shards(mesh, head_counts) > 1 else None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*parts)))
