"""Differentiable grouped matmul and SwiGLU MoE FFN over rows sorted by group (custom VJPs on the kernels).

grouped_matmul backward: dx = dy @ w[g]^T (the same kernel, weights transposed), dw[g] = x_g^T @ dy_g (the
per-group transposed kernel).

moe_ffn forward: one fused kernel for gate/up (both tiles per k step, SwiGLU and the routing weight in the
epilogue), then the down projection. The training forward also stores the gate/up pre-activations so the
backward needs no recompute. Backward: dh = dy @ w_down^T; the SwiGLU backward elementwise in fp32 (XLA);
dx = dgate @ w_gate^T + dup @ w_up^T in one kernel; three weight-gradient kernels.

`MatmulKernels` picks jax's own Mosaic-GPU ragged dot (`jax_mgpu.py`) instead of ours for the forward's or the
backward's matmuls; the custom VJPs (residuals, SwiGLU and its backward) stay these. jax's forward computes
gate and up as two products and the SwiGLU in XLA; its dx one product over [dgate | dup] and [w_gate | w_up].
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default
from pallas_kernels.moe import epilogues, jax_mgpu, matmuls
from pallas_kernels.moe.jax_mgpu import JAX_MGPU, MatmulKernels
from pallas_kernels.moe.tuning import KernelConfigs

_PLAIN = ((0, 0, 0),)


def _check(x, *weights):
    for w in weights:
        if w.dtype != x.dtype:
            raise TypeError(f"x and weights must share a dtype, got {x.dtype} and {w.dtype}")


def pad_expert_width(w_gate, w_up, w_down, multiple: int | None = None):
    """Zero-pads the expert width (I) to a multiple of `multiple` (default: a 128-byte span of the weights'
    dtype), for a tiny model's experts. The padded SwiGLU columns are silu(0) * 0 = 0, so the output is
    unchanged; the padding's gradients are dropped."""
    multiple = multiple or matmuls.SPAN_BYTES // jnp.dtype(w_gate.dtype).itemsize
    pad = -w_gate.shape[-1] % multiple
    if not pad:
        return w_gate, w_up, w_down
    cols = [(0, 0), (0, 0), (0, pad)]
    return jnp.pad(w_gate, cols), jnp.pad(w_up, cols), jnp.pad(w_down, [(0, 0), (0, pad), (0, 0)])


def _mm(lhs, weights, group_sizes, configs, interpret, use, *, role="gmm", transpose_rhs=False, pairs=_PLAIN):
    """One accumulator's grouped matmul by `use` (a MatmulKernels field)."""
    if use == JAX_MGPU:
        return jax_mgpu.gmm(lhs, weights, group_sizes, transpose_rhs=transpose_rhs, pairs=pairs,
                            interpret=interpret)
    cfg = configs.get(role, lhs[0].dtype)
    return matmuls.gmm(lhs, weights, group_sizes, transpose_rhs=transpose_rhs, pairs=pairs,
                       epilogue=epilogues.plain, num_outputs=1, cfg=cfg, interpret=interpret)[0]


def _wgrad(x, dy, group_sizes, configs, interpret, use, dtype):
    if use == JAX_MGPU:
        return jax_mgpu.tgmm(x, dy, group_sizes, interpret=interpret).astype(dtype)
    return matmuls.tgmm(x, dy, group_sizes, cfg=configs.get("wgrad", x.dtype), interpret=interpret).astype(dtype)


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "interpret", "configs", "kernels"))
def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, interpret: bool | str | None = None,
                   configs: KernelConfigs | None = None, kernels: MatmulKernels | None = None):
    """out[rows of g] = x[rows of g] @ w[g]; like `jax.lax.ragged_dot(x, w, group_sizes)`.

    Args:
      x: [M, K], rows sorted by group. w: [G, K, N] (same dtype), or [G, N, K] with `transpose_rhs` (out = x @
        w[g]^T: a weight stored [out, in], such as the LM head, is read as it lies, not transposed first).
        group_sizes: [G] int32, sum <= M; rows past the sum produce zeros.
      interpret: None picks compiled Mosaic GPU on a GPU backend and the portable interpreted kernel elsewhere;
        "mosaic" runs the Mosaic-GPU kernels in Pallas's GPU interpreter (slow; checks the GPU code on CPU).
      configs: tile overrides (`tuning.KernelConfigs`).
      kernels: ours or jax's Mosaic-GPU ragged dot for the forward and for the backward (`MatmulKernels`, default
        ours; jax's runs compiled only, on 16-bit operands).
    Returns:
      [M, N] in x.dtype (fp32 accumulation). Differentiable in x and w.
    """
    _check(x, w)
    interpret = interpret_default() if interpret is None else interpret
    return _grouped_matmul(x, w, group_sizes, transpose_rhs, interpret, configs or KernelConfigs(),
                           kernels or MatmulKernels())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _grouped_matmul(x, w, group_sizes, transpose_rhs, interpret, configs, kernels):
    return _mm([x], [w], group_sizes, configs, interpret, kernels.forward, transpose_rhs=transpose_rhs)


def _grouped_matmul_fwd(x, w, group_sizes, transpose_rhs, interpret, configs, kernels):
    return _mm([x], [w], group_sizes, configs, interpret, kernels.forward, transpose_rhs=transpose_rhs), \
        (x, w, group_sizes)


def _grouped_matmul_bwd(transpose_rhs, interpret, configs, kernels, res, dy):
    x, w, group_sizes = res
    dx = _mm([dy], [w], group_sizes, configs, interpret, kernels.backward, transpose_rhs=not transpose_rhs)
    dw = _wgrad(dy, x, group_sizes, configs, interpret, kernels.backward, w.dtype) if transpose_rhs else \
        _wgrad(x, dy, group_sizes, configs, interpret, kernels.backward, w.dtype)
    return dx, dw, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _gate_up(x, w_gate, w_up, group_sizes, row_weights, configs, interpret, use, keep_preactivations):
    """[h] or [h, gate, up] in x.dtype: one fused kernel (ours), or two products and the SwiGLU in XLA."""
    if use == JAX_MGPU:
        accs = [_mm([x], [w], group_sizes, configs, interpret, use).astype(jnp.float32) for w in (w_gate, w_up)]
        outs = epilogues.swiglu(accs, [row_weights.astype(jnp.float32)], keep_preactivations=keep_preactivations)
        return [o.astype(x.dtype) for o in outs]
    return matmuls.gmm([x], [w_gate, w_up], group_sizes, transpose_rhs=False, pairs=((0, 0, 0), (0, 1, 1)),
                       epilogue=functools.partial(epilogues.swiglu, keep_preactivations=keep_preactivations),
                       num_outputs=3 if keep_preactivations else 1, cfg=configs.get("swiglu", x.dtype),
                       interpret=interpret, row_inputs=(row_weights,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def moe_ffn_core(x, w_gate, w_up, w_down, group_sizes, row_weights, interpret, configs, kernels):
    """`moe_ffn` without the decode dispatch (positional static args; used by ffn and decode)."""
    (h,) = _gate_up(x, w_gate, w_up, group_sizes, row_weights, configs, interpret, kernels.forward, False)
    return _mm([h], [w_down], group_sizes, configs, interpret, kernels.forward)


def moe_ffn_core_fwd(x, w_gate, w_up, w_down, group_sizes, row_weights, interpret, configs, kernels):
    """`moe_ffn_core` differentiated: its output and the residuals its backward reads."""
    h, gate, up = _gate_up(x, w_gate, w_up, group_sizes, row_weights, configs, interpret, kernels.forward, True)
    out = _mm([h], [w_down], group_sizes, configs, interpret, kernels.forward)
    return out, (x, w_gate, w_up, w_down, group_sizes, row_weights, h, gate, up)


def swiglu_backward(dh, gate, up, row_weights, dtype):
    """Cotangents of h = row_weight * silu(gate) * up, in fp32: (dgate, dup) in dtype, drow_weight in fp32."""
    gate, up, dh = gate.astype(jnp.float32), up.astype(jnp.float32), dh.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_rw = jnp.sum(dh * silu * up, axis=-1)
    da = dh * row_weights.astype(jnp.float32)[:, None]
    dgate = da * up * sig * (1 + gate * (1 - sig))
    return dgate.astype(dtype), (da * silu).astype(dtype), d_rw


def moe_ffn_core_bwd(interpret, configs, kernels, res, dy):
    x, w_gate, w_up, w_down, group_sizes, row_weights, h, gate, up = res
    use = kernels.backward
    dh = _mm([dy], [w_down], group_sizes, configs, interpret, use, transpose_rhs=True)
    dgate, dup, d_rw = swiglu_backward(dh, gate, up, row_weights, x.dtype)
    dx = _mm([dgate, dup], [w_gate, w_up], group_sizes, configs, interpret, use, role="gmm_pairs",
             transpose_rhs=True, pairs=((0, 0, 0), (1, 1, 0)))
    return (dx,
            _wgrad(x, dgate, group_sizes, configs, interpret, use, w_gate.dtype),
            _wgrad(x, dup, group_sizes, configs, interpret, use, w_up.dtype),
            _wgrad(h, dy, group_sizes, configs, interpret, use, w_down.dtype),
            None,
            d_rw.astype(row_weights.dtype))


moe_ffn_core.defvjp(moe_ffn_core_fwd, moe_ffn_core_bwd)
