"""fp8 (e4m3) dense weights for serving: the dense MLPs and the LM head as W8A8 XLA dots.

A decode step of a few dozen rows is bound by reading weights, so halving their bytes pays where the matmul
reads near the bandwidth. On one H200 (bench/dense_matmuls.py --fp8, 32 rows) XLA's fp8 x fp8 dot took the LM
head from 606 to 363 us and the dense MLP's products from ~105 to ~72-86 us; the attention projections are
bound by their launch, not their bytes, at these sizes (no gain), so they stay in the model's dtype
(`InklingModel.quantize_dense`).

Format: values [out, in] (contraction axis minor, the layout fp8 tensor cores read without a transpose) with
one fp32 scale per output column (amax / 448); activations are quantised per row on the fly
(`pallas_kernels.moe.fp8.quantize_rows`), so y[n, o] = sx[n] * s[o] * (qx[n] . q[o]). Forward only.
"""

import functools

import jax
import jax.numpy as jnp

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

