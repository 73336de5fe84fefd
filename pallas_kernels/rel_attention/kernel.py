"""Relative flash attention for Inkling: public entry point, padding, and the custom VJP.

Same math as `reference.rel_attention` with q_pos = q_offset + arange(T) and k_pos = arange(S). The relative
bias r_i . P[:, i - j] is built per tile from r and P (see tiles.py) and never stored as [H, T, S] or
[T, H, E]; tiles entirely beyond the extent run as plain attention, tiles outside the sliding window are never
visited. Where they apply and were measured faster (`plan`: full layers), the forward, dK/dV and the dQ of the
key tiles without bias are Mosaic GPU (wgmma) kernels (mgpu_forward.py, mgpu_dkdv.py, mgpu_dq.py); the kernels
of forward.py and backward.py, which lower through Pallas' Triton backend, do the rest (and dr, dP).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import interpret_default, round_up
from pallas_kernels.rel_attention import backward as backward_kernels
from pallas_kernels.rel_attention import forward as forward_kernel
from pallas_kernels.rel_attention import mgpu_dkdv, mgpu_dq, mgpu_forward, tuning
from pallas_kernels.rel_attention.tiles import Geometry

_PAD_SEGMENT = jnp.iinfo(jnp.int32).min  # padded tokens form their own segment


def _forward(geo: Geometry, *args):
    return (mgpu_forward.forward if geo.blocks.mosaic else forward_kernel.forward)(geo, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def padded_attention(geos, q, k, v, r, p, tau, qseg, kseg):
    """The differentiable core on the operands `prepare` returns and the geometries (forward, dK/dV, dQ[, the
    Mosaic dQ of the tiles without bias, or None]) as `plan` returns them."""
    return _forward(geos[0], q, k, v, r, p, tau, qseg, kseg)[0]


def _attention_fwd(geos, q, k, v, r, p, tau, qseg, kseg):
    out, lse = _forward(geos[0], q, k, v, r, p, tau, qseg, kseg)
    return out, (q, k, v, r, p, tau, qseg, kseg, out, lse)


def _attention_bwd(geos, residuals, dout):
    dkdv_geo, dq_geo = geos[1:3]
    dq_plain_geo = geos[3] if len(geos) > 3 else None
    args = backward_kernels.residual_args(*residuals, dout)
    dk, dv = (mgpu_dkdv.dkdv if dkdv_geo.blocks.mosaic else backward_kernels.dkdv)(dkdv_geo, *args)
    if dq_plain_geo is None:
        dq, dr, dp = backward_kernels.dq(dq_geo, *args)
    else:  # the tiles without bias on the tensor cores, the others (and dr, dP) in the Triton dQ
        dq, dr, dp = mgpu_dq.dq_split(dq_geo, dq_plain_geo, *args)
    # tau and segment ids are not differentiated
    return dq, dk, dv, dr.astype(args[3].dtype), dp.astype(args[4].dtype), None, None, None


padded_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad_axis1(x, length, value=0):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def prepare(q, k, v, r, rel_proj, *, q_offset, window, tau, segment_ids, scale, interpret, blocks):
    """Validate, pad every sequence to a multiple of every block, and describe the call.

    blocks: the forward's, dK/dV's and dQ's tiles; benchmarks append candidate tiles, which then share the padding.
    Returns (one geometry per entry of blocks, padded kernel operands)."""
    batch, seq_q, heads, dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    d_rel, extent = rel_proj.shape
    if heads % kv_heads or r.shape != (batch, seq_q, heads, d_rel) or k.shape != v.shape:
        raise ValueError(f"bad shapes q {q.shape} k {k.shape} v {v.shape} r {r.shape} P {rel_proj.shape}")
    if q_offset + seq_q > seq_k:
        raise ValueError(f"queries reach position {q_offset + seq_q - 1} but there are only {seq_k} keys")
    if segment_ids is not None and (seq_q != seq_k or q_offset != 0):
        raise ValueError("segment_ids are for self-attention (T == S, q_offset == 0)")
    if any(b.block_q > b.block_k for b in blocks):
        raise ValueError(f"block_q must not exceed block_k (a tile's distances must fit its band): {blocks}")
    multiple = max(max(b.block_q, b.block_k) for b in blocks)
    seq_q_pad, seq_k_pad = round_up(seq_q, multiple), round_up(seq_k, multiple)
    rel_left = 2 * max(b.block_k for b in blocks)
    base = Geometry(groups=heads // kv_heads, head_dim=dim, d_rel=d_rel, extent=extent, window=window,
                    q_offset=q_offset, segmented=segment_ids is not None,
                    scale=float(1.0 / dim if scale is None else scale), seq_q=seq_q_pad, seq_k=seq_k_pad,
                    rel_left=rel_left, interpret=interpret_default() if interpret is None else bool(interpret),
                    blocks=blocks[0])
    geos = tuple(dataclasses.replace(base, blocks=b) for b in blocks)

    tau = jnp.ones((batch, seq_q), jnp.float32) if tau is None else tau.astype(jnp.float32)
    if segment_ids is None:
        qseg = kseg = jnp.zeros((batch, seq_q_pad), jnp.int32)
    else:
        qseg = _pad_axis1(segment_ids.astype(jnp.int32), seq_q_pad, _PAD_SEGMENT)
        kseg = _pad_axis1(segment_ids.astype(jnp.int32), seq_k_pad, _PAD_SEGMENT)
    # Zero columns around P: left for the negative distances of diagonal tiles, right for bands past E.
    p = jnp.pad(rel_proj.astype(q.dtype), ((0, 0), (rel_left, rel_left)))
    args = (_pad_axis1(q, seq_q_pad), _pad_axis1(k, seq_k_pad), _pad_axis1(v, seq_k_pad), _pad_axis1(r, seq_q_pad),
            p, _pad_axis1(tau, seq_q_pad, 1.0), qseg, kseg)
    return geos, args


@functools.partial(jax.jit, static_argnames=("q_offset", "window", "scale", "interpret", "block_q", "block_k", "forward_impl"))
def rel_flash_attention(q, k, v, r, rel_proj, *, q_offset: int = 0, window: int | None = None, tau=None,
                        segment_ids=None, scale: float | None = None, interpret: bool | None = None,
                        block_q: int | None = None, block_k: int | None = None, forward_impl: str | None = None):
    """Causal GQA attention with Inkling's query-conditioned relative bias; returns [B, T, Hq, D] in q.dtype.

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; r: [B, T, Hq, d_rel]; rel_proj: P [d_rel, E].
        Query t sits at position q_offset + t, key s at position s (S >= q_offset + T).
      q_offset: static int; 0 for self-attention, the cache length for a chunk appended to a cache.
      window: sliding window length counting the query itself, or None for full attention.
      tau: optional [B, T] fp32 log-scaling that multiplies the whole logit; not differentiated.
      segment_ids: optional [B, T] int ids of packed sequences (self-attention only: T == S, q_offset 0).
      scale: defaults to 1 / head_dim.
      interpret: Pallas interpret mode; defaults to True off GPU.
      block_q, block_k: override the tuned tile sizes of the Triton kernels (block_q counts tokens).
      forward_impl: which forward kernel runs: "mosaic" (mgpu_forward.py), "triton" (forward.py), or None:
        Mosaic where it applies (compiled, no packed segments, 16-bit inputs) and was measured faster, else
        Triton. An explicit "mosaic" with interpret runs Pallas' Mosaic GPU interpreter (slow; tests); "triton"
        runs the Triton kernels only, the backward's too.
    """
    geos, args = plan(q, k, v, r, rel_proj, q_offset=q_offset, window=window, tau=tau, segment_ids=segment_ids,
                      scale=scale, interpret=interpret, block_q=block_q, block_k=block_k, forward_impl=forward_impl)
    return padded_attention(geos, *args)[:, :q.shape[1]]


def plan(q, k, v, r, rel_proj, *, q_offset, window, tau, segment_ids, scale, interpret, block_q=None, block_k=None,
         forward_impl=None):
    """`prepare` with the tiles `rel_flash_attention` runs: (forward, dK/dV, dQ, Mosaic dQ of the tiles without
    bias or None) geometries. The Mosaic GPU kernels replace or share the Triton ones' work where they apply and
    were measured faster."""
    groups = q.shape[2] // k.shape[2]
    tuned = tuple(dataclasses.replace(b, block_q=block_q or b.block_q, block_k=block_k or b.block_k)
                  for b in tuning.blocks(groups, q.shape[3], window))
    impl = forward_impl
    if impl not in (None, "mosaic", "triton"):
        raise ValueError(f"forward_impl must be 'mosaic', 'triton' or None, not {impl!r}")
    interpret = interpret_default() if interpret is None else bool(interpret)
    # Mosaic tiles join the padding only where they may run: compiled, or an explicit Mosaic forward.
    mosaic = mgpu_forward.ROWS % groups == 0 and impl != "triton" and (not interpret or impl == "mosaic")
    extra = (tuning.mosaic_forward(groups), mgpu_dkdv.tile(groups)) if mosaic else ()
    geos, args = prepare(q, k, v, r, rel_proj, q_offset=q_offset, window=window, tau=tau, segment_ids=segment_ids,
                         scale=scale, interpret=interpret, blocks=tuned + extra)
    forward, dkdv, dq = geos[:3]
    dq_plain = None
    if mosaic:
        mosaic_forward, mosaic_dkdv = geos[3:]  # the Mosaic dQ's CTAs are the forward's
        if mgpu_forward.supports(mosaic_forward, q.dtype) and (
                impl == "mosaic" or (not interpret and mgpu_forward.faster_than_triton(mosaic_forward))):
            forward = mosaic_forward
        if not interpret and mgpu_dkdv.supports(mosaic_dkdv, q.dtype) and mgpu_dkdv.faster_than_triton(mosaic_dkdv):
            dkdv = mosaic_dkdv
        if not interpret and mgpu_dq.supports(mosaic_forward, q.dtype) and mgpu_dq.faster_than_triton(mosaic_forward):
            dq_plain = mosaic_forward
    if impl == "mosaic" and not forward.blocks.mosaic:
        raise ValueError("the Mosaic GPU forward does not cover this call (packed segments, fp32, group size?)")
    return (forward, dkdv, dq, dq_plain), args
