"""The dense SwiGLU MLP (first layers, MTP blocks) and the sigmoid top-k MoE with the shared-expert sink.

Gate and up projections are stored apart (`w_gate`, `w_up`); the hub interleaves them by row and the loader
de-interleaves. The SwiGLU is computed in fp32 and cast back.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax import kernels
from inkling_jax.config import TextConfig
from inkling_jax.layers import normal


def swiglu(gate, up):
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


class DenseMLP(nnx.Module):
    def __init__(self, hidden: int, width: int, *, dtype, rngs: nnx.Rngs):
        self.w_gate = nnx.Param(normal(rngs, (hidden, width), dtype))
        self.w_up = nnx.Param(normal(rngs, (hidden, width), dtype))
        self.w_down = nnx.Param(normal(rngs, (width, hidden), dtype))
        self.global_scale = nnx.Param(jnp.ones((1,), dtype))

    def __call__(self, x, expert_ids=None):
        h = swiglu(x @ self.w_gate[...], x @ self.w_up[...])
        return (h @ self.w_down[...]) * self.global_scale[...], None


class MoE(nnx.Module):
    """Router over E routed + S shared experts; top-k of the routed ones by sigmoid score plus a selection-only
    bias; the k chosen and the S shared experts share one normalisation, so shared experts draw weight away
    from routed ones (the "sink"); weights scaled by route_scale and a learned global scale."""

    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs):
        e, s, h, i = cfg.num_experts, cfg.num_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.route_scale = cfg.num_experts_per_tok, cfg.route_scale
        self.router = nnx.Param(normal(rngs, (h, e + s), dtype))
        self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32))  # selection only, never a weight
        self.router_scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.w_gate = nnx.Param(normal(rngs, (e, h, i), dtype))
        self.w_up = nnx.Param(normal(rngs, (e, h, i), dtype))
        self.w_down = nnx.Param(normal(rngs, (e, i, h), dtype))
        self.shared_gate = nnx.Param(normal(rngs, (s, h, i), dtype))
        self.shared_up = nnx.Param(normal(rngs, (s, h, i), dtype))
        self.shared_down = nnx.Param(normal(rngs, (s, i, h), dtype))
        self.mesh = None  # set by `sharding.shard_model`; an `expert` axis > 1 turns on expert parallelism

    @property
    def num_experts(self) -> int:
        return self.router_bias.shape[0]

    def route(self, x, expert_ids=None):
        """x [N, hidden] -> (routed weights [N, k], expert ids [N, k], shared weights [N, S]), all fp32.

        Given `expert_ids` (routing replay: the choice recorded at rollout time) only the weights are
        recomputed, so gradients reach the router while the choice stays the recorded one.
        """
        logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        routed, shared = logits[:, : self.num_experts], logits[:, self.num_experts:]
        if expert_ids is None:
            choice = jax.nn.sigmoid(routed) + self.router_bias[...]
            _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(choice), self.top_k)
        active = jnp.concatenate([jnp.take_along_axis(routed, expert_ids, axis=-1), shared], axis=-1)
        weights = jax.nn.softmax(jax.nn.log_sigmoid(active), axis=-1)  # = sigmoid / sum(sigmoid)
        weights = weights * self.route_scale * self.router_scale[...]
        return weights[:, : self.top_k], expert_ids, weights[:, self.top_k:]

    def __call__(self, x, expert_ids=None):
        """x [..., hidden] -> (y [..., hidden], expert ids [N, k] chosen for the N flattened tokens)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if expert_ids is not None:
            expert_ids = expert_ids.reshape(flat.shape[0], self.top_k)
        weights, expert_ids, shared_weights = self.route(flat, expert_ids)
        routed = routed_experts(flat, self.w_gate[...], self.w_up[...], self.w_down[...], expert_ids,
                                weights.astype(x.dtype), self.mesh)
        # Shared experts: every token, weighted by its sink weight before the down projection.
        h = swiglu(jnp.einsum("nh,shi->sni", flat, self.shared_gate[...]),
                   jnp.einsum("nh,shi->sni", flat, self.shared_up[...]))
        h = h * shared_weights.T[:, :, None].astype(x.dtype)
        shared = jnp.einsum("sni,sih->snh", h, self.shared_down[...]).astype(jnp.float32).sum(0)
        out = routed.astype(jnp.float32) + shared
        return out.astype(x.dtype).reshape(shape), expert_ids


def routed_experts(x, w_gate, w_up, w_down, expert_ids, weights, mesh=None):
    """sum_k weights[n, k] * Expert_{ids[n, k]}(x[n]) for x [N, H], by the selected MoE backend; with a mesh
    whose `expert` axis is larger than 1, by expert parallelism."""
    backend = kernels.moe_backend()
    if mesh is not None and mesh.shape["expert"] > 1:
        from inkling_jax.expert_parallel import routed_experts_ep

        return routed_experts_ep(x, w_gate, w_up, w_down, expert_ids, weights, mesh, _grouped_ffn(backend))
    if backend == "dense":
        return _routed_dense(x, w_gate, w_up, w_down, expert_ids, weights)
    return _routed_sorted(x, w_gate, w_up, w_down, expert_ids, weights, _grouped_ffn(backend))


def _grouped_ffn(backend):
    """The experts of one device on rows sorted by expert: (rows, w_gate, w_up, w_down, group_sizes,
    row_weights) -> [M, H], zeros past sum(group_sizes)."""
    if backend == "pallas":
        from pallas_kernels.moe import moe_ffn

        return moe_ffn
    return _ragged_ffn


def _ragged_ffn(rows, w_gate, w_up, w_down, group_sizes, row_weights):
    h = swiglu(jax.lax.ragged_dot(rows, w_gate, group_sizes), jax.lax.ragged_dot(rows, w_up, group_sizes))
    return jax.lax.ragged_dot(h, w_down, group_sizes) * row_weights[:, None]


def _routed_dense(x, w_gate, w_up, w_down, expert_ids, weights):
    """Every expert on every token, masked: the plain reference (tiny models only)."""
    num_experts = w_gate.shape[0]
    combine = jnp.zeros((x.shape[0], num_experts), weights.dtype)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], expert_ids].add(weights)
    h = swiglu(jnp.einsum("nh,ehi->eni", x, w_gate), jnp.einsum("nh,ehi->eni", x, w_up))
    y = jnp.einsum("eni,eih->enh", h, w_down)
    return jnp.einsum("enh,ne->nh", y.astype(jnp.float32), combine.astype(jnp.float32)).astype(x.dtype)


def _routed_sorted(x, w_gate, w_up, w_down, expert_ids, weights, grouped_ffn):
    """Rows (token, slot) sorted by expert, one grouped matmul per projection, then summed back per token."""
    num_tokens, top_k = expert_ids.shape
    num_experts = w_gate.shape[0]
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    rows = x[token_of_row]
    row_weights = weights.reshape(-1)[order]
    y = grouped_ffn(rows, w_gate, w_up, w_down, group_sizes, row_weights)
    out = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token_of_row].add(y.astype(jnp.float32))
    return out.astype(x.dtype)
