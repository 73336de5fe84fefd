"""fp8 (e4m3) routed experts for serving: the SwiGLU MoE FFN as W8A8 grouped matmuls on Hopper's fp8 tensor cores.

A decode step at tens of rows reads nearly every routed expert, so its time is the experts' bytes over the read
bandwidth; fp8 weights halve those bytes. The format:
- weights: e4m3 values with one fp32 scale per expert and matrix (amax / 448), stored K-minor ([G, N, K]: fp8
  wgmma reads both operands K-major), the expert width zero-padded to a multiple of 128;
- activations: each row quantised on the fly with its own scale (amax / 448), before each of the two matmuls.
Both scales of an output row are known once its expert is (rows are sorted by expert), so they reach the kernels'
epilogues as row vectors:

    h = row_weight * silu(sx * s_gate[g] * (qx @ Q_gate[g]^T)) * (sx * s_up[g] * (qx @ Q_up[g]^T))
    y = sh * s_down[g] * (qh @ Q_down[g]^T)        (qh, sh: h quantised per row)

Mosaic GPU has no select on 8-bit registers, so the kernels cannot zero the rows of other experts in a row block
that straddles two; instead every expert's rows are padded to whole row blocks first (decode.in_slabs): at most
127 padding rows per expert, a few percent more rows at prefill sizes.

`moe_ffn_fp8_reference` is that formula in jnp (the CPU path of the model and the tests' contract). Forward only.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default
from pallas_kernels.moe import decode, epilogues, matmuls, ops
from pallas_kernels.moe.ffn import DECODE_MAX_ROWS
from pallas_kernels.moe.groups import row_groups
from pallas_kernels.moe.tuning import KernelConfigs

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
WIDTH_MULTIPLE = 128  # the expert width is the down projection's K: whole 128-byte K tiles


class Fp8Experts(NamedTuple):
    """G experts in fp8; values K-minor: gate and up [G, I, H], down [G, H, I]; scales fp32 [G]."""
    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_scale: jax.Array
    up_scale: jax.Array
    down_scale: jax.Array


def _scale(amax):
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)


def quantize_rows(x, axis_name: str | None = None):
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M]) with x ~ q * scale; a zero row gets scale 1. axis_name: a mesh
    axis over which the rows' columns are split (inside shard_map): the scale is then the whole row's."""
    amax = jnp.abs(x.astype(jnp.float32)).max(axis=-1)
    scale = _scale(amax if axis_name is None else jax.lax.pmax(amax, axis_name))
    return (x.astype(jnp.float32) / scale[:, None]).astype(E4M3), scale


def _quantize_matrix(w):
    """w [G, K, N] -> (e4m3 values K-minor [G, N, K], fp32 scale [G])."""
    w = w.astype(jnp.float32)
    scale = _scale(jnp.abs(w).max(axis=(1, 2)))
    return (w / scale[:, None, None]).astype(E4M3).transpose(0, 2, 1), scale


def quantize_experts(w_gate, w_up, w_down) -> Fp8Experts:
    """w_gate, w_up [G, H, I], w_down [G, I, H] (any float dtype) -> Fp8Experts, the width padded (zeros: the
    padded SwiGLU columns are silu(0) * 0 = 0)."""
    padded = ops.pad_expert_width(w_gate, w_up, w_down, WIDTH_MULTIPLE)
    (gate, sg), (up, su), (down, sd) = (_quantize_matrix(w) for w in padded)
    return Fp8Experts(gate, up, down, sg, su, sd)


def dequantize_experts(experts: Fp8Experts):
    """-> (w_gate, w_up [G, H, I], w_down [G, I, H]) in fp32 (I padded): the weights the fp8 ones stand for."""
    def values(q, scale):
        return q.astype(jnp.float32).transpose(0, 2, 1) * scale[:, None, None]
    return (values(experts.gate, experts.gate_scale), values(experts.up, experts.up_scale),
            values(experts.down, experts.down_scale))


def _row_scales(experts: Fp8Experts, group_sizes, num_rows):
    """Each row's expert's (gate, up, down) weight scale; rows of no expert take the last expert's (their output
    is 0)."""
    g = row_groups(group_sizes, num_rows)
    return experts.gate_scale[g], experts.up_scale[g], experts.down_scale[g]


@functools.partial(jax.jit, static_argnames=("max_group_rows", "width_axis", "interpret", "configs"))
def moe_ffn_fp8(x, experts: Fp8Experts, group_sizes, row_weights, *, max_group_rows: int | None = None,
                width_axis: str | None = None, interpret: bool | str | None = None,
                configs: KernelConfigs | None = None):
    """The module doc's h and y for rows x [M, H] sorted by expert (bf16), as two fp8 grouped-matmul kernels;
    [M, H] in x.dtype, zeros past sum(group_sizes). With max_group_rows (static, a bound on every group's size:
    the step's token count) of at most DECODE_MAX_ROWS, the rows run in the decode slab layout. width_axis:
    inside a shard_map whose shards hold slices of the experts' width over that axis, h's rows are quantised with
    their whole row's scale, so the partial outputs add up to the unsplit result."""
    interpret = interpret_default() if interpret is None else interpret
    decode_layout = max_group_rows is not None and max_group_rows <= DECODE_MAX_ROWS
    configs = configs or KernelConfigs(decode=decode_layout)
    align = max(configs.get(role, E4M3).block_rows for role in ("swiglu", "gmm"))

    def ffn(qx, sizes, row_vectors):
        row_weights, gate_scale, up_scale, down_scale = row_vectors
        common = dict(transpose_rhs=True, num_outputs=1, interpret=interpret, out_dtype=x.dtype, mask_rows=False)
        (h,) = matmuls.gmm([qx], [experts.gate, experts.up], sizes, pairs=((0, 0, 0), (0, 1, 1)),
                           epilogue=epilogues.scaled_swiglu, cfg=configs.get("swiglu", E4M3),
                           row_inputs=(row_weights, gate_scale, up_scale), **common)
        qh, sh = quantize_rows(h, width_axis)
        (y,) = matmuls.gmm([qh], [experts.down], sizes, pairs=((0, 0, 0),), epilogue=epilogues.scaled,
                           cfg=configs.get("gmm", E4M3), row_inputs=(sh * down_scale,), **common)
        return y

    # x is quantised, and each row's scales are found, before the rows are laid out in slabs: the slabs' padding
    # rows (most rows at decode sizes) are then copied as fp8 and zero scales, never quantised or searched.
    qx, sx = quantize_rows(x)
    gate_scale, up_scale, down_scale = _row_scales(experts, group_sizes, x.shape[0])
    return decode.in_slabs(qx, group_sizes, (row_weights, sx * gate_scale, sx * up_scale, down_scale),
                           max_group_rows if decode_layout else None, ffn, align=align)


def moe_ffn_fp8_reference(x, experts: Fp8Experts, group_sizes, row_weights, *, width_axis: str | None = None):
    """The module doc's formula in jnp (ragged_dot on the fp8 values, fp32 accumulation); same contract as
    `moe_ffn_fp8`."""
    def mm(q, values):
        return jax.lax.ragged_dot(q.astype(jnp.float32), values.astype(jnp.float32).transpose(0, 2, 1),
                                  group_sizes, precision=jax.lax.Precision.HIGHEST)

    gate_scale, up_scale, down_scale = _row_scales(experts, group_sizes, x.shape[0])
    qx, sx = quantize_rows(x)
    gate = mm(qx, experts.gate) * (sx * gate_scale)[:, None]
    up = mm(qx, experts.up) * (sx * up_scale)[:, None]
    h = (jax.nn.silu(gate) * up * row_weights.astype(jnp.float32)[:, None]).astype(x.dtype)
    qh, sh = quantize_rows(h, width_axis)
    return (mm(qh, experts.down) * (sh * down_scale)[:, None]).astype(x.dtype)
