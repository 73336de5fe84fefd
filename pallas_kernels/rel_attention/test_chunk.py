"""Prefill chunks over a cache (chunk.py) vs the dense reference: rows with different cached lengths, padding
tokens and an idle row, shuffled pages, both layer kinds, tiles that carry bias and tiles beyond E.

Interpret mode on CPU, compiled on a GPU. Query and key axes both tile into 3+ blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rel_attention import chunk_attention, rel_chunk_attention
from pallas_kernels.rel_attention.tiles import Blocks

HEAD_DIM, D_REL = 32, 16
TILE = Blocks(block_q=4, block_k=16)


def _operands(rng, batch, seq, heads, extent, dtype):
    normal = lambda scale, *shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)
    tau = jnp.asarray(1.0 + 0.3 * rng.random((batch, seq)), jnp.float32)
    q, r = normal(2.0, batch, seq, heads, HEAD_DIM), normal(0.5, batch, seq, heads, D_REL)
    return q, r, normal(1.0, D_REL, extent), tau


def _kernel(operands, kwargs):
    return jax.jit(lambda *xs: rel_chunk_attention(*xs, blocks=TILE, **kwargs))(*operands)


def _compare(q, k_pages, v_pages, table, r, p, bounds, window, tau, dtype):
    """The kernel's output, checked against the reference's; also returns the keyword arguments used."""
    kwargs = dict(q_start=bounds[0], key_start=bounds[1], key_end=bounds[2], window=window, tau=tau)
    got = _kernel((q, k_pages, v_pages, table, r, p), kwargs)
    with jax.default_matmul_precision("highest"):  # GPUs would default to TF32 for the fp32 reference
        want = chunk_attention(*[x.astype(jnp.float32) if x.dtype == dtype else x
                                 for x in (q, k_pages, v_pages, table, r, p)], **kwargs)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol * float(jnp.abs(want).max()))
    return got, kwargs


@pytest.mark.parametrize("dtype, kv_heads, extent", [(jnp.float32, 2, 24), (jnp.bfloat16, 1, 100)])
def test_full_layer_chunk_over_shuffled_pages(dtype, kv_heads, extent):
    rng = np.random.default_rng(0)
    batch, seq, heads, page_size, pages_per_row = 5, 18, 8, 8, 12  # span 96 = 6 key blocks, 5 query blocks
    cached = np.array([0, 41, 70, 0, 5])
    new = np.array([18, 11, 18, 0, 3])  # rows 1 and 4 end in padding tokens, row 3 is idle
    table = rng.permutation(batch * pages_per_row + 3)[:batch * pages_per_row].reshape(batch, pages_per_row)
    pages = jnp.asarray(rng.standard_normal((2, batch * pages_per_row + 3, page_size, kv_heads, HEAD_DIM)), dtype)
    q, r, p, tau = _operands(rng, batch, seq, heads, extent, dtype)
    bounds = [jnp.asarray(x, jnp.int32) for x in (cached, np.zeros(batch), cached + new)]
    got, kwargs = _compare(q, pages[0], pages[1], jnp.asarray(table, jnp.int32), r, p, bounds, None, tau, dtype)
    assert float(jnp.abs(got[3]).max()) == 0.0  # the idle row sees no key
    # Entries past a row's keys are ignored: pointing them at a page of NaN changes nothing (the dense
    # reference, which multiplies them by zero probabilities, would turn NaN).
    poisoned = np.where(np.arange(pages_per_row)[None] * page_size >= (cached + new)[:, None], batch * pages_per_row,
                        table)
    nan_pages = pages.at[:, batch * pages_per_row].set(jnp.nan)
    again = _kernel((q, nan_pages[0], nan_pages[1], jnp.asarray(poisoned, jnp.int32), r, p), kwargs)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(got, np.float32))


def test_sliding_layer_ring_then_chunk():
    rng = np.random.default_rng(1)
    batch, seq, heads, kv_heads, window = 3, 20, 8, 2, 24
    cached, new = np.array([0, 9, 300]), np.array([20, 13, 20])
    keys = jnp.asarray(rng.standard_normal((2, batch, window + seq, kv_heads, HEAD_DIM)), jnp.float32)
    q, r, p, tau = _operands(rng, batch, seq, heads, window, jnp.float32)
    bounds = [jnp.asarray(x, jnp.int32) for x in (np.full(batch, window), window - np.minimum(cached, window),
                                                   window + new)]
    table = jnp.arange(batch, dtype=jnp.int32)[:, None]
    _compare(q, keys[0], keys[1], table, r, p, bounds, window, tau, jnp.float32)


def test_rejects_mismatched_pages():
    q = jnp.zeros((1, 4, 8, HEAD_DIM))
    with pytest.raises(ValueError, match="bad shapes"):
        rel_chunk_attention(q, jnp.zeros((2, 8, 2, HEAD_DIM)), jnp.zeros((2, 8, 2, 16)), jnp.zeros((1, 2), jnp.int32),
                            jnp.zeros((1, 4, 8, D_REL)), jnp.zeros((D_REL, 8)), q_start=jnp.zeros(1, jnp.int32),
                            key_start=jnp.zeros(1, jnp.int32), key_end=jnp.ones(1, jnp.int32))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU run compiles the kernel for real")
@pytest.mark.parametrize("kv_heads, window", [(8, None), (16, 512)])
def test_kernel_lowers_to_triton_at_inkling_shapes(kv_heads, window):
    """Interpret mode cannot catch ops that the Triton lowering lacks; lowering for CUDA can, without a GPU, on
    jaxlibs that embed the Triton IR in the HLO (newer ones compile it at lowering time, which needs a GPU)."""
    if jax.__version_info__ > (0, 10, 2):
        pytest.skip("this jaxlib compiles Triton IR while lowering")
    batch, seq, pages = 4, 256, 64
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((batch, seq, 64, 128), jnp.bfloat16), ((batch * pages, 16, kv_heads, 128), jnp.bfloat16),
        ((batch * pages, 16, kv_heads, 128), jnp.bfloat16), ((batch, pages), jnp.int32),
        ((batch, seq, 64, D_REL), jnp.bfloat16), ((D_REL, 1024), jnp.bfloat16), ((batch,), jnp.int32))]

    def call(q, k, v, table, r, p, lengths):
        return rel_chunk_attention(q, k, v, table, r, p, q_start=lengths, key_start=lengths * 0, key_end=lengths + seq,
                                   window=window, interpret=False)

    lowered = jax.jit(call).trace(*shapes).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1
