"""Fused decode attention prologue as one Pallas kernel (Triton backend); semantics of `reference.py`.

One program per (group of KV heads, token): it runs the K and V ShortConv step against the pools, the
per-head RMSNorm of k and of that group's query heads (with tau), and writes q, k, v and the KV-cache slot
(a token with a negative slot writes neither its pool row nor the cache).
Pools and caches are aliased to the outputs, so a donated caller updates them in place. Every tile is
[heads, D] with D and the head counts powers of two, as Triton requires.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import interpret_default
from pallas_kernels.attn_prologue import tuning
from pallas_kernels.attn_prologue.reference import fold_tau, head_rms_norm
from pallas_kernels.shortconv.kernel import conv_step


def _prologue_kernel(q_ref, k_ref, v_ref, wk_ref, wv_ref, qn_ref, kn_ref, slots_ref, dest_ref, *refs,
                     kv_per_program, groups, dim, eps, has_tau):
    tau_ref = refs[0] if has_tau else None
    refs = refs[5:] if has_tau else refs[4:]  # skip the aliased pool and cache inputs
    q_out_ref, k_out_ref, v_out_ref, k_pool_ref, v_pool_ref, k_cache_ref, v_cache_ref = refs
    group, n = pl.program_id(0), pl.program_id(1)
    slot, dest = slots_ref[n], dest_ref[n]
    keep = dest >= 0
    lanes = lax.broadcasted_iota(jnp.int32, (1, dim), 1)

    kv_heads = group * kv_per_program + lax.broadcasted_iota(jnp.int32, (kv_per_program, 1), 0)
    kv_cols = kv_heads * dim + lanes  # [heads, D] channels of the flat k/v rows and pools
    k_conv = conv_step(k_ref[n, kv_cols], k_pool_ref, slot, kv_cols, wk_ref, kv_cols, keep=keep)
    v_conv = conv_step(v_ref[n, kv_cols], v_pool_ref, slot, kv_cols, wv_ref, kv_cols, keep=keep)
    k_normed = head_rms_norm(k_conv.astype(k_out_ref.dtype), kn_ref[lanes], eps)
    v_conv = v_conv.astype(v_out_ref.dtype)
    k_out_ref[n, kv_heads, lanes] = k_normed
    v_out_ref[n, kv_heads, lanes] = v_conv

    @pl.when(keep)
    def _write_cache():
        k_cache_ref[dest, kv_heads, lanes] = k_normed.astype(k_cache_ref.dtype)
        v_cache_ref[dest, kv_heads, lanes] = v_conv.astype(v_cache_ref.dtype)

    q_heads = group * kv_per_program * groups + lax.broadcasted_iota(jnp.int32, (kv_per_program * groups, 1), 0)
    q_normed = head_rms_norm(q_ref[n, q_heads * dim + lanes], qn_ref[lanes], eps)
    if has_tau:
        q_normed = fold_tau(q_normed, tau_ref[n])
    q_out_ref[n, q_heads, lanes] = q_normed.astype(q_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "blocks"))
def attn_prologue(q, k, v, k_conv_w, v_conv_w, q_norm_w, k_norm_w, k_pool, v_pool, slots, k_cache, v_cache,
                  write_idx, tau=None, *, eps=1e-6, interpret=None, blocks=None):
    """Kernel form of `reference.attn_prologue` (same arguments and results; pools and caches in place).

    Head counts and D come from k_cache [M, Hkv, D] and q [N, Hq*D]. blocks: optional
    `tuning.PrologueBlocks`. Slots and the non-negative write_idx must each be distinct.
    """
    tokens = q.shape[0]
    _, kv_heads, dim = k_cache.shape
    heads = q.shape[1] // dim
    blocks = blocks or tuning.prologue_blocks(kv_heads)
    if kv_heads % blocks.kv_heads or heads % kv_heads:
        raise ValueError(f"{blocks.kv_heads} KV heads per program must divide Hkv={kv_heads}, and Hkv Hq={heads}")
    inputs = [q, k, v, k_conv_w, v_conv_w, q_norm_w, k_norm_w, slots.astype(jnp.int32),
              write_idx.astype(jnp.int32)]
    if tau is not None:
        inputs.append(tau.astype(jnp.float32))
    aliased = [k_pool, v_pool, k_cache, v_cache]
    out_shape = (jax.ShapeDtypeStruct((tokens, heads, dim), q.dtype),
                 jax.ShapeDtypeStruct((tokens, kv_heads, dim), k.dtype),
                 jax.ShapeDtypeStruct((tokens, kv_heads, dim), v.dtype),
                 *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased))
    kernel = functools.partial(_prologue_kernel, kv_per_program=blocks.kv_heads, groups=heads // kv_heads,
                               dim=dim, eps=eps, has_tau=tau is not None)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(kv_heads // blocks.kv_heads, tokens),
        input_output_aliases={len(inputs) + i: 3 + i for i in range(len(aliased))},
        interpret=interpret_default() if interpret is None else interpret,
        compiler_params=plt.CompilerParams(num_warps=blocks.num_warps), name="attn_prologue",
    )(*inputs, *aliased)
