"""Split-K decode attention machinery shared by the paged and the ring kernels.

One program handles (sequence b, KV head h, split s): all query heads of KV head h (so each KV byte is read
once), over one contiguous share of the sequence's key blocks. It keeps an online softmax (max m, sum l,
unnormalised output acc) and writes those partials; `combine_splits` merges the splits in jnp.

The relative bias of a key block is r [G, dr] @ P_slice [dr, block]: the cache layouts make the distances of a
block contiguous in a reversed, padded copy of P, so the bias comes from one small matmul per block and needs
no gather and no out-of-bounds load. Written for the Pallas Triton backend (dynamic scalar reads of lengths and
page tables, tl.dot with M >= 16); the same body runs in interpret mode on CPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import interpret_default

# Finite "minus infinity": exp(NEG_INF - m) underflows to 0 without producing NaN from (-inf) - (-inf).
NEG_INF = -1e30
# tl.dot needs every matmul dimension >= 16; query-head groups and d_rel are padded up to this.
MIN_DOT_DIM = 16


def padded_size(n):
    """Smallest power of two >= max(n, MIN_DOT_DIM): Triton tensors must have power-of-two sizes."""
    return max(MIN_DOT_DIM, 1 << (n - 1).bit_length())


def group_heads(x, kv_heads, rows, cols):
    """[B, Hq, C] -> [B, Hkv, rows, cols]: the query heads of each KV head, zero-padded (pads attend to nothing
    that reaches the output: their rows are dropped by `combine_splits`)."""
    batch, heads, width = x.shape
    x = x.reshape(batch, kv_heads, heads // kv_heads, width)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - x.shape[2]), (0, cols - width)))


def reversed_rel_proj(rel_proj, dtype, rows):
    """P [dr, E] -> [rows, E] with column E-1-d holding distance d, so that increasing key positions read
    increasing columns. Rows beyond dr are zero (d_rel padded for the matmul)."""
    flipped = rel_proj[:, ::-1].astype(dtype)
    return jnp.pad(flipped, ((0, rows - rel_proj.shape[0]), (0, 0)))


def load_valid_rows(ref, valid):
    """ref [..., D] with rows where `valid` [...] is False left unread and zero: a cache's unused tail may hold
    anything, even NaN, and skipping it saves bandwidth on ragged lengths."""
    return pltriton.load(ref, mask=jnp.broadcast_to(valid[..., None], ref.shape), other=0)


def attend_block(state, q, r, k, v, rel_slice, valid, score_scale, bias_scale):
    """One online-softmax step over a key block.

    q [G, D], r [G, dr], k/v [N, D] (zero where invalid), rel_slice [dr, N] (bias profile of each key's
    distance), valid [N] bool. Logits are tau * (q.k * scale + r.P[:, d]); score_scale = tau * scale and
    bias_scale = tau.
    """
    m_prev, l_prev, acc_prev = state
    # HIGHEST keeps fp32 inputs out of TF32 on the Triton backend; bf16 inputs are unaffected.
    dot = functools.partial(lax.dot_general, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    scores = dot(q, k, (((1,), (1,)), ((), ())))
    bias = dot(r, rel_slice, (((1,), (0,)), ((), ())))
    logits = jnp.where(valid[None, :], scores * score_scale + bias * bias_scale, NEG_INF)
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    # Zeroing masked probabilities (not only their logits) keeps blocks with no valid key harmless.
    probs = jnp.where(valid[None, :], jnp.exp(logits - m_next[:, None]), 0.0)
    acc = acc_prev * correction[:, None] + dot(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())))
    return m_next, l_prev * correction + probs.sum(axis=1), acc


def split_kernel(q_ref, r_ref, acc_ref, m_ref, l_ref, *, num_blocks, load_block, score_scale, bias_scale):
    """Runs this program's share of `num_blocks` (traced) key blocks; load_block(i) -> (k, v, rel_slice, valid)."""
    split, num_splits = pl.program_id(2), pl.num_programs(2)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = split * per_split
    count = jnp.clip(num_blocks - first, 0, per_split)
    q, r = q_ref[...], r_ref[...]
    rows, dim = q.shape

    def step(i, state):
        k, v, rel_slice, valid = load_block(first + i)
        return attend_block(state, q, r, k, v, rel_slice, valid, score_scale, bias_scale)

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dim), jnp.float32))
    m, l, acc = lax.fori_loop(0, count, step, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def decode_partials(kernel, q_grouped, r_grouped, cache_inputs, *, num_splits, num_warps, num_stages,
                    interpret):
    """pallas_call over grid (B, Hkv, splits). `kernel(*cache_refs, q_ref, r_ref, acc_ref, m_ref, l_ref)`;
    cache_inputs are passed whole (the kernel indexes them itself)."""
    batch, kv_heads, rows, dim = q_grouped.shape
    interpret = interpret_default() if interpret is None else interpret

    def per_head(width):
        return pl.BlockSpec((None, None, rows, width), lambda b, h, s: (b, h, 0, 0))

    def per_split(*tail):
        return pl.BlockSpec((None, None, None, rows, *tail), lambda b, h, s: (b, h, s, 0) + (0,) * len(tail))

    partial_shape = (batch, kv_heads, num_splits, rows)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=[pl.BlockSpec()] * len(cache_inputs) + [per_head(dim), per_head(r_grouped.shape[-1])],
        out_specs=[per_split(dim), per_split(), per_split()],
        out_shape=[jax.ShapeDtypeStruct((*partial_shape, dim), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*cache_inputs, q_grouped, r_grouped)


def combine_splits(acc, m, l, heads, dtype):
    """Merge split partials [B, Hkv, S, G_pad, (D)] into the output [B, Hq, D]."""
    batch, kv_heads, _, _, dim = acc.shape
    weight = jnp.exp(m - m.max(axis=2, keepdims=True))
    out = (acc * weight[..., None]).sum(axis=2) / (l * weight).sum(axis=2)[..., None]
    return out[:, :, : heads // kv_heads].reshape(batch, heads, dim).astype(dtype)


def default_splits(batch, kv_heads, max_blocks, target_programs):
    """Enough splits that batch * kv_heads * splits reaches target_programs, never more than there are blocks."""
    return max(1, min(max_blocks, -(-target_programs // (batch * kv_heads))))
