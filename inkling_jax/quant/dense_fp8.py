"""fp8 (e4m3) dense weights for serving: the dense MLPs and the LM head as W8A8 XLA dots (`Fp8Linear`).

A decode step of a few dozen rows is bound by reading weights, so halving their bytes pays where the matmul
reads near the bandwidth: the LM head and the dense MLPs. The attention projections are bound by their launch,
not their bytes, at these sizes, so they stay in the model's dtype (see docs/performance.md).

Format: values [out, in] (contraction axis minor, the layout fp8 tensor cores read without a transpose) with
one fp32 scale per output column (amax / 448); activations are quantised per row on the fly
(`pallas_kernels.moe.fp8.quantize_rows`), so y[n, o] = sx[n] * s[o] * (qx[n] . q[o]). Forward only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.quant.form import ServingForm
from pallas_kernels.moe.fp8 import quantize_rows


@functools.partial(jax.jit, static_argnames="transpose")
def quantize(w, transpose: bool = False):
    """w [out, in] ([in, out] with transpose) -> (e4m3 values [out, in], fp32 scale [out]); an all-zero column
    gets scale 1. An output column's scale is its row's in the [out, in] layout, as for activations."""
    return quantize_rows(w.T if transpose else w)


def matmul(x, values, scale):
    """x [..., in] @ the weight that (values [out, in], scale [out]) stand for -> [..., out] in x.dtype."""
    rows = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows(rows)
    acc = jax.lax.dot_general(qx, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (acc * sx[:, None] * scale).astype(x.dtype).reshape(*x.shape[:-1], values.shape[0])


class Fp8Linear(ServingForm):
    """y = x @ W for an fp8-held W (module doc): `values [out, in]`, `scale [out]`."""

    def __init__(self, values, scale):
        self.values = nnx.Param(values)
        self.scale = nnx.Param(scale)

    @classmethod
    def quantize(cls, kernel) -> Fp8Linear:
        """From a float matrix [in, out] (a `Linear`'s kernel)."""
        return cls(*quantize(kernel, transpose=True))

    @classmethod
    def concatenate(cls, parts: list[Fp8Linear]) -> Fp8Linear:
        """One matrix whose output columns are the parts' in order, each keeping its values and scales (as
        quantising the concatenated matrix gives: the scales are per output column)."""
        return cls(jnp.concatenate([p.values[...] for p in parts]), jnp.concatenate([p.scale[...] for p in parts]))

    def __call__(self, x):
        return matmul(x, self.values[...], self.scale[...])
