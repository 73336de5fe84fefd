"""NVFP4 routed experts for serving: the SwiGLU MoE FFN as W4A16 grouped matmuls (kernel_w4.py) on Hopper.

Hopper has no fp4 tensor cores, so the kernels turn the e2m1 codes into f16 in registers (exactly: see
`w4_codes.f16_planes`) and multiply by f16 activations. The weights take 5 bits per value (the 4-bit codes and
an f16 block scale per 16 values) against fp8's 8: 0.63 of fp8's memory (the kernels' times against fp8's:
docs/performance.md; kernel_w4.py says what bounds them). The format is NVFP4's (inkling_jax/checkpoint/nvfp4.py,
spec section 5.2): per expert and matrix a global fp32 scale2, per 16 input values an e4m3 block scale, per
value an e2m1 code:

    W[g] = code * block_scale * scale2[g]
    h = row_weight * silu(s2_13[g] * (x @ W_gate[g]^T)) * (s2_13[g] * (x @ W_up[g]^T))     (gate and up share
    y = s2_2[g] * (h @ W_down[g]^T)                                                         w13's scale2)

x and h are rounded to f16 before their products. Rows run in the slab layout of decode.in_slabs.
`moe_ffn_nvfp4_reference` is that formula in jnp (the CPU path of the model and the tests' contract). Forward only.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import interpret_default
from pallas_kernels.moe import decode, epilogues, kernel_w4, ops
from pallas_kernels.moe.groups import group_of_rows, row_groups, running_sum
from pallas_kernels.moe.kernel_w4 import W4Config, w4_gmm
from pallas_kernels.moe.w4_codes import BLOCK, PAIR, ROWS, SCALE_FACTOR, from_units, pack_codes, to_units, unpack_codes

E2M1_MAX, E4M3_MAX = 6.0, 448.0
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the e2m1 magnitudes 0 .5 1 1.5 2 3 4 6
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
WIDTH_MULTIPLE = 128  # the expert width: whole tiles of 2 x 64 output rows (gate/up) and whole k steps (down)
PREFILL_SLAB = 128  # tokens per slab without a bound, or above this one
# Tokens per slab for decode steps, by the step's bound: a group of more tokens takes several slabs. Smaller
# slabs won at decode sizes in a sweep (16 at 32 tokens, 32 at 128). The bound of the 32-token slabs leaves room
# above 128 because the server's all-rows decode step has max_num_seqs + 1 rows (129 for 128 sequences), which a
# bound of 128 sent to 128-token slabs
DECODE_SLABS = ((32, 16), (160, 32))  # (largest bound, slab tokens)
# The down projection's warpgroups each take two adjacent 64-row blocks (kernel_w4's paired_rows): its tiles
# have half the k steps of gate/up's (K is the expert width), so unpaired it paid a pipeline fill and an epilogue
# per tile for half the work; paired, a 32-row decode step's down kernels are faster with bit-identical outputs
PAIRED_DOWN = True


class Nvfp4Experts(NamedTuple):
    """G experts in the kernel layout (kernel_w4.py): w13 packed uint8 [G, 2 I / 64, H / 32, 8, 128] (gate and up
    rows in groups of 64), w2 packed [G, H / 64, I / 32, 8, 128]; their scales f16 [G, K / 16, rows / 64,
    matrices, 64] (block scale times 64) and scale2 fp32 [G]."""
    w13: jax.Array
    w13_scale: jax.Array
    w13_scale2: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    w2_scale2: jax.Array


def quantize_matrices(w):
    """w [G, M, rows, K] (M matrices sharing one scale2 per expert, [out, in] each) -> e2m1 codes uint8
    [G, M, rows, K], e4m3 block scales [G, M, rows, K / 16] and fp32 scale2 [G], as inkling_jax/nvfp4.quantize
    rounds them (nearest e2m1 value, ties to the smaller). Op by op, not jitted: as one XLA program on an H100,
    6% of its codes differed from the checkpoint format's (XLA rewrites the program's arithmetic)."""
    w = w.astype(jnp.float32)
    g, m, rows, k = w.shape
    blocks = w.reshape(g, m, rows, k // BLOCK, BLOCK)
    amax = jnp.abs(w).max(axis=(1, 2, 3))
    scale2 = jnp.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0)
    exact = jnp.abs(blocks).max(-1) / (E2M1_MAX * scale2[:, None, None, None])
    scale = jnp.minimum(exact, E4M3_MAX).astype(jnp.float8_e4m3fn)
    step = scale.astype(jnp.float32)[..., None] * scale2[:, None, None, None, None]
    scaled = jnp.where(step > 0, jnp.abs(blocks) / jnp.where(step > 0, step, 1.0), 0.0)
    magnitude = sum((scaled > t).astype(jnp.uint8) for t in _E2M1_MIDPOINTS)
    codes = magnitude | jnp.where(blocks < 0, 8, 0).astype(jnp.uint8)
    return codes.reshape(w.shape), scale, scale2.astype(jnp.float32)


def layout(codes, scale):
    """Codes [G, M, rows, K] and e4m3 scales [G, M, rows, K / 16] -> (packed uint8 [G, M rows / 64, K / 32, 8,
    128], f16 scales [G, K / 16, rows / 64, M, 64]) in kernel_w4's layout; NumPy arrays (on the host) or jax
    arrays."""
    g, m, rows, k = codes.shape
    by_group = codes.reshape(g, m, rows // ROWS, ROWS, k).transpose(0, 2, 1, 3, 4).reshape(g, m * rows, k)
    pairs = by_group.reshape(g, m * rows, k // PAIR, 2, BLOCK)
    packed = to_units(pack_codes(pairs[..., 0, :], pairs[..., 1, :]).reshape(g, m * rows, k // 2))
    scales = scale.astype(np.float16) * np.float16(SCALE_FACTOR)
    scales = scales.reshape(g, m, rows // ROWS, ROWS, k // BLOCK).transpose(0, 4, 2, 1, 3)
    return packed, scales


def from_checkpoint(packed, scale, scale2, *, gate_up: bool):
    """One routed-experts matrix as an NVFP4 checkpoint stores it (inkling_jax/checkpoint/nvfp4.py: packed uint8 [G,
    rows, K / 2] with the even column in the low nibble, e4m3 `scale` [G, rows, K / 16], fp32 `scale2` [G]) -> its three
    Nvfp4Experts fields, the same codes and scales (no requantisation), the width padded with zeros as
    `quantize_experts` pads it. gate_up: the checkpoint's w13, rows 2i gate and 2i + 1 up (-> w13, w13_scale,
    w13_scale2); else w2 [G, H, I / 2] (-> w2, w2_scale, w2_scale2). NumPy in, NumPy out."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    g, rows, k = codes.shape
    if gate_up:  # [G, 2, I, K]; pad I
        codes, scale = (a.reshape(g, rows // 2, 2, -1).transpose(0, 2, 1, 3) for a in (codes, scale))
        pads = [(0, 0), (0, 0), (0, -(rows // 2) % WIDTH_MULTIPLE), (0, 0)]
        codes, scale = np.pad(codes, pads), np.pad(scale, pads)
    else:  # [G, 1, H, I]; pad I, the contraction
        pad = -k % WIDTH_MULTIPLE
        codes = np.pad(codes[:, None], [(0, 0)] * 3 + [(0, pad)])
        scale = np.pad(scale[:, None], [(0, 0)] * 3 + [(0, pad // BLOCK)])
    return (*layout(codes, scale), np.asarray(scale2, np.float32))


def quantize_experts(w_gate, w_up, w_down) -> Nvfp4Experts:
    """w_gate, w_up [G, H, I], w_down [G, I, H] (any float dtype) -> Nvfp4Experts, the width padded with zeros
    (the padded SwiGLU columns are silu(0) * 0 = 0)."""
    w_gate, w_up, w_down = ops.pad_expert_width(w_gate, w_up, w_down, WIDTH_MULTIPLE)
    codes, scale, scale2 = quantize_matrices(jnp.stack([w_gate, w_up], 1).transpose(0, 1, 3, 2))
    w13, w13_scale = layout(codes, scale)
    codes, scale, scale2_down = quantize_matrices(w_down.transpose(0, 2, 1)[:, None])
    w2, w2_scale = layout(codes, scale)
    return Nvfp4Experts(w13, w13_scale, scale2, w2, w2_scale, scale2_down)


def dequantize(packed, scales, scale2, matrices: int):
    """The fp32 weights [G, matrices, rows, K] that kernel-layout tensors stand for."""
    packed = from_units(packed)
    g, mrows, half_k = packed.shape
    rows, k = mrows // matrices, 2 * half_k
    table = jnp.asarray(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), jnp.float32)
    pairs = packed.reshape(g, mrows, k // PAIR, BLOCK)
    values = table[jnp.stack(unpack_codes(pairs), axis=-2)].reshape(g, rows // ROWS, matrices, ROWS, k)
    values = values.transpose(0, 2, 1, 3, 4).reshape(g, matrices, rows, k // BLOCK, BLOCK)
    block = scales.astype(jnp.float32).transpose(0, 3, 2, 4, 1).reshape(g, matrices, rows, k // BLOCK)
    values = values * (block / SCALE_FACTOR)[..., None] * scale2[:, None, None, None, None]
    return values.reshape(g, matrices, rows, k)


def dequantize_experts(experts: Nvfp4Experts):
    """-> (w_gate, w_up [G, H, I], w_down [G, I, H]) in fp32 (I padded): the weights the NVFP4 ones stand for."""
    w13 = dequantize(experts.w13, experts.w13_scale, experts.w13_scale2, 2)
    w2 = dequantize(experts.w2, experts.w2_scale, experts.w2_scale2, 1)[:, 0]
    return w13[:, 0].transpose(0, 2, 1), w13[:, 1].transpose(0, 2, 1), w2.transpose(0, 2, 1)


def _row_scale2(experts: Nvfp4Experts, group_sizes, num_rows):
    g = row_groups(group_sizes, num_rows)
    return experts.w13_scale2[g], experts.w2_scale2[g]


def _swiglu(accs, cols):
    """cols: (routing weight, scale2) per token; gate and up share w13's scale2."""
    return epilogues.scaled_swiglu(accs, (cols[0], cols[1], cols[1]), axis=1)


def slab_tokens(max_group_rows: int | None) -> int:
    """Tokens per slab (the kernels' N) for a step whose groups hold at most max_group_rows tokens (None: any)."""
    if max_group_rows is None:
        return PREFILL_SLAB
    return next((slab for bound, slab in DECODE_SLABS if max_group_rows <= bound), PREFILL_SLAB)


@functools.partial(jax.jit, static_argnames=("max_group_rows", "slab", "interpret", "cfg"))
def moe_ffn_nvfp4(x, experts: Nvfp4Experts, group_sizes, row_weights, *, max_group_rows: int | None = None,
                  slab: int | None = None, interpret: bool | None = None, cfg: W4Config | None = None):
    """The module doc's y for rows x [M, H] sorted by expert, as two W4A16 kernels; [M, H] in x.dtype, zeros past
    sum(group_sizes). Each group's tokens are cut into slabs of `slab` tokens (static; default `slab_tokens`),
    a group that fits in one (max_group_rows <= slab: max_group_rows is a static bound on every group's size,
    such as the step's token count) taking exactly one. Untouched experts are never read."""
    interpret = interpret_default() if interpret is None else interpret
    slab = slab or slab_tokens(max_group_rows)
    one_slab_each = max_group_rows if max_group_rows is not None and max_group_rows <= slab else None
    cfg = cfg or kernel_w4.config_for(slab)
    s13, s2 = _row_scale2(experts, group_sizes, x.shape[0])

    def ffn(x_slabs, slab_sizes, row_vectors):
        num_slabs = x_slabs.shape[0] // slab
        used = running_sum(slab_sizes) // slab  # each group's slabs end here
        slab_group = group_of_rows(used, num_slabs)
        slab_fill = (jnp.arange(num_slabs) < used[-1]).astype(jnp.int32)
        rw, scale13, scale2 = (v.reshape(num_slabs, slab) for v in row_vectors)
        common = dict(slab_group=slab_group, slab_rows=slab_fill, cfg=cfg, interpret=interpret)
        h = w4_gmm(x_slabs.reshape(num_slabs, slab, -1).astype(jnp.float16), experts.w13, experts.w13_scale,
                   col_vectors=(rw, scale13), matrices=2, epilogue=_swiglu, out_dtype=jnp.float16, **common)
        y = w4_gmm(h, experts.w2, experts.w2_scale, col_vectors=(scale2,), matrices=1,
                   epilogue=functools.partial(epilogues.scaled, axis=1), out_dtype=x.dtype,
                   paired_rows=PAIRED_DOWN, **common)
        return y.reshape(num_slabs * slab, -1)

    return decode.in_slabs(x, group_sizes, (row_weights, s13, s2), one_slab_each, ffn, align=slab)


def moe_ffn_nvfp4_reference(x, experts: Nvfp4Experts, group_sizes, row_weights):
    """The module doc's formula in jnp on the dequantised weights (fp32 products of the f16-rounded operands);
    same contract as `moe_ffn_nvfp4`."""
    w13 = dequantize(experts.w13, experts.w13_scale, jnp.ones_like(experts.w13_scale2), 2)
    w2 = dequantize(experts.w2, experts.w2_scale, jnp.ones_like(experts.w2_scale2), 1)[:, 0]
    s13, s2 = _row_scale2(experts, group_sizes, x.shape[0])

    def mm(a, w):
        a = a.astype(jnp.float16).astype(jnp.float32)
        return jax.lax.ragged_dot(a, w.transpose(0, 2, 1), group_sizes, precision=jax.lax.Precision.HIGHEST)

    gate, up = mm(x, w13[:, 0]) * s13[:, None], mm(x, w13[:, 1]) * s13[:, None]
    h = gate * jax.nn.sigmoid(gate) * up * row_weights.astype(jnp.float32)[:, None]
    return (mm(h, w2) * s2[:, None]).astype(x.dtype)
