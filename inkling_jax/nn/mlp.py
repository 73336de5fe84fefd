"""The dense SwiGLU MLP (first layers, MTP blocks).

Gate and up projections are stored apart (`w_gate`, `w_up`); the hub interleaves them by row and the loader
de-interleaves. The SwiGLU is computed in fp32 and cast back.
"""

import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.nn import kernels
from inkling_jax.nn.layers import normal, swiglu


class DenseMLP(nnx.Module):
    def __init__(self, hidden: int, width: int, *, dtype, rngs: nnx.Rngs, backend: Backend = Backend()):
        self.w_gate = nnx.Param(normal(rngs, (hidden, width), dtype))
        self.w_up = nnx.Param(normal(rngs, (hidden, width), dtype))
        self.w_down = nnx.Param(normal(rngs, (width, hidden), dtype))
        self.global_scale = nnx.Param(jnp.ones((1,), dtype))
        self.backend = backend  # which kernels run (`inkling_jax.backend`): the batch-invariant matmul or XLA's

    def __call__(self, x, expert_ids=None):
        """x [..., hidden] -> (y [..., hidden], None)."""
        gate, up = self._gate_up(x)
        return self._down(swiglu(gate, up)) * self.global_scale[...], None

    def _gate_up(self, x):
        """(gate, up) projections of x. Serving forms replace the products (`inkling_jax.quant.mlp`)."""
        return self._product(x, self.w_gate[...]), self._product(x, self.w_up[...])

    def _down(self, h):
        return self._product(h, self.w_down[...])

    def _product(self, x, w):
        return kernels.matmul(x, w, backend=self.backend)
