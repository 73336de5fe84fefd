"""How an MoE's routed tokens reach the experts on one device: each token's top-k copies ordered by expert, the
grouped matmuls of the backend's `moe` (Pallas kernels, `jax.lax.ragged_dot`, or every expert on every token for
tiny models), quantised experts' kernels or formulas, and the shared experts beside them. On a mesh
`nn.moe.experts` hands over to `inkling_jax.parallel.expert_parallel` instead, which runs the same pieces on each shard.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from inkling_jax.backend import Backend
from inkling_jax.nn import invariant
from inkling_jax.nn.layers import swiglu
from pallas_kernels.moe import (DECODE_MAX_ROWS, MatmulKernels, block_tiles, grouped_matmul, moe_ffn_decode,
                                moe_ffn_in_blocks)
from pallas_kernels.moe.decode import MAX_SLAB_TOKENS, slab_maps

# The MoE's parameter names of its routed experts in each form, and of its shared experts' stacks
ROUTED_BF16 = ("w_gate", "w_up", "w_down")
ROUTED_FP8 = ("w_gate_fp8", "w_up_fp8", "w_down_fp8", "w_gate_scale", "w_up_scale", "w_down_scale")
ROUTED_NVFP4 = ("w13_nvfp4", "w13_scale", "w13_scale2", "w2_nvfp4", "w2_scale", "w2_scale2")
ROUTED_QUANTISED = {"fp8": ROUTED_FP8, "nvfp4": ROUTED_NVFP4}
SHARED_NAMES = ("shared_gate", "shared_up", "shared_down")

# Rows (tokens x top-k) up to which `order_by_group` compares all pairs instead of sorting: [rows, rows] each
SORT_FREE_ROWS = 1024


def local_experts(x, routed, shared, expert_ids, weights, shared_weights, backend: Backend, *, width_axis=None):
    """`experts` on the arrays one device holds: all of them, or (inside a shard_map) its tokens and its
    slice of every expert's width (over the mesh axis `width_axis`), whose fp32 output is then a partial sum.
    backend: resolved (`Backend.resolve`)."""
    if backend.batch_invariant:
        return _invariant_experts(x, routed, shared, expert_ids, weights, shared_weights, backend)
    if backend.moe == "dense" and precision_of(routed) == "bf16":
        return _routed_dense(x, *routed, expert_ids, weights) + shared_dense(x, shared, shared_weights)
    num_tokens, top_k = expert_ids.shape
    group, row_weights = expert_ids.reshape(-1), weights.reshape(-1)
    ffn = expert_ffn(backend, routed, num_tokens, group.shape[0], width_axis)
    y = grouped_rows(x, group, row_weights, routed, ffn, top_k)
    out = y.astype(jnp.float32).reshape(num_tokens, top_k, -1).sum(1)
    return out + shared_dense(x, shared, shared_weights)


def _invariant_experts(x, routed, shared, expert_ids, weights, shared_weights, backend: Backend):
    """`local_experts` in the batch-invariant arithmetic (`inkling_jax.nn.invariant`), bf16 or fp32 experts."""
    if precision_of(routed) != "bf16":
        raise ValueError("the batch-invariant MoE runs bf16 or fp32 experts, not quantised ones")
    num_tokens, top_k = expert_ids.shape
    ffn = ExpertFfn(invariant.expert_ffn(backend.interpret, num_tokens <= invariant.DECODE_ROWS))
    y = grouped_rows(x, expert_ids.reshape(-1), weights.reshape(-1), routed, ffn, top_k)
    out = invariant.combine_top_k(y, num_tokens, top_k)
    if shared is None:
        return out
    outs = []
    for s, (gate, up, down) in enumerate(zip(*shared)):
        h = swiglu(invariant.matmul(x, gate, interpret=backend.interpret),
                   invariant.matmul(x, up, interpret=backend.interpret))
        h = h * shared_weights[:, s:s + 1].astype(x.dtype)
        outs.append(invariant.matmul(h, down, interpret=backend.interpret).astype(jnp.float32))
    return out + invariant.tree_sum(jnp.stack(outs), axis=0)


class ExpertFfn(NamedTuple):
    """The experts' FFN as `grouped_rows` runs it: run(rows, *stack, group_sizes, row_weights) -> [P, H] on rows
    sorted by group, zeros past sum(group_sizes); each group's rows padded with zero rows to a multiple of
    `align` (1: none), which group_sizes count."""
    run: Callable
    align: int = 1


def grouped_rows(x, group, row_weights, stack, ffn: ExpertFfn, copies: int = 1):
    """y[r] = row_weights[r] * E_{group[r]}(x[r // copies]) for the rows of x [T, H] each taken `copies` times in
    a row (a token's top-k copies), in that order, by `ffn` on the rows sorted by group (`lay_out`) and padded to
    its `align`; a group >= G (the number of experts in `stack`) means no expert and gives zeros. The rows go from
    x straight into the layout ffn runs on and its result straight back: one gather each way, and one each way
    in the backward (`take_rows`). Returns [R, H] in x.dtype."""
    place, source, group_sizes = lay_out(group, stack[0].shape[0], ffn.align)
    rows = take_rows(x, source // copies, place.reshape(-1, copies))
    y = ffn.run(rows, *stack, group_sizes, take_rows(row_weights, source, place[:, None]))
    return take_rows(y, place, source[:, None])


def lay_out(group, num_groups: int, align: int = 1):
    """(place [R], source [P], group_sizes [G]): rows `group` [R] sorted (stably) by group, each group's rows
    padded with empty rows to a multiple of `align` (so that no kernel row block of that many rows holds two
    groups). place[r]: row r's place; source[p]: the row at place p; group_sizes: rows of each group, empty ones
    included. A row of group >= num_groups (no expert) lies past the groups' rows (align 1) or nowhere: place P,
    out of range; an empty row's source is R, out of range."""
    order, place = order_by_group(group)
    sizes = jnp.bincount(group, length=num_groups).astype(jnp.int32)  # drops the rows of no group
    if align == 1:
        return place, order, sizes
    # The slabs of the sorted rows, composed with the sort (rows of no group sort past the groups' rows).
    slab_sizes, src, valid, dst, in_group = slab_maps(sizes, group.shape[0], None, align)
    places, rows = src.shape[0], group.shape[0]
    return jnp.where(in_group[place], dst[place], places), jnp.where(valid, order[src], rows), slab_sizes


@jax.custom_vjp
def take_rows(x, index, inverse):
    """x[index] (zeros where index is out of range) for rows x [T, ...] that `index` [R] takes up to
    `inverse.shape[1]` times each, at the places inverse [T, c] names (out of range: not taken): the gradient
    gathers each row's places and sums them (in fp32), where autodiff would scatter-add into x with atomics."""
    return _take(x, index)


def _take(x, index):
    return x.at[index].get(mode="fill", fill_value=0)


def _take_rows_forward(x, index, inverse):
    return _take(x, index), inverse


def _take_rows_backward(inverse, cotangent):
    taken = _take(cotangent, inverse)
    summed = taken[:, 0] if inverse.shape[1] == 1 else taken.astype(jnp.float32).sum(1).astype(cotangent.dtype)
    return summed, None, None


take_rows.defvjp(_take_rows_forward, _take_rows_backward)


def order_by_group(group):
    """(order, place): the rows' stable order by group, and each row's place in it (order's inverse). Up to
    SORT_FREE_ROWS rows, by comparing all pairs (one fusion each), not a sort: in a decode step the sort, the
    scatter of its inverse and the index select were measured to cost more."""
    rows = group.shape[0]
    index = jnp.arange(rows, dtype=jnp.int32)
    if rows > SORT_FREE_ROWS:
        order = jnp.argsort(group, stable=True).astype(jnp.int32)
        return order, jnp.zeros_like(order).at[order].set(index)
    this, other = index[:, None], index[None, :]  # [row, other row]
    before = (group[None, :] < group[:, None]) | ((group[None, :] == group[:, None]) & (other < this))
    place = jnp.sum(before, axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(place[None, :] == index[:, None], index[None, :], 0), axis=1, dtype=jnp.int32)
    return order, place


def grouped_ffn(backend: Backend, stack, num_rows: int, num_tokens: int | None = None) -> ExpertFfn:
    """The experts `stack` of one device on `num_rows` rows sorted by expert (zeros past sum(group_sizes)).
    `num_tokens` (static, when the rows are the top-k copies of that many tokens) lets steps of up to
    `MAX_SLAB_TOKENS` use the kernel's layout that reads each touched expert once (at 32 tokens x top-6 the rows
    exceed its row threshold), on our kernels, every group in one slab where num_tokens bounds its rows within
    one; larger steps run the grouped matmuls of the backend's `moe_forward` and `moe_backward` on every group's
    rows padded to whole row blocks of their tiles."""
    if backend.moe == "pallas":
        if num_tokens is not None and num_tokens <= MAX_SLAB_TOKENS:
            bound = num_tokens if num_tokens <= DECODE_MAX_ROWS else None
            return ExpertFfn(functools.partial(moe_ffn_decode, max_group_rows=bound, interpret=backend.interpret))
        kernels = MatmulKernels(forward=backend.moe_forward, backward=backend.moe_backward)
        configs, align = block_tiles(num_rows, stack[0].shape[0], stack[0].dtype)
        return ExpertFfn(functools.partial(moe_ffn_in_blocks, configs=configs, interpret=backend.interpret,
                                           kernels=kernels), align)
    return ExpertFfn(_ragged_ffn)


def grouped_projection(backend: Backend):
    """One projection of the experts on rows sorted by expert, (rows [M, K], w [G, K, N], group_sizes [G]) ->
    [M, N] in rows' dtype, zeros past sum(group_sizes): under the backend's `moe` "pallas" the grouped matmul of
    its `moe_forward` (memory O(M); widths of whole 128-byte spans, `pallas_kernels.moe.ops.pad_expert_width`),
    else `jax.lax.ragged_dot`. For paths that add to each projection's product (`serve.lora.experts`), which the
    fused `grouped_ffn` cannot take. backend: resolved."""
    if backend.moe == "pallas":
        kernels = MatmulKernels(forward=backend.moe_forward, backward=backend.moe_backward)
        return functools.partial(grouped_matmul, interpret=backend.interpret, kernels=kernels)
    return jax.lax.ragged_dot


def expert_forms() -> dict:
    """precision -> the NamedTuple that routed experts in it travel in (pallas_kernels/moe, imported on use)."""
    from pallas_kernels.moe.fp8 import Fp8Experts
    from pallas_kernels.moe.nvfp4 import Nvfp4Experts

    return {"fp8": Fp8Experts, "nvfp4": Nvfp4Experts}


def precision_of(routed) -> str:
    """"fp8" for an Fp8Experts, "nvfp4" for an Nvfp4Experts, "bf16" for (w_gate, w_up, w_down)."""
    return next((p for p, form in expert_forms().items() if isinstance(routed, form)), "bf16")


def expert_ffn(backend: Backend, routed, num_tokens: int | None, num_rows: int,
               width_axis: str | None = None) -> ExpertFfn:
    """The `grouped_ffn` for `routed` on num_rows rows; for quantised experts, one called with the six fields of
    an Fp8Experts or Nvfp4Experts: their kernels when the backend's `moe` is "pallas", else their jnp formula
    (pallas_kernels/moe/fp8.py, nvfp4.py). width_axis: the mesh axis over which the experts' width is split, so
    that fp8's h is quantised with its whole row's scale."""
    precision = precision_of(routed)
    if precision == "bf16":
        return grouped_ffn(backend, routed, num_rows, num_tokens)
    if precision == "fp8":
        from pallas_kernels.moe.fp8 import Fp8Experts as form
        from pallas_kernels.moe.fp8 import moe_ffn_fp8 as kernel
        from pallas_kernels.moe.fp8 import moe_ffn_fp8_reference as formula

        extra = dict(width_axis=width_axis)
    else:
        from pallas_kernels.moe.nvfp4 import Nvfp4Experts as form
        from pallas_kernels.moe.nvfp4 import moe_ffn_nvfp4 as kernel
        from pallas_kernels.moe.nvfp4 import moe_ffn_nvfp4_reference as formula

        extra = {}

    def ffn(rows, *args):
        experts, (group_sizes, row_weights) = form(*args[:6]), args[6:]
        if backend.moe == "pallas":
            return kernel(rows, experts, group_sizes, row_weights, max_group_rows=num_tokens,
                          interpret=backend.interpret, **extra)
        return formula(rows, experts, group_sizes, row_weights, **extra)
    return ExpertFfn(ffn)


def _ragged_ffn(rows, w_gate, w_up, w_down, group_sizes, row_weights):
    h = swiglu(jax.lax.ragged_dot(rows, w_gate, group_sizes), jax.lax.ragged_dot(rows, w_up, group_sizes))
    return (jax.lax.ragged_dot(h, w_down, group_sizes) * row_weights[:, None].astype(rows.dtype)).astype(rows.dtype)


def shared_dense(x, shared, shared_weights):
    """The S shared experts on every token, each weighted by its sink weight before the down projection; 0 for
    shared None (the MoE runs its widened shared experts itself)."""
    if shared is None:
        return 0.0
    gate, up, down = shared
    # Batched over s on both sides: contracting x [n, h] with [s, h, i] directly makes XLA transpose the weights
    # on every call; the broadcast x costs nothing.
    xs = jnp.broadcast_to(x, (gate.shape[0],) + x.shape)
    h = swiglu(jnp.einsum("snh,shi->sni", xs, gate), jnp.einsum("snh,shi->sni", xs, up))
    h = h * shared_weights.T[:, :, None].astype(x.dtype)
    return jnp.einsum("sni,sih->snh", h, down).astype(jnp.float32).sum(0)


def _routed_dense(x, w_gate, w_up, w_down, expert_ids, weights):
    """Every expert on every token, masked: the plain reference (tiny models only)."""
    num_experts = w_gate.shape[0]
    combine = jnp.zeros((x.shape[0], num_experts), weights.dtype)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], expert_ids].add(weights)
    h = swiglu(jnp.einsum("nh,ehi->eni", x, w_gate), jnp.einsum("nh,ehi->eni", x, w_up))
    y = jnp.einsum("eni,eih->enh", h, w_down)
    return jnp.einsum("enh,ne->nh", y.astype(jnp.float32), combine.astype(jnp.float32))
