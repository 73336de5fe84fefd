"""Fused decode prologue against the unfused jnp reference: interpret mode on CPU, compiled on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attn_prologue import PrologueBlocks, attn_prologue, reference

# 8 KV heads in groups of 2 (4 programs along heads), 2 query heads per KV head; 5 tokens; small D.
TOKENS, HEADS, KV_HEADS, DIM = 5, 16, 8, 16
POOL_SLOTS, CACHE_SLOTS, WIDTH = 9, 23, 4
BLOCKS = PrologueBlocks(kv_heads=2, num_warps=4)
NAMES = ("q_out", "k_out", "v_out", "k_pool", "v_pool", "k_cache", "v_cache")


def make_inputs(seed, dtype, with_tau):
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def normal(shape, dt=dtype):
        return jax.random.normal(next(keys), shape, jnp.float32).astype(dt)

    kv = KV_HEADS * DIM
    return dict(
        q=normal((TOKENS, HEADS * DIM)), k=normal((TOKENS, kv)), v=normal((TOKENS, kv)),
        k_conv_w=normal((kv, WIDTH), jnp.float32), v_conv_w=normal((kv, WIDTH), jnp.float32),
        q_norm_w=normal((DIM,)), k_norm_w=normal((DIM,)),
        k_pool=normal((POOL_SLOTS, WIDTH - 1, kv)), v_pool=normal((POOL_SLOTS, WIDTH - 1, kv)),
        slots=jax.random.permutation(next(keys), POOL_SLOTS)[:TOKENS],
        k_cache=normal((CACHE_SLOTS, KV_HEADS, DIM)), v_cache=normal((CACHE_SLOTS, KV_HEADS, DIM)),
        write_idx=jax.random.permutation(next(keys), CACHE_SLOTS)[:TOKENS],
        tau=1.0 + jax.random.uniform(next(keys), (TOKENS,)) if with_tau else None,
    )


def assert_outputs_match(got, want):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if name in ("q_out", "k_out", "k_cache"):  # normed: the mean may be summed in another order
            tol = 1e-5 if want[0].dtype == jnp.float32 else 1.6e-2
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
        else:  # conv'd V and the pools are the same arithmetic in the same order
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_tau", [False, True])
def test_prologue_matches_reference(dtype, with_tau):
    inputs = make_inputs(10 + with_tau, dtype, with_tau)
    want = reference.attn_prologue(**inputs)
    got = attn_prologue(**inputs, blocks=BLOCKS)
    # Rows of the pools and caches that no token touches must survive: only an aliased output does that.
    assert_outputs_match(got, want)


def test_prologue_updates_donated_pools_and_caches_in_place():
    inputs = make_inputs(20, jnp.bfloat16, True)
    want = reference.attn_prologue(**inputs)
    aliased = ("k_pool", "v_pool", "k_cache", "v_cache")
    addresses = [inputs[name].unsafe_buffer_pointer() for name in aliased]
    step = jax.jit(functools.partial(attn_prologue, blocks=BLOCKS), donate_argnames=aliased)
    got = step(**inputs)
    assert all(inputs[name].is_deleted() for name in aliased)
    assert [a.unsafe_buffer_pointer() for a in got[3:]] == addresses
    assert_outputs_match(got, want)


def test_tokens_with_a_negative_slot_write_nothing():
    """Idle rows of a decode batch pass write_idx -1: their pool rows and every cache slot stay as they were."""
    inputs = make_inputs(30, jnp.float32, False)
    idle = jnp.array([1, 3])
    inputs["write_idx"] = inputs["write_idx"].at[idle].set(-1)
    want = reference.attn_prologue(**inputs)
    got = attn_prologue(**inputs, blocks=BLOCKS)
    assert_outputs_match(got, want)
    for pool, name in ((got[3], "k_pool"), (got[4], "v_pool")):
        np.testing.assert_array_equal(pool[inputs["slots"][idle]], inputs[name][inputs["slots"][idle]])
        busy = inputs["slots"][jnp.array([0, 2, 4])]
        assert not np.allclose(pool[busy], inputs[name][busy])
    written = np.zeros(CACHE_SLOTS, bool)
    written[np.asarray(inputs["write_idx"][inputs["write_idx"] >= 0])] = True
    np.testing.assert_array_equal(got[5][~written], inputs["k_cache"][~written])
    assert not np.allclose(got[5][written], inputs["k_cache"][written])
