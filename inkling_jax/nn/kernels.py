"""The model's calls into the kernels: every function here runs the implementation its `backend` (an
`inkling_jax.backend.Backend`, held by the calling module) names, the pure-jnp reference or the Pallas kernel,
and the model never calls a kernel directly. The choice is made while tracing, from the static backend.

Every function but `lora_add` (LoRA adapters are served on one device) takes the `mesh` of a sharded model (None:
one device) and then runs once per device on its own heads and rows (`kernel_sharding`). Under the backend's
`batch_invariant` the matmuls and every kind of attention run the batch-invariant implementations (`invariant`,
`invariant_attention`; one device only).
"""

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from inkling_jax.backend import Backend
from inkling_jax.nn import invariant, invariant_attention
from inkling_jax.nn.cache import ring_as_pages
from inkling_jax.parallel.kernel_sharding import split
from pallas_kernels import decode_attention as decode
from pallas_kernels.attn_prologue import attn_prologue
from pallas_kernels.lora import lora_add as lora_kernel
from pallas_kernels.lora import reference as lora_reference
from pallas_kernels.rel_attention import rel_chunk_attention, rel_flash_attention
from pallas_kernels.rel_attention import reference as attention_reference
from pallas_kernels.shortconv import reference as shortconv_reference
from pallas_kernels.shortconv import shortconv_prefill as shortconv_kernel


def matmul(x, w, *, backend: Backend, transposed: bool = False):
    """x [..., K] @ w [K, N] (or w [N, K] `transposed`: x @ w^T): XLA's dot, or under `batch_invariant` the
    fixed-tile kernel (`invariant.matmul`), which reads a transposed weight as it lies."""
    if backend.batch_invariant:
        return invariant.matmul(x, w, interpret=backend.resolve().interpret, transposed=transposed)
    return x @ (w.T if transposed else w)


def _one_device(mesh, what: str):
    if mesh is not None and mesh.size > 1:
        raise ValueError(f"the batch-invariant {what} runs on one device, not on a mesh")


def shortconv_prefill(x, w, state=None, *, backend: Backend, segment_ids=None, lengths=None, mesh=None,
                      split_channels=False):
    """x [B, T, C], w [C, width], state [B, width - 1, C]; `split_channels`: the channels are heads x head_dim
    (K and V), split over `tensor` like the heads."""
    use = backend.resolve()
    if state is None:
        state = jax.numpy.zeros((x.shape[0], w.shape[-1] - 1, x.shape[-1]), x.dtype)
    if use.shortconv == "pallas":
        fn = functools.partial(_shortconv_kernel, use.interpret)
    else:
        fn = shortconv_reference.shortconv_prefill
    how = split(mesh, (x.shape[-1],) if split_channels else (), batch=x.shape[0])
    if how:
        values, per_row = how.spec(2, 0), how.spec(None, 0)
        fn = how.run(fn, (values, how.spec(0), values, per_row, per_row), (values, values))
    return fn(x, w, state, segment_ids, lengths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _shortconv_kernel(interpret, x, w, state, segment_ids, lengths):
    """The Pallas forward with the reference's gradient (the conv is cheap to recompute; Pallas kernels have no
    transpose rule of their own)."""
    return shortconv_kernel(x, w, state, segment_ids=segment_ids, lengths=lengths, interpret=interpret)


def _shortconv_fwd(interpret, x, w, state, segment_ids, lengths):
    return _shortconv_kernel(interpret, x, w, state, segment_ids, lengths), (x, w, state, segment_ids, lengths)


def _shortconv_bwd(interpret, residuals, cotangents):
    x, w, state, segment_ids, lengths = residuals
    _, vjp = jax.vjp(lambda x, w, s: shortconv_reference.shortconv_prefill(x, w, s, segment_ids=segment_ids,
                                                                            lengths=lengths), x, w, state)
    no_grad = tuple(None if a is None else np.zeros(a.shape, jax.dtypes.float0) for a in (segment_ids, lengths))
    return vjp(cotangents) + no_grad


_shortconv_kernel.defvjp(_shortconv_fwd, _shortconv_bwd)


def chunk_attention(q, k_pages, v_pages, page_table, r, rel_proj, *, backend: Backend, q_start, key_start,
                    key_end, window=None, tau=None, mesh=None, first_position=None):
    """Prefill chunks continuing a cache, keys read through a page table (contract and layouts in
    `pallas_kernels/rel_attention/chunk.py`); by the backend's `attention`. first_position [B]: the absolute
    position of each row's query 0 where key indices are not positions (`invariant_attention.chunk_attention`,
    which `batch_invariant` runs)."""
    use = backend.resolve()
    if use.batch_invariant:
        _one_device(mesh, "attention")
        return invariant_attention.chunk_attention(q, k_pages, v_pages, page_table, r, rel_proj, q_start=q_start,
                                                   key_start=key_start, key_end=key_end, window=window, tau=tau,
                                                   interpret=use.interpret, first_position=first_position)
    if use.attention == "pallas":
        fn = functools.partial(rel_chunk_attention, interpret=use.interpret)
    else:
        fn = attention_reference.chunk_attention

    def call(q, k_pages, v_pages, r, page_table, rel_proj, q_start, key_start, key_end, tau):
        return fn(q, k_pages, v_pages, page_table, r, rel_proj, q_start=q_start, key_start=key_start,
                  key_end=key_end, window=window, tau=tau)

    how = split(mesh, (q.shape[2], k_pages.shape[2]))
    if how:
        heads = how.spec(2)
        call = how.run(call, (heads,) * 4 + (P(),) * 6, heads)
    return call(q, k_pages, v_pages, r, page_table, rel_proj, q_start, key_start, key_end, tau)


def ring_chunk_attention(q, k_ring, v_ring, ring_rows, r, rel_proj, *, backend: Backend, cached, n_new, window: int,
                         tau=None, mesh=None):
    """`chunk_attention` of T tokens per row at positions cached .. cached + T - 1 (the first n_new [B] real)
    over sliding rings [N, L, Hkv, D] that already hold them, read in place (`cache.ring_as_pages`): the chunk's
    writes overwrote no key its queries see where L >= window + T - 1. ring_rows: [B] (None: row b's ring is b)."""
    batch, seq = q.shape[:2]
    rows = jax.numpy.arange(batch) if ring_rows is None else ring_rows
    align = invariant_attention.blocks(q.shape[2] // k_ring.shape[2]).block_k if backend.resolve().batch_invariant \
        else 1  # the fixed tile's key blocks stay at absolute positions
    first = jax.numpy.maximum(cached + 1 - window, 0)
    table, base = ring_as_pages(rows, k_ring.shape[1], first, window + seq - 1, align)
    return chunk_attention(q, k_ring, v_ring, table, r, rel_proj, backend=backend, q_start=cached - base,
                           key_start=first - base, key_end=cached + n_new - base, window=window, tau=tau, mesh=mesh)


def self_attention(q, k, v, r, rel_proj, positions, *, backend: Backend, window=None, tau=None, segment_ids=None,
                   mesh=None):
    """T tokens attending among themselves; positions must step by one inside each segment (packed sequences
    restart at 0), which is what lets the flash kernel use index differences as distances."""
    use = backend.resolve()
    if use.attention == "pallas":
        def call(q, k, v, r, rel_proj, positions, tau, segment_ids):
            return rel_flash_attention(q, k, v, r, rel_proj, window=window, tau=tau, segment_ids=segment_ids,
                                       interpret=use.interpret)
    else:
        def call(q, k, v, r, rel_proj, positions, tau, segment_ids):
            return attention_reference.rel_attention(q, k, v, r, rel_proj, positions, positions, window=window,
                                                     tau=tau, q_segment=segment_ids, k_segment=segment_ids,
                                                     index_distances=True)

    if use.batch_invariant:  # one sequence per row; the gradient is that of `attention`'s choice
        _one_device(mesh, "attention")

        def forward(q, k, v, r, rel_proj, positions, tau, segment_ids):
            return invariant_attention.self_attention(q, k, v, r, rel_proj, window=window, tau=tau,
                                                      interpret=use.interpret)
        call = invariant.with_gradient_of(forward, call)  # the kernel has no backward of its own
    how = split(mesh, (q.shape[2], k.shape[2]), batch=q.shape[0])
    if how:
        heads, rows = how.spec(2, 0), how.spec(None, 0)
        call = how.run(call, (heads,) * 4 + (P(), rows, rows, rows), heads)
    return call(q, k, v, r, rel_proj, positions, tau, segment_ids)


def fused_decode_prologue(backend: Backend) -> bool:
    """Whether a decode step (one token per row) runs its attention prologue as `decode_prologue` (the backend's
    `decode_attention` is "pallas") rather than as the model's separate jnp ops (ShortConv, norms, cache
    scatter)."""
    use = backend.resolve()
    return use.decode_attention == "pallas" and not use.batch_invariant  # batch-invariant: the chunk path's ops


def decode_prologue(q, k, v, k_conv_w, v_conv_w, q_norm_w, k_norm_w, k_state, v_state, k_cache, v_cache,
                    write_idx, *, backend: Backend, eps, mesh=None):
    """The fused prologue of a decode step (`pallas_kernels/attn_prologue`) for one token per row.

    q [B, Hq*D], k and v [B, Hkv*D] projections; k_state, v_state [B, W-1, Hkv*D] the rows' ShortConv states;
    k_cache, v_cache any cache layout [..., Hkv, D] (pages or rings), written at its flat row write_idx [B]
    (negative: an idle row, which writes nothing and keeps its states). tau is not folded here: the decode
    attention applies it. Returns (q [B, Hq, D], k, v [B, Hkv, D], k_cache, v_cache, k_state, v_state), the
    caches in their own shapes. The kernel has no jnp twin: `fused_decode_prologue` says when to call this.
    """
    interpret = backend.resolve().interpret

    def call(q, k, v, k_conv_w, v_conv_w, k_state, v_state, k_cache, v_cache, q_norm_w, k_norm_w, write_idx):
        flat = lambda cache: cache.reshape(-1, *cache.shape[-2:])  # noqa: E731
        slots = jax.numpy.arange(q.shape[0], dtype=jax.numpy.int32)
        q, k, v, k_state, v_state, new_k, new_v = attn_prologue(q, k, v, k_conv_w, v_conv_w, q_norm_w, k_norm_w,
                                                                k_state, v_state, slots, flat(k_cache),
                                                                flat(v_cache), write_idx, eps=eps,
                                                                interpret=interpret)
        return q, k, v, new_k.reshape(k_cache.shape), new_v.reshape(v_cache.shape), k_state, v_state

    how = split(mesh, (q.shape[1] // k_cache.shape[-1], k_cache.shape[-2]))
    if how:  # heads at dimension 1 of q, k, v (flat or not), 0 of the conv taps, 2 of the states and caches
        heads, taps, states = how.spec(1), how.spec(0), how.spec(2)
        call = how.run(call, (heads,) * 3 + (taps,) * 2 + (states,) * 4 + (P(),) * 3, (heads,) * 3 + (states,) * 4)
    return call(q, k, v, k_conv_w, v_conv_w, k_state, v_state, k_cache, v_cache, q_norm_w, k_norm_w, write_idx)


def decode_attention(q, k_cache, v_cache, r, rel_proj, lengths, *, backend: Backend, page_table=None,
                     ring_rows=None, window=None, tau=None, mesh=None):
    """One new token per row over the cache that already holds it: paged pages (full layers, `page_table`
    given) or a window ring (sliding layers; row b's ring is `ring_rows[b]`, default b). `lengths` counts the
    new token. By the backend's `decode_attention`; where it is batch-invariant, or a ring holds slots past the
    window, as a one-token `chunk_attention`."""
    use = backend.resolve()
    pallas = use.decode_attention == "pallas"
    one = functools.partial(jax.numpy.expand_dims, axis=1)
    if page_table is None and (use.batch_invariant or k_cache.shape[1] > window):
        # A one-token chunk over the ring as it lies: batch-invariant steps (at the fixed tile), and rings with
        # slots past the window (speculative decoding's), which the ring kernels do not take.
        return ring_chunk_attention(one(q), k_cache, v_cache, ring_rows, one(r), rel_proj, backend=backend,
                                    cached=lengths - 1, n_new=jax.numpy.ones_like(lengths), window=window,
                                    tau=None if tau is None else one(tau), mesh=mesh)[:, 0]
    if use.batch_invariant:  # a one-token chunk at the fixed tile over the pages
        return chunk_attention(one(q), k_cache, v_cache, page_table, one(r), rel_proj, backend=backend,
                               q_start=lengths - 1, key_start=jax.numpy.zeros_like(lengths), key_end=lengths,
                               window=window, tau=None if tau is None else one(tau), mesh=mesh)[:, 0]
    if page_table is None:
        fn = functools.partial(decode.ring_decode_attention, interpret=use.interpret) if pallas \
            else decode.ring_decode_reference

        def call(q, k_cache, v_cache, r, rel_proj, lengths, page_table, ring_rows, tau):
            return fn(q, k_cache, v_cache, lengths, r, rel_proj, window=window, rows=ring_rows)
    else:
        fn = functools.partial(decode.paged_decode_attention, interpret=use.interpret) if pallas \
            else decode.paged_decode_reference

        def call(q, k_cache, v_cache, r, rel_proj, lengths, page_table, ring_rows, tau):
            return fn(q, k_cache, v_cache, page_table, lengths, r, rel_proj, tau=tau)

    how = split(mesh, (q.shape[1], k_cache.shape[2]))
    if how:
        heads, cache = how.spec(1), how.spec(2)
        call = how.run(call, (heads, cache, cache, heads) + (P(),) * 5, heads)
    return call(q, k_cache, v_cache, r, rel_proj, lengths, page_table, ring_rows, tau)


def lora_add(y, x, a, b, scale, slots, *, backend: Backend, sorted_slots: bool = False):
    """y [rows, ..., out] plus each row's LoRA adapter product scale[s] * (x @ A[s]) @ B[s], s = slots[row] (0: the
    base, zero adapters), in y's dtype (contract in `pallas_kernels/lora`); by the backend's `lora`. sorted_slots:
    the rows come sorted by slot (the kernels' segmented form, whatever the tokens per row)."""
    use = backend.resolve()
    if use.lora == "pallas":
        return lora_kernel(y, x, a, b, scale, slots, interpret=use.interpret, sorted_slots=sorted_slots)
    return lora_reference.lora_add(y, x, a, b, scale, slots)
