"""NVFP4 dense weights for serving: the attention projections and the shared experts as W4A16 products.

A decode step of a few dozen rows is bound by reading weights, and fp8 gained nothing on the step's attention
and shared-expert products (see docs/performance.md). Held as NVFP4 they are read at 5 bits a value (the e2m1
code and its share of an f16 block scale) by the dense W4A16 product (pallas_kernels/dense_w4/: the routed
experts' kernel run as one expert): up to DECODE_TOKENS rows as one slab of tokens, more in prefill slabs.

Format, per matrix [in, out] (the model's `kernel` orientation): the e2m1 codes and f16 block scales of the
kernel layout (one group, one matrix: `nvfp4.layout`) with one fp32 global scale per output column. NVFP4's
global scale is per tensor; `quantize` sets every column of a matrix to the same one, and keeping it per column
lets fused matrices (`concatenate`: gate|up) keep each part's scale. The output rows are padded to a multiple of
64 and the input to whole 32-value pairs with zeros.

    y = (f16(x) @ (code * block_scale)^T, fp32 accumulation, bf16 out) * scale2

`Nvfp4Linear.__call__` runs the kernel when its backend's `moe` is "pallas" (`inkling_jax.backend`: the same
kernel as the routed experts) and the formula in jnp otherwise (`reference_product`; CPU tests). Forward only.

`Nvfp4LinearWithTwin`: the same matrix with an fp8 twin, the matrix dequantised and rounded to dense_fp8's format,
which products of more than TWIN_ROWS rows (prompt chunks, large batches) multiply instead: there the W4A16
kernel's f16 tensor-core work, not its bytes, is the bound, and fp8 tensor cores run at twice f16's rate. Built
from the NVFP4 values, so both forms carry the same quantised matrix up to fp8's rounding. It costs one byte per
weight.

A product with fewer output tiles than the GPU has SMs splits K so that every SM works (`kernel_product`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.backend import Backend
from inkling_jax.quant import dense_fp8
from inkling_jax.quant.form import ServingForm
from pallas_kernels._common import round_up
from pallas_kernels.dense_w4 import DECODE_TOKENS, dequantize_matrix, kernel_product, reference_product
from pallas_kernels.moe.nvfp4 import layout, quantize_matrices
from pallas_kernels.moe.w4_codes import ROWS

OUT_MULTIPLE = ROWS  # output rows are padded to this (one warpgroup's 64 rows)
K_MULTIPLE = 32  # input values per packed pair of NVFP4 blocks
TWIN_ROWS = DECODE_TOKENS  # products of more rows take the fp8 twin where there is one


class Nvfp4Linear(ServingForm):
    """y = x @ W for an NVFP4-held W [in_features, out_features] (module doc)."""

    def __init__(self, codes, block_scales, scale2, in_features: int, *, backend: Backend = Backend()):
        self.nvfp4_codes = nnx.Param(codes)  # uint8 [1, out_pad / 64, in_pad / 32, 8, 128] (kernel_w4's layout)
        self.nvfp4_scales = nnx.Param(block_scales)  # f16 [1, in_pad / 16, out_pad / 64, 1, 64]
        self.nvfp4_scale2 = nnx.Param(scale2)  # fp32 [out_features]
        self.in_features = in_features  # the codes hold it padded to a multiple of K_MULTIPLE
        self.backend = backend  # its `moe` picks the kernel or the formula

    @property
    def out_features(self) -> int:
        return self.nvfp4_scale2.shape[0]

    @classmethod
    def quantize(cls, kernel, *, backend: Backend = Backend()) -> Nvfp4Linear:
        """From a float matrix [in, out]; one global scale for the whole matrix, as NVFP4 sets it."""
        return cls(*_quantize(kernel), kernel.shape[0], backend=backend)

    @classmethod
    def concatenate(cls, parts: list[Nvfp4Linear]) -> Nvfp4Linear:
        """One matrix whose output columns are the parts' in order, each keeping its codes and scales (no
        requantisation). Every part but the last must have a multiple of 64 output columns (no padding inside)."""
        if len({p.in_features for p in parts}) != 1 or any(p.out_features % OUT_MULTIPLE for p in parts[:-1]):
            raise ValueError(f"NVFP4 matrices concatenate along their outputs only with one input width and "
                             f"multiples of {OUT_MULTIPLE} outputs before the last: "
                             f"{[(p.in_features, p.out_features) for p in parts]}")
        if len({type(p) for p in parts}) != 1:
            raise ValueError("NVFP4 matrices concatenate with fp8 twins on all of them or none")
        if len({p.backend for p in parts}) != 1:
            raise ValueError(f"NVFP4 matrices concatenate with one backend: {[p.backend for p in parts]}")
        return Nvfp4Linear(jnp.concatenate([p.nvfp4_codes[...] for p in parts], axis=1),
                           jnp.concatenate([p.nvfp4_scales[...] for p in parts], axis=2),
                           jnp.concatenate([p.nvfp4_scale2[...] for p in parts]), parts[0].in_features,
                           backend=parts[0].backend)

    def with_twin(self) -> Nvfp4LinearWithTwin:
        """This matrix with an fp8 twin for wide products (module doc)."""
        return Nvfp4LinearWithTwin(self, dense_fp8.Fp8Linear.quantize(self.dequantize()))

    def dequantize(self):
        """The float32 matrix [in, out] this stands for."""
        matrix = dequantize_matrix(self.nvfp4_codes[...], self.nvfp4_scales[...])
        return matrix[:self.in_features, :self.out_features] * self.nvfp4_scale2[...]

    def __call__(self, x):
        return matmul(x, self.nvfp4_codes[...], self.nvfp4_scales[...], self.nvfp4_scale2[...], backend=self.backend)


class Nvfp4LinearWithTwin(Nvfp4Linear):
    """An NVFP4 matrix and its fp8 twin `twin` (an Fp8Linear), which products of more than TWIN_ROWS rows take."""

    def __init__(self, linear: Nvfp4Linear, twin: dense_fp8.Fp8Linear):
        super().__init__(linear.nvfp4_codes[...], linear.nvfp4_scales[...], linear.nvfp4_scale2[...],
                         linear.in_features, backend=linear.backend)
        self.twin = twin

    @classmethod
    def concatenate(cls, parts: list[Nvfp4LinearWithTwin]) -> Nvfp4LinearWithTwin:
        """As `Nvfp4Linear.concatenate`, and the twins alike."""
        return cls(Nvfp4Linear.concatenate(parts), dense_fp8.Fp8Linear.concatenate([p.twin for p in parts]))

    def with_twin(self) -> Nvfp4LinearWithTwin:
        return self

    def __call__(self, x):
        if x.size // x.shape[-1] > TWIN_ROWS:
            return self.twin(x)
        return super().__call__(x)


def matmul(x, codes, block_scales, scale2, *, backend: Backend):
    """x [..., in] @ the matrix (codes, block_scales, scale2 [out]) stand for -> [..., out] in x.dtype: the kernel
    when the backend's `moe` is "pallas", else the jnp formula."""
    rows = x.reshape(-1, x.shape[-1])
    rows = jnp.pad(rows, ((0, 0), (0, codes.shape[2] * K_MULTIPLE - rows.shape[1])))
    use = backend.resolve()
    if use.moe == "pallas":
        acc = kernel_product(rows, codes, block_scales, interpret=use.interpret)
    else:
        acc = reference_product(rows, codes, block_scales)
    y = acc[:, :scale2.shape[0]] * scale2
    return y.astype(x.dtype).reshape(*x.shape[:-1], scale2.shape[0])


@jax.jit
def _quantize(kernel):
    k, out = kernel.shape
    w = jnp.pad(kernel.T, ((0, round_up(out, OUT_MULTIPLE) - out), (0, round_up(k, K_MULTIPLE) - k)))
    codes, block_scale, scale2 = quantize_matrices(w[None, None])
    codes, block_scales = layout(codes, block_scale)
    return codes, block_scales, jnp.broadcast_to(scale2, (out,))
