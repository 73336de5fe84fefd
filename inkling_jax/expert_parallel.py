"""Expert parallelism: routed experts split over the mesh's `expert` axis with `shard_map`.

Tokens are sharded over the batch axes (data x fsdp) and replicated across the `expert` axis, so every expert
shard already holds the tokens of its group: each shard runs only the (token, slot) rows routed to its own
experts (sorted, one grouped matmul per projection) and a `psum` over `expert` combines the partial outputs.
There is no capacity and no token is dropped; the result does not depend on the mesh (up to the fp32 order of
the final sum).
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from inkling_jax.sharding import RULES


def routed_experts_ep(x, w_gate, w_up, w_down, expert_ids, weights, mesh: Mesh, grouped_ffn):
    """sum_k weights[n, k] * Expert_{ids[n, k]}(x[n]) with the experts sharded over `expert`.

    grouped_ffn(rows [M, H], w_gate, w_up, w_down, group_sizes [G], row_weights [M]) -> [M, H] runs the
    experts of one shard on rows sorted by expert (rows past sum(group_sizes) must come out as zeros).
    """
    num_experts = w_gate.shape[0]
    shards = mesh.shape["expert"]
    if num_experts % shards:
        raise ValueError(f"{num_experts} experts do not split over an expert axis of {shards}")
    batch_axes = tuple(a for a in RULES["batch"] if mesh.shape[a] > 1)
    tokens = P(batch_axes or None, None)
    if x.shape[0] % max(1, _size(mesh, batch_axes)):
        tokens = P(None, None)  # too few tokens to split: every shard of the group takes them all

    def shard(x, ids, wts, wg, wu, wd):
        local = wg.shape[0]
        first = jax.lax.axis_index("expert") * local
        local_ids = ids.reshape(-1) - first
        mine = (local_ids >= 0) & (local_ids < local)
        # Rows of other shards' experts sort after every local group and are never computed.
        key = jnp.where(mine, local_ids, local)
        order = jnp.argsort(key, stable=True)
        top_k = ids.shape[1]
        token_of_row = order // top_k
        group_sizes = jnp.bincount(jnp.where(mine, local_ids, 0), weights=mine.astype(jnp.int32),
                                   length=local).astype(jnp.int32)
        row_weights = jnp.where(mine, wts.reshape(-1), 0).astype(x.dtype)[order]
        y = grouped_ffn(x[token_of_row], wg, wu, wd, group_sizes, row_weights)
        partial = jnp.zeros(x.shape, jnp.float32).at[token_of_row].add(y.astype(jnp.float32))
        return jax.lax.psum(partial, "expert")

    expert_w = P("expert", None, None)
    out = jax.shard_map(shard, mesh=mesh, in_specs=(tokens, tokens, tokens, expert_w, expert_w, expert_w),
                        out_specs=tokens, check_vma=False)(x, expert_ids, weights, w_gate, w_up, w_down)
    return out.astype(x.dtype)


def _size(mesh: Mesh, axes) -> int:
    out = 1
    for a in axes:
        out *= mesh.shape[a]
    return out
