"""Building blocks: linear maps, RMSNorm and ShortConv.

Weights are stored the JAX way, `kernel [in, out]`, so `y = x @ kernel`; the loader transposes the hub's
`[out, in]` tensors once.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.nn import invariant, kernels
from pallas_kernels.attn_prologue.reference import head_rms_norm as rms_norm  # the one RMSNorm definition

INIT_STD = 0.02  # the reference initialiser's std, used for random (test and benchmark) weights


def normal(rngs: nnx.Rngs, shape, dtype):
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def swiglu(gate, up):
    """silu(gate) * up in fp32, cast back to gate's dtype."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


class Linear(nnx.Module):
    """Bias-free linear map (Inkling has no biases anywhere)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        self.kernel = nnx.Param(normal(rngs, (in_features, out_features), dtype))
        self.backend = backend  # which kernels run (`inkling_jax.backend`): the batch-invariant matmul or XLA's

    @classmethod
    def from_kernel(cls, kernel, backend: Backend) -> "Linear":
        """A Linear holding `kernel [in, out]` (no random draw), running `backend` (its source module's)."""
        linear = nnx.eval_shape(lambda: cls(*kernel.shape, dtype=kernel.dtype, rngs=nnx.Rngs(0), backend=backend))
        linear.kernel = nnx.Param(kernel)
        return linear

    def __call__(self, x):
        return kernels.matmul(x, self.kernel[...], backend=self.backend)


class RMSNorm(nnx.Module):
    """weight * x / rms(x): statistics in fp32, cast back to the input dtype before the (non 1+) weight."""

    def __init__(self, dim: int, eps: float, *, dtype, backend: Backend = Backend()):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.backend = backend  # which kernels run (`inkling_jax.backend`): the batch-invariant sum or XLA's

    def __call__(self, x):
        norm = invariant.rms_norm if self.backend.batch_invariant else rms_norm
        return norm(x, self.weight[...], self.eps)


class ShortConv(nnx.Module):
    """Depthwise causal conv of width 4 with its residual, in fp32 (its taps are kept in fp32 whatever the
    model dtype, as the reference does). Carries a state of the last `width - 1` inputs between chunks."""

    def __init__(self, channels: int, width: int, *, rngs: nnx.Rngs, split_channels: bool = False,
                 backend: Backend = Backend()):
        self.weight = nnx.Param(normal(rngs, (channels, width), jnp.float32))
        self.split_channels = split_channels  # heads x head_dim (K, V): split over `tensor` like the heads
        self.mesh = None  # set by `sharding.shard_model`
        self.backend = backend  # which kernels run (`inkling_jax.backend`)

    @property
    def history(self) -> int:
        return self.weight.shape[-1] - 1

    def __call__(self, x, state=None, segment_ids=None, lengths=None, keep_inputs: bool = False):
        """x [B, T, C] -> (y [B, T, C], new_state [B, width - 1, C]). With `keep_inputs` the returned state is
        the state followed by every input, [B, width - 1 + T, C]: the state after the first n tokens is its rows
        n .. n + width - 2 (speculative decoding keeps the state after the accepted tokens only)."""
        y, new_state = kernels.shortconv_prefill(x, self.weight[...], state, backend=self.backend,
                                                 segment_ids=segment_ids, lengths=lengths, mesh=self.mesh,
                                                 split_channels=self.split_channels)
        if keep_inputs:
            before = jnp.zeros_like(new_state) if state is None else state.astype(new_state.dtype)
            new_state = jnp.concatenate([before, x.astype(new_state.dtype)], axis=1)
        return y, new_state
