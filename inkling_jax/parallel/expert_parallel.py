"""The MoE over a mesh: routed experts split over the `expert` axis (expert parallelism, all-to-all dispatch and
combine) and every expert's width split over `tensor`, both with `shard_map`.

Tokens come sharded over the batch axes (data x fsdp x expert: a trainer's batch is split over `expert` too, so
that attention and the dense work are not repeated on every expert shard) and replicated across `tensor`. Where
the token count does not split over `expert` (a decode step of 1 row), every expert shard holds all of them and
takes its own 1/n slice. Each shard sorts its (token, slot) copies by expert and sends each copy only to the
shard that owns the expert. The copies travel by `ragged_all_to_all_padded`: the contract of
`jax.lax.ragged_all_to_all` over a fixed-size `all_to_all` (XLA:CPU lacks the ragged op, and on one host's GPUs
XLA's ragged op was measured the slower). The receiver runs its experts on everything it received,
sends the results back the same way, and the home shard weights and sums the k copies of each token in fp32 (in
slot order, no atomics); where the shard took a slice, an `all_gather` over `expert` returns the layer's output
replicated again. Buffers are sized for the worst case (every copy to one shard), so there is no capacity and
nothing is dropped. Shared experts run on the home shard's tokens, dense.

Width (Megatron's MLP split): when `tensor` divides the routed and the shared experts' width, each tensor shard
holds columns of w_gate / w_up and the matching rows of w_down, so its SwiGLU and down projection give a partial
output, summed over `tensor` in fp32 (before the `all_gather`, on the smaller array). The grouped matmul reads only
the shard's slice of every weight: a Pallas kernel is a custom call XLA cannot partition, so without this the
sharded weights would be gathered on every device at every step. Without an `expert` axis (`experts_tp`) it is
the same split around `moe_dispatch.local_experts` on each batch shard's tokens.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from inkling_jax.backend import Backend
from inkling_jax.nn.moe_dispatch import (
    ROUTED_BF16,
    ROUTED_QUANTISED,
    SHARED_NAMES,
    expert_ffn,
    grouped_rows,
    local_experts,
    precision_of,
    shared_dense,
)
from inkling_jax.parallel.rules import RULES, axes_of, logical_axes, spec_for

AXIS = RULES["experts"]
WIDTH_AXIS = RULES["expert_mlp"]  # the routed experts' width; RULES splits the shared ones' ("mlp") alike


def width_axis(mesh: Mesh, routed, shared) -> str | None:
    """`tensor` when the mesh has one and it divides the routed and the shared width (split alike), else None:
    every shard holds whole experts. NVFP4 experts split in whole groups of 64 output columns (their w13 holds
    gate and up rows in turns of 64: 2 of its row groups)."""
    n = mesh.shape[WIDTH_AXIS]
    # the dimension `_shard_map` splits, of w_gate, w_gate_fp8 or w13_nvfp4
    name, first = _routed_names(routed)[0], routed[0]
    split = first.shape[logical_axes(("mlp", name), first.ndim).index("expert_mlp")]
    grain = 2 if precision_of(routed) == "nvfp4" else 1
    shared_splits = shared is None or shared[2].shape[1] % n == 0  # None: widened, run outside (nn.moe.MoE)
    return WIDTH_AXIS if n > 1 and split % (n * grain) == 0 and shared_splits else None


def experts_tp(x, routed, shared, expert_ids, weights, shared_weights, mesh: Mesh, backend: Backend):
    """`nn.moe.experts` with every expert's width split over `tensor` and no `expert` axis (see module doc)."""
    width = width_axis(mesh, routed, shared)

    def shard(x, ids, wts, shared_wts, routed, shared):
        out = local_experts(x, routed, shared, ids, wts, shared_wts, backend, width_axis=width)
        return _sum_width(out, width)

    return _shard_map(shard, mesh, _tokens_spec(mesh, x.shape[0]), width, routed, shared)(
        x, expert_ids, weights, shared_weights, routed, _stacks(shared))


def experts_ep(x, routed, shared, expert_ids, weights, shared_weights, mesh: Mesh, backend: Backend):
    """`nn.moe.experts` with the routed experts sharded over `expert` (and their width over `tensor` when
    `width_axis` says so).

    backend (resolved): its `moe` runs one shard's experts on the rows it received (`moe_dispatch.expert_ffn`).
    """
    num_experts, shards = routed[0].shape[0], mesh.shape[AXIS]
    if num_experts % shards:
        raise ValueError(f"{num_experts} experts do not split over an expert axis of {shards}")
    width = width_axis(mesh, routed, shared)

    tokens = _tokens_spec(mesh, x.shape[0])
    split = AXIS in axes_of(tokens[0])  # each shard holds its own tokens

    def shard(x, ids, wts, shared_wts, routed, shared):
        num_local, (num_tokens, top_k) = routed[0].shape[0], ids.shape
        me = jax.lax.axis_index(AXIS)
        if split:
            per, x_mine, ids_mine, wts_mine, shared_mine = num_tokens, x, ids, wts, shared_wts
            real, num_tokens = jnp.ones((per,), bool), per * shards  # the tokens of the whole expert group
        else:  # this shard's slice of the tokens its group holds (padded to a multiple of the shard count)
            per = -(-num_tokens // shards)
            take = lambda a: jax.lax.dynamic_slice_in_dim(  # noqa: E731
                jnp.pad(a, [(0, per * shards - num_tokens)] + [(0, 0)] * (a.ndim - 1)), me * per, per)
            x_mine, ids_mine, wts_mine, shared_mine = take(x), take(ids), take(wts), take(shared_wts)
            real = me * per + jnp.arange(per) < num_tokens

        # Copies sorted by global expert = by destination shard, then by its local expert.
        dest_expert = jnp.where(jnp.repeat(real, top_k), ids_mine.reshape(-1), num_experts)
        order = jnp.argsort(dest_expert, stable=True)
        counts = jnp.bincount(dest_expert, length=num_experts).reshape(shards, num_local)
        plan = _Plan(jax.lax.all_gather(counts, AXIS), me)
        capacity = shards * per * top_k  # every copy of the group could go to this shard
        received = ragged_all_to_all_padded(x_mine[order // top_k], jnp.zeros((capacity, x.shape[1]), x.dtype),
                                            *plan.dispatch(), axis_name=AXIS)

        # Routed weights are applied at home, after the combine (the kernel's row weights are ones).
        group, row_weights = plan.local_expert_of_received(capacity), jnp.ones((capacity,))
        # A local expert receives at most one copy of each of the group's num_tokens tokens (top-k picks are
        # distinct), from whichever shard holds it. So num_tokens bounds every group, and decode-sized steps get
        # the kernel's decode layout although the receive buffer (shards x per x top_k rows) is larger.
        y = grouped_rows(received, group, row_weights, routed,
                         expert_ffn(backend, routed, num_tokens, capacity, width))

        back = ragged_all_to_all_padded(y, jnp.zeros((per * top_k, x.shape[1]), x.dtype), *plan.combine(),
                                        axis_name=AXIS)
        copies = jnp.zeros_like(back).at[order].set(back).reshape(per, top_k, -1).astype(jnp.float32)
        out = (copies * wts_mine[:, :, None].astype(jnp.float32)).sum(1)
        out = _sum_width(out + shared_dense(x_mine, shared, shared_mine), width)
        return out if split else jax.lax.all_gather(out, AXIS, tiled=True)[:num_tokens]

    return _shard_map(shard, mesh, tokens, width, routed, shared)(x, expert_ids, weights, shared_weights, routed,
                                                                  _stacks(shared))


def _stacks(shared):
    return None if shared is None else tuple(shared)


def _shard_map(shard, mesh: Mesh, tokens: P, width: str | None, routed_experts, shared_experts):
    """shard(x, ids, weights, shared_weights, routed, shared) over `mesh`: tokens (and the output) laid out as
    `tokens` (`_tokens_spec`). The experts' weights are laid out by sharding's table for their parameter names
    (`logical_axes`): routed experts over `expert`, the routed and the shared width over `width` unless None,
    every other dimension whole. The routed experts reach `shard` in the form of `routed_experts`: (w_gate, w_up,
    w_down), an Fp8Experts or an Nvfp4Experts; the shared ones as their three stacks, or None (widened)."""
    over = {"experts": AXIS if mesh.shape[AXIS] > 1 else None, "expert_mlp": width, "mlp": width}

    def specs(names, arrays):
        return tuple(P(*(over.get(axis) for axis in logical_axes(("mlp", name), a.ndim)))
                     for name, a in zip(names, arrays))

    routed = specs(_routed_names(routed_experts), routed_experts)
    routed = jax.tree.unflatten(jax.tree.structure(routed_experts), routed)  # the specs in the experts' form
    return jax.shard_map(shard, mesh=mesh, out_specs=tokens, check_vma=False,
                         in_specs=(tokens, tokens, tokens, tokens, routed,
                                   None if shared_experts is None else specs(SHARED_NAMES, shared_experts)))


def _routed_names(routed) -> tuple[str, ...]:
    """The MoE parameter names of routed experts in the form `routed` is in."""
    return ROUTED_QUANTISED.get(precision_of(routed), ROUTED_BF16)


def _tokens_spec(mesh: Mesh, num_tokens: int) -> P:
    """Tokens [N] as the batch is laid out (RULES "batch", over the leading axes that divide N)."""
    return spec_for(("batch",), (num_tokens,), mesh)


def _sum_width(out, width: str | None):
    """The partial outputs of a shard's width slice (fp32), summed over the width axis."""
    return out if width is None else jax.lax.psum(out, width)


class _Plan:
    """Offsets of one dispatch, from every shard's per-(destination, local expert) counts [n, n, L]."""

    def __init__(self, all_counts, me):
        self.all_counts, self.me = all_counts, me
        sizes = all_counts.sum(-1)  # [sender, receiver]
        self.sizes = sizes
        self.before_sender = jnp.cumsum(sizes, 0) - sizes  # rows of earlier senders at each receiver
        self.before_receiver = jnp.cumsum(sizes, 1) - sizes  # rows for earlier receivers in each sender

    def dispatch(self):
        """(input_offsets, send_sizes, output_offsets, recv_sizes) for sending my sorted copies."""
        me = self.me
        return (self.before_receiver[me], self.sizes[me], self.before_sender[me], self.sizes[:, me])

    def combine(self):
        """The same for sending results back: my received chunks to their senders' sorted rows."""
        me = self.me
        return (self.before_sender[:, me], self.sizes[:, me], self.before_receiver[:, me], self.sizes[me])

    def local_expert_of_received(self, capacity):
        """Local expert of every row of my receive buffer (senders' chunks in order, each sorted by expert);
        rows past the last received one get L (no expert)."""
        num_local = self.all_counts.shape[-1]
        starts = self.before_sender[:, self.me]
        ends = starts + self.sizes[:, self.me]
        rows = jnp.arange(capacity, dtype=jnp.int32)
        # compare_all: the default scan is an XLA while loop (see pallas_kernels/moe/groups.py).
        sender = jnp.minimum(jnp.searchsorted(ends, rows, side="right", method="compare_all"), ends.shape[0] - 1)
        within = rows - starts[sender]
        bounds = jnp.cumsum(self.all_counts[:, self.me], -1)[sender]  # [capacity, L]
        local = jnp.sum(bounds <= within[:, None], axis=-1).astype(jnp.int32)
        return jnp.where(rows < ends[-1], local, num_local)


def ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                             axis_name):
    """`jax.lax.ragged_all_to_all` (one slice per peer) through a dense `all_to_all`: every slice travels in a
    slot of the most rows a slice can have, so nothing can overflow: operand's length, or the output's where
    that is shorter (a slice must fit the peer's output, which has this shard's shape; the combine sends back
    from the n-times larger receive buffer). Up to n times the bytes, yet faster on one host's GPUs (see module
    doc), and the only form XLA:CPU runs."""
    rows = operand.shape[0]
    pos = jnp.arange(min(rows, output.shape[0]), dtype=jnp.int32)
    gather = jnp.minimum(input_offsets[:, None] + pos, rows - 1)
    sent = (pos < send_sizes[:, None]).reshape(gather.shape + (1,) * (operand.ndim - 1))
    slots = jnp.where(sent, operand[gather], 0)  # [n, rows, ...]
    got = jax.lax.all_to_all(slots, axis_name, 0, 0, tiled=True)  # got[s] came from peer s
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where peer s's slice goes here
    dst = jnp.where(pos < recv_sizes[:, None], at[:, None] + pos, output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape((-1,) + operand.shape[1:]), mode="drop")
