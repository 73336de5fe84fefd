"""Decode attention kernels against the jnp references (Pallas interpret mode on CPU, compiled on GPU).

Every cache row that no sequence may read is NaN, and page-table entries past a sequence's last page are out of
range, so a kernel that reads or weights anything it should not fails. References run in fp32 on the same
(rounded) inputs, at full matmul precision (XLA would use TF32 on the GPU).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (contiguous_as_pages, paged_decode_attention, paged_decode_reference,
                                             ring_decode_attention, ring_decode_reference)
from pallas_kernels.rel_attention.reference import rel_attention

DIM, D_REL, KV_HEADS = 32, 16, 2
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
# Each layout sees both dtypes and both GQA group sizes (4: local layers, 8: global layers) across its tests.
PAGED_CASES = [(jnp.float32, 4), (jnp.bfloat16, 8)]
RING_CASES = [(jnp.float32, 8), (jnp.bfloat16, 4)]


def _relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def _exact(fn):
    """jit of fn with fp32 matmuls at full precision."""
    compiled = jax.jit(fn)

    def run(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return compiled(*args, **kwargs)
    return run


def _fp32(*arrays):
    """Upcast on the host (eager jnp ops would each compile: slow in CPU tests)."""
    return [jnp.asarray(np.asarray(a, np.float32)) for a in arrays]


def _queries(rng, batch, groups, extent, dtype):
    """q [B, Hq, D], r [B, Hq, dr], P [dr, E]."""
    heads = groups * KV_HEADS
    return (_normal(rng, (batch, heads, DIM), dtype), _normal(rng, (batch, heads, D_REL), dtype),
            _normal(rng, (D_REL, extent), dtype))


def _paged_cache(rng, lengths, dtype, page_size, pages_per_seq):
    """Shuffled pages, NaN wherever no sequence reads, out-of-range table entries past each last page."""
    batch = len(lengths)
    num_pages = batch * pages_per_seq + 3
    table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
    positions = np.arange(pages_per_seq * page_size).reshape(pages_per_seq, page_size)
    live = np.zeros((num_pages, page_size), bool)
    live[table] = positions[None] < lengths[:, None, None]

    def pages():
        values = rng.standard_normal((num_pages, page_size, KV_HEADS, DIM), np.float32)
        return jnp.asarray(np.where(live[:, :, None, None], values, np.nan), dtype)

    used = np.arange(pages_per_seq)[None] < -(-lengths // page_size)[:, None]
    return pages(), pages(), jnp.asarray(table), jnp.asarray(np.where(used, table, 10**6))


def _check_paged(lengths, dtype, groups, page_size, pages_per_seq, extent, with_tau, **launch):
    rng = np.random.default_rng(len(lengths) * groups + page_size)
    lengths = np.array(lengths, np.int32)
    k_pages, v_pages, table, kernel_table = _paged_cache(rng, lengths, dtype, page_size, pages_per_seq)
    q, r, rel_proj = _queries(rng, len(lengths), groups, extent, dtype)
    tau = jnp.asarray(rng.uniform(1.0, 1.3, len(lengths)), jnp.float32) if with_tau else None
    lengths = jnp.asarray(lengths)
    out = jax.jit(functools.partial(paged_decode_attention, **launch))(
        q, k_pages, v_pages, kernel_table, lengths, r, rel_proj, tau=tau)
    reference = _exact(paged_decode_reference)
    q32, k32, v32, r32, p32 = _fp32(q, k_pages, v_pages, r, rel_proj)
    ref = reference(q32, k32, v32, table, lengths, r32, p32, tau=tau)
    assert out.dtype == dtype and out.shape == q.shape
    assert _relative_error(out, ref) < TOLERANCE[dtype]
    # The bias is large enough here that a kernel ignoring it would fail the check above.
    no_bias = reference(q32, k32, v32, table, lengths, r32, *_fp32(np.zeros(p32.shape)), tau=tau)
    assert _relative_error(no_bias, ref) > 0.05


@pytest.mark.parametrize("dtype, groups", PAGED_CASES)
def test_paged_matches_reference(dtype, groups):
    # Page size 8, two pages per loop step, three splits; lengths at and next to page and block boundaries,
    # E = 40 so the bias ends inside the longer contexts.
    _check_paged([1, 8, 9, 16, 33, 64], dtype, groups, page_size=8, pages_per_seq=8, extent=40, with_tau=True,
                 pages_per_block=2, num_splits=3)


def test_paged_default_launch():
    # Page size 16 with the default 128-key steps (8 pages each): three blocks per sequence at full length;
    # no tau (the sliding layers' case).
    _check_paged([1, 128, 129, 300, 384], jnp.float32, 8, page_size=16, pages_per_seq=24, extent=200,
                 with_tau=False)


def test_contiguous_cache_through_paged_kernel():
    batch, seq, page_size, groups = 3, 64, 16, 8
    lengths = jnp.array([1, 30, 64], jnp.int32)
    rng = np.random.default_rng(7)
    k = _normal(rng, (batch, seq, KV_HEADS, DIM), jnp.float32)
    v = _normal(rng, (batch, seq, KV_HEADS, DIM), jnp.float32)
    q, r, rel_proj = _queries(rng, batch, groups, 24, jnp.float32)
    k_pages, table = contiguous_as_pages(k, page_size)
    v_pages, _ = contiguous_as_pages(v, page_size)
    out = jax.jit(functools.partial(paged_decode_attention, pages_per_block=1, num_splits=4))(
        q, k_pages, v_pages, table, lengths, r, rel_proj)

    @_exact
    def reference(q, k, v, r, rel_proj, lengths):
        k_pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        return rel_attention(q[:, None], k, v, r[:, None], rel_proj, (lengths - 1)[:, None], k_pos,
                             k_valid=k_pos < lengths[:, None])[:, 0]

    ref = reference(q, k, v, r, rel_proj, lengths)
    assert _relative_error(out, ref) < TOLERANCE[jnp.float32]


def _check_ring(lengths, dtype, groups, window, pool_rows=None, **launch):
    """pool_rows: read each query's ring from this row of a larger pool whose other rows hold NaN."""
    rng = np.random.default_rng(len(lengths) * groups + window)
    lengths = np.array(lengths, np.int32)
    shape = (len(lengths), window, KV_HEADS, DIM)
    # Slots the ring has not reached yet hold NaN.
    written = ((np.arange(window)[None] < lengths[:, None]) | (lengths[:, None] >= window))[:, :, None, None]
    k_ring = jnp.asarray(np.where(written, rng.standard_normal(shape, np.float32), np.nan), dtype)
    v_ring = jnp.asarray(np.where(written, rng.standard_normal(shape, np.float32), np.nan), dtype)
    q, r, rel_proj = _queries(rng, len(lengths), groups, window, dtype)
    lengths = jnp.asarray(lengths)
    pooled = (k_ring, v_ring)
    if pool_rows is not None:
        launch["rows"] = jnp.asarray(pool_rows, jnp.int32)
        pooled = [jnp.full((max(pool_rows) + 2,) + shape[1:], jnp.nan, dtype).at[launch["rows"]].set(x)
                  for x in pooled]
    out = jax.jit(functools.partial(ring_decode_attention, window=window, **launch))(
        q, *pooled, lengths, r, rel_proj)
    ref = _exact(functools.partial(ring_decode_reference, window=window))(
        *_fp32(q, k_ring, v_ring), lengths, *_fp32(r, rel_proj))
    assert out.dtype == dtype and out.shape == q.shape
    assert _relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype, groups", RING_CASES)
def test_ring_matches_reference(dtype, groups):
    # Window 48 in blocks of 16 over two splits; lengths before, at and past the first wrap, and several wraps.
    _check_ring([1, 20, 47, 48, 49, 150], dtype, groups, window=48, block_slots=16, num_splits=2)


def test_ring_default_launch():
    # Default block for a 48-slot window is 16 slots (largest power of two dividing it): three blocks.
    _check_ring([5, 48, 100, 131], jnp.bfloat16, 8, window=48)


def test_ring_reads_rings_by_row():
    # A server's step over a few sequences reads their rings where they are in the pool.
    _check_ring([5, 48, 100], jnp.bfloat16, 4, window=48, pool_rows=[4, 0, 2], block_slots=16)


def test_ring_rejects_extent_other_than_window():
    q, r, rel_proj = _queries(np.random.default_rng(0), 1, 4, 32, jnp.float32)
    ring = jnp.ones((1, 48, KV_HEADS, DIM))
    with pytest.raises(ValueError, match="must be equal"):
        ring_decode_attention(q, ring, ring, jnp.array([3]), r, rel_proj, window=48)
