"""Batch-invariant arithmetic (`Backend.batch_invariant`): each row's result is computed by the same operations in
the same order however many rows there are and wherever the row sits, so a token's logits do not depend on the
batch, the concurrency or the chunking.

XLA's own reductions and dots do not promise that: on CPU a row of `x.sum(-1)` changes once there are more than a
dozen rows, and a row of `X[:M] @ W` with M (on the H200 too: docs/rl.md). Here
- sums are halving trees of elementwise adds (`tree_sum`), on which RMSNorm, softmax and log-softmax are built;
- matmuls run the grouped-matmul kernel (`pallas_kernels.moe`) as one group: each output element accumulated
  over K in one fixed order (the same K blocks whatever the tile's rows and columns), no split of K, rows padded
  to the tile;
- the routed experts run its SwiGLU kernels on the rows sorted by expert (never the decode slab layout, whose
  slabs follow the row count): a row block shared by several experts adds exact zeros for the rows of the others.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe import ops
from pallas_kernels.moe.jax_mgpu import MatmulKernels
from pallas_kernels.moe.tuning import GmmConfig, KernelConfigs

# The kernels take widths that are multiples of this (a tiny model's router, head or projections are padded).
WIDTH_MULTIPLE = 16
# Up to one 64-row tile (decode steps), bf16 products take tiles of one warpgroup over 128 columns: the default
# 128 x 128 tile leaves most SMs idle on a skinny product. The K blocks stay those of the default (64), so the
# bits do not change. Chosen at 33 rows on one H200 (2026-12-05); `python -m benchmarks.invariant_matmul` times
# both tiles against XLA's dot and checks the bits (docs/performance.md, "RL"). Steps of up to as many tokens run
# the routed experts at the kernels' decode tiles (at 33 tokens, top-6 of 32 `bench` experts on one H100: 1.6 ms
# against 3.0 at the defaults, the same bits).
DECODE_ROWS = 64
DECODE_TILES = KernelConfigs(gmm=GmmConfig(compute_wgs=1, block_n=128, stages=6, grid_tile_width=1))


def tree_sum(x, axis: int = -1, keepdims: bool = False):
    """The sum over `axis` as a halving tree of elementwise adds (zero-padded to a power of two): every element's
    order of additions is fixed by the axis' length alone."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return jnp.moveaxis(x, -1, axis) if keepdims else x[..., 0]


def rms_norm(x, weight, eps):
    """`attn_prologue.reference.head_rms_norm` with the mean of squares as a `tree_sum`. The barriers keep XLA
    from reassociating a product by the row's rsqrt with the products around it (x's own, the weight's), which
    it does where that rsqrt is a scalar (one row of one token: a decode step of one sequence) and not
    otherwise. (Fused multiply-adds are another matter: barriers do not reach LLVM, see
    `backend.NO_FMA_CPU_FLAG`.)"""
    xf = jax.lax.optimization_barrier(x.astype(jnp.float32))
    mean = tree_sum(xf * xf, keepdims=True) / x.shape[-1]
    normed = jax.lax.optimization_barrier(xf * jax.lax.rsqrt(mean + eps))
    return jax.lax.optimization_barrier((weight * normed.astype(x.dtype)).astype(x.dtype))


def log_softmax(x):
    """`jax.nn.log_softmax` over the last axis, its sum a `tree_sum` (the max is exact in any order)."""
    shifted = x - jax.lax.stop_gradient(x.max(-1, keepdims=True))
    return shifted - jnp.log(tree_sum(jnp.exp(shifted), keepdims=True))


def softmax(x):
    """`jax.nn.softmax` over the last axis, its sum a `tree_sum`."""
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
    return e / tree_sum(e, keepdims=True)


def matmul(x, w, *, interpret: bool, transposed: bool = False):
    """x [..., K] @ w [K, N] (or w [N, K] `transposed`: x @ w^T, the weight read as it lies) by the grouped-matmul
    kernel as one group. K and N are zero-padded to WIDTH_MULTIPLE where needed (the padding adds exact zeros).
    Its gradient is XLA's dot's: only the values must not depend on the rows (the logprobs that rollouts and the
    trainer compare), not the gradient's."""
    def kernel(x, w):
        n, k = w.shape if transposed else w.shape[::-1]
        rows = x.reshape(-1, k).astype(w.dtype)
        pad_k, pad_n = -k % WIDTH_MULTIPLE, -n % WIDTH_MULTIPLE
        if pad_k or pad_n:
            rows = jnp.pad(rows, ((0, 0), (0, pad_k)))
            w = jnp.pad(w, ((0, pad_n), (0, pad_k)) if transposed else ((0, pad_k), (0, pad_n)))
        out = one_group(rows, w, tiles(rows.shape[0], w.dtype), transposed=transposed, interpret=interpret)
        return out[:, :n].reshape(*x.shape[:-1], n)

    def dot(x, w):
        return x.astype(w.dtype) @ (w.T if transposed else w)
    return with_gradient_of(kernel, dot)(x, w)


def one_group(rows, w, configs: KernelConfigs, *, transposed: bool, interpret):
    """rows [M, K] @ w [K, N] (or w [N, K] `transposed`) by the grouped-matmul kernel as one group at tiles
    `configs`; K and N multiples of WIDTH_MULTIPLE."""
    sizes = jnp.full((1,), rows.shape[0], jnp.int32)
    return ops.grouped_matmul(rows, w[None], sizes, transpose_rhs=transposed, interpret=interpret, configs=configs)


def tiles(rows: int, dtype) -> KernelConfigs:
    """The kernel's tiles for a product of `rows` rows (static): `DECODE_TILES` for bf16 up to `DECODE_ROWS`, else
    the kernel's defaults."""
    return DECODE_TILES if rows <= DECODE_ROWS and jnp.dtype(dtype) == jnp.bfloat16 else KernelConfigs()


def with_gradient_of(forward, backward):
    """A function whose value is forward(*args) and whose gradient is backward's (the same function computed in
    another way)."""
    fn = jax.custom_vjp(lambda *args: forward(*args))
    fn.defvjp(lambda *args: (forward(*args), args), lambda args, cotangent: jax.vjp(backward, *args)[1](cotangent))
    return fn


@functools.cache
def expert_ffn(interpret: bool, decode: bool):
    """The routed experts on rows sorted by expert, as `moe_dispatch.grouped_ffn` returns them: the SwiGLU and
    down-projection kernels at the kernels' decode tiles (`decode`: a step of up to `DECODE_ROWS` tokens) or
    their defaults. Both walk K in the same blocks, so a row's output does not depend on which. Jitted, as the
    kernels' public entries are (`pallas_kernels`), and one function per argument pair, so that layers share it."""
    configs = KernelConfigs(decode=decode)

    @jax.jit
    def ffn(rows, w_gate, w_up, w_down, group_sizes, row_weights):
        w_gate, w_up, w_down = ops.pad_expert_width(w_gate, w_up, w_down)
        return ops.moe_ffn_core(rows, w_gate, w_up, w_down, group_sizes, row_weights, interpret, configs,
                                MatmulKernels())  # ours, at fixed K blocks
    return ffn


def combine_top_k(y, num_tokens: int, top_k: int):
    """The weighted expert outputs of each token's top-k copies, [N * k, H] in token-major order, summed per
    token in fp32 by a `tree_sum` over k."""
    return tree_sum(y.astype(jnp.float32).reshape(num_tokens, top_k, -1), axis=1)
