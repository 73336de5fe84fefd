"""The sigmoid top-k MoE with the shared-expert sink. How the routed tokens reach the experts' kernels:
moe_dispatch.py (one device) and inkling_jax/parallel/expert_parallel.py (a mesh)."""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.config import TextConfig
from inkling_jax.nn import invariant, kernels
from inkling_jax.nn.layers import normal
from inkling_jax.nn.moe_dispatch import local_experts
from inkling_jax.parallel import expert_parallel as parallel


class MoE(nnx.Module):
    """Router over E routed + S shared experts; top-k of the routed ones by sigmoid score plus a selection-only
    bias; the k chosen and the S shared experts share one normalisation, so shared experts draw weight away
    from routed ones (the "sink"); weights scaled by route_scale and a learned global scale. The routed experts
    run by the backend's `moe` (`inkling_jax.backend`).
    """


    def __init__(self, cfg: TextConfig, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
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
        self.mesh = None  # set by `placement.shard_model`; an `expert` axis > 1 turns on expert parallelism
        self.backend = backend  # which kernels run (`inkling_jax.backend`)

    @property
    def num_experts(self) -> int:
        return self.router_bias.shape[0]

    def routed_experts(self, num_tokens: int | None = None):
        """The routed experts as `experts` takes them, for a step of `num_tokens` (static): (w_gate, w_up,
        w_down). Serving forms hold them quantised (`inkling_jax.quant.moe`)."""
        return self.w_gate[...], self.w_up[...], self.w_down[...]

    def shared_experts(self):
        """The shared experts' stacks (w_gate, w_up, w_down) that `experts` runs beside the routed ones; None where
        the module runs them apart (`shared_apart`)."""
        return self.shared_gate[...], self.shared_up[...], self.shared_down[...]

    def shared_apart(self, x, shared_weights):
        """The shared experts' fp32 output [N, hidden] where `experts` does not compute it, else None."""
        return None

    def route(self, x, expert_ids=None):
        """x [N, hidden] -> (routed weights [N, k], expert ids [N, k], shared weights [N, S]), all fp32.

        Given `expert_ids` (routing replay: the choice recorded at rollout time) only the weights are
        recomputed, so gradients reach the router while the choice stays the recorded one; its rows of -1 (no
        record) take the router's own choice.
        """
        logits = kernels.matmul(x.astype(jnp.float32), self.router[...].astype(jnp.float32), backend=self.backend)
        routed, shared = logits[:, : self.num_experts], logits[:, self.num_experts:]
        choice = jax.nn.sigmoid(routed) + self.router_bias[...]
        _, own = jax.lax.top_k(jax.lax.stop_gradient(choice), self.top_k)
        expert_ids = own if expert_ids is None else jnp.where(expert_ids >= 0, expert_ids, own)
        active = jnp.concatenate([jnp.take_along_axis(routed, expert_ids, axis=-1), shared], axis=-1)
        softmax = invariant.softmax if self.backend.batch_invariant else jax.nn.softmax
        weights = softmax(jax.nn.log_sigmoid(active))  # = sigmoid / sum(sigmoid)
        weights = weights * self.route_scale * self.router_scale[...]
        return weights[:, : self.top_k], expert_ids, weights[:, self.top_k:]

    def __call__(self, x, expert_ids=None):
        """x [..., hidden] -> (y [..., hidden], expert ids [N, k] chosen for the N flattened tokens)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if expert_ids is not None:
            expert_ids = expert_ids.reshape(flat.shape[0], self.top_k)
        weights, expert_ids, shared_weights = self.route(flat, expert_ids)
        out = self.expert_outputs(flat, expert_ids, weights, shared_weights)
        return out.astype(x.dtype).reshape(shape), expert_ids

    def expert_outputs(self, x, expert_ids, weights, shared_weights):
        """The routed and shared experts' weighted sum, fp32 [N, hidden], for the N tokens x [N, hidden] routed
        (`route`). Serving views that add to the experts' products replace it (`serve.lora.experts`)."""
        out = experts(x, self.routed_experts(x.shape[0]), self.shared_experts(), expert_ids, weights,
                      shared_weights, backend=self.backend, mesh=self.mesh)
        apart = self.shared_apart(x, shared_weights)
        return out if apart is None else out + apart


def experts(x, routed, shared, expert_ids, weights, shared_weights, *, backend: Backend, mesh=None):
    """sum_k weights[n, k] * E_{ids[n, k]}(x[n]) + sum_s shared_weights[n, s] * E^sh_s(x[n]), in fp32 (the
    second sum left out for shared None).

    x [N, H]; routed / shared: (w_gate, w_up, w_down) of the E routed / S shared experts (routed may be an
    Fp8Experts or Nvfp4Experts: `inkling_jax.quant.moe`; the dense backend then runs its ragged formula);
    weights [N, k] and shared_weights [N, S] fp32. By the backend's `moe`; with a mesh whose `expert` axis
    is larger than 1, by expert parallelism (all-to-all dispatch and combine); with a `tensor` axis that divides
    the experts' width, every tensor shard runs its slice of the width and the partial outputs are summed (both
    in `inkling_jax.parallel.expert_parallel`).
    """
    backend = backend.resolve()
    if mesh is not None and mesh.size > 1 and backend.batch_invariant:
        raise ValueError("the batch-invariant MoE runs on one device, not on a mesh")
    if mesh is not None:
        if mesh.shape[parallel.AXIS] > 1:
            return parallel.experts_ep(x, routed, shared, expert_ids, weights, shared_weights, mesh, backend)
        if parallel.width_axis(mesh, routed, shared):
            return parallel.experts_tp(x, routed, shared, expert_ids, weights, shared_weights, mesh, backend)
    return local_experts(x, routed, shared, expert_ids, weights, shared_weights, backend)
