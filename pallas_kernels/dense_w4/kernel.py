"""The dense W4A16 product on the routed experts' W4A16 kernel: one matrix, run as one expert of one group."""

import functools
import operator

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default, round_up
from pallas_kernels.dense_w4.tuning import DECODE_TOKENS
from pallas_kernels.moe import epilogues, kernel_w4
from pallas_kernels.moe.nvfp4 import PREFILL_SLAB
from pallas_kernels.moe.w4_codes import ROWS


@functools.partial(jax.jit, static_argnames=("interpret", "cfg", "k_splits"))
def kernel_product(rows, codes, block_scales, *, interpret: bool | None = None, cfg=None,
                   k_splits: int | None = None):
    """f16(rows [M, in_pad]) @ (code * block_scale), [M, out_pad] fp32 (rounded to bf16 on the way): up to
    DECODE_TOKENS rows as one slab, more in slabs of PREFILL_SLAB rows. A slab with fewer output tiles than the
    GPU has SMs splits K (k_splits; None: `kernel_w4.k_splits_to_fill`) and sums the bf16 partials in fp32."""
    interpret = interpret_default() if interpret is None else interpret
    m, k = rows.shape
    out_rows = codes.shape[1] * ROWS
    n = round_up(m, kernel_w4.N_ALIGN) if m <= DECODE_TOKENS else PREFILL_SLAB
    slabs = -(-m // n)
    cfg = cfg or kernel_w4.config_for(n)
    if k_splits is None:
        k_splits = kernel_w4.k_splits_to_fill(slabs * out_rows // (cfg.compute_wgs * ROWS), k, cfg, interpret)
    x = jnp.pad(rows, ((0, slabs * n - m), (0, 0))).astype(jnp.float16).reshape(slabs, n, k)
    out = kernel_w4.w4_gmm(x, codes, block_scales, slab_group=jnp.zeros((slabs,), jnp.int32),
                           slab_rows=jnp.full((slabs,), n, jnp.int32), col_vectors=(), matrices=1,
                           epilogue=epilogues.plain, out_dtype=jnp.bfloat16, cfg=cfg, interpret=interpret,
                           k_splits=k_splits)
    if k_splits > 1:  # elementwise adds, which XLA fuses into the caller's scale
        out = functools.reduce(operator.add, [part.astype(jnp.float32) for part in out])
    return out.reshape(slabs * n, out_rows)[:m].astype(jnp.float32)
