"""Relative flash attention vs the pure-jnp reference: outputs and gradients of q, k, v, r and P.

On CPU the kernels run in Pallas interpret mode; on a GPU the same tests run the compiled kernels. Shapes are
small but tile every axis into 3+ blocks, with lengths that are not multiples of the blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rel_attention import rel_attention, rel_flash_attention

D_REL = 16
HEAD_DIM = 32
BLOCK_K = 16


def _inputs(batch, seq_q, seq_k, heads, kv_heads, extent, dtype, seed):
    # numpy draws: eager jax.random would compile a dozen tiny programs per test on CPU
    rng = np.random.default_rng(seed)
    normal = lambda scale, *shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
    operands = (normal(2.0, batch, seq_q, heads, HEAD_DIM), normal(2.0, batch, seq_k, kv_heads, HEAD_DIM),
                normal(1.0, batch, seq_k, kv_heads, HEAD_DIM), normal(0.5, batch, seq_q, heads, D_REL),
                normal(1.0, D_REL, extent))
    tau = jnp.asarray(1.0 + 0.3 * rng.random((batch, seq_q)), jnp.float32)
    segments = jnp.asarray(np.cumsum(rng.random((batch, seq_q)) < 0.08, axis=1), jnp.int32)
    return [x.astype(dtype) for x in operands], tau, segments, normal(1.0, batch, seq_q, heads, HEAD_DIM)


def _check(*, seq_q, heads, kv_heads, extent, dtype, block_q, q_offset=0, window=None, tau=True,
           segments=False, batch=1, seed=0):
    seq_k = q_offset + seq_q
    operands, tau_values, seg, cotangent = _inputs(batch, seq_q, seq_k, heads, kv_heads, extent, dtype, seed)
    tau_values = tau_values if tau else None
    seg = seg if segments else None
    q_pos = jnp.broadcast_to(q_offset + jnp.arange(seq_q), (batch, seq_q))
    k_pos = jnp.broadcast_to(jnp.arange(seq_k), (batch, seq_k))

    def kernel(*xs):
        return rel_flash_attention(*xs, q_offset=q_offset, window=window, tau=tau_values, segment_ids=seg,
                                   block_q=block_q, block_k=BLOCK_K)

    def reference(*xs):  # evaluated in fp32 on the same (possibly bf16-rounded) inputs
        xs = [x.astype(jnp.float32) for x in xs]
        return rel_attention(*xs, q_pos, k_pos, window=window, tau=tau_values, q_segment=seg, k_segment=seg)

    def value_and_grads(fn):
        out, vjp = jax.vjp(fn, *operands)
        return out, vjp(cotangent.astype(out.dtype))

    out, grads = jax.jit(lambda: value_and_grads(kernel))()
    with jax.default_matmul_precision("highest"):  # GPUs would default to TF32 for the fp32 reference
        want_out, want_grads = jax.jit(lambda: value_and_grads(reference))()
    assert out.dtype == dtype and out.shape == (batch, seq_q, heads, HEAD_DIM)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=tol * 10, rtol=0)
    for name, got, want in zip("q k v r P".split(), grads, want_grads):
        assert got.dtype == dtype, name
        scale = float(jnp.abs(want).max())
        err = float(jnp.abs(got.astype(jnp.float32) - want).max())
        assert err <= tol * scale, f"d{name}: max error {err} vs max |grad| {scale}"


def test_full_layer_extent_below_length_gqa4_tau_segments_fp32():
    _check(seq_q=77, heads=8, kv_heads=2, extent=24, dtype=jnp.float32, block_q=8, segments=True, batch=2)


def test_sliding_layer_after_cache_gqa8_tau_fp32():
    _check(seq_q=45, heads=8, kv_heads=1, extent=20, window=20, q_offset=19, dtype=jnp.float32, block_q=4)


def test_full_layer_extent_beyond_length_after_cache_gqa8_bf16():
    _check(seq_q=50, heads=8, kv_heads=1, extent=100, q_offset=21, dtype=jnp.bfloat16, block_q=4, tau=False)


def test_sliding_layer_gqa4_tau_segments_bf16():
    _check(seq_q=70, heads=8, kv_heads=2, extent=24, window=24, dtype=jnp.bfloat16, block_q=8, segments=True)


def test_rejects_queries_past_the_keys():
    (q, k, v, r, p), *_ = _inputs(1, 8, 8, 4, 1, 8, jnp.float32, 0)
    with pytest.raises(ValueError):
        rel_flash_attention(q, k, v, r, p, q_offset=1)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU run compiles the kernels for real")
def test_kernels_lower_to_triton_at_inkling_tile_sizes():
    """Interpret mode cannot catch ops that the Triton lowering lacks; lowering for CUDA can, without a GPU, on
    jaxlibs that embed the Triton IR in the HLO (newer ones compile it at lowering time, which needs a GPU)."""
    if jax.__version_info__ > (0, 10, 2):
        pytest.skip("this jaxlib compiles Triton IR while lowering")
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16)
              for s in ((1, 256, 16, 128), (1, 256, 2, 128), (1, 256, 2, 128), (1, 256, 16, D_REL), (D_REL, 64))]

    def loss(*xs):
        return rel_flash_attention(*xs, window=64, interpret=False, forward_impl="triton").astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*shapes).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3
