"""ShortConv kernels against the pure-jnp reference: interpret mode on CPU, compiled on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.shortconv import DecodeBlocks, StripBlocks, reference, shortconv_decode, shortconv_prefill

# 37 rows in runs of 16 (3 runs, the last ragged) in loop steps of 4 rows; 100 channels in strips of 32 (4 strips,
# the last ragged).
BATCH, SEQ, CHANNELS, WIDTH = 2, 37, 100, 4
STRIP = StripBlocks(channels=32, rows=16, unroll=4, num_warps=4)
WHOLE_RUNS_SEQ = 48  # 3 runs of 16 rows, none ragged: the kernel's unclamped addressing
DECODE = DecodeBlocks(channels=32, num_warps=4)
TOKENS, POOL_SLOTS = 5, 11


def assert_close(got, want):
    tol = 1e-5 if want.dtype == jnp.float32 else 1.6e-2  # bf16: one rounding step apart at most
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def segment_ids(key, seq=SEQ):
    """Row 0 changes segment at rows 1, 8 (a loop-step edge), 16 (a run edge), 17 and 30; row 1 at random places."""
    fixed = jnp.cumsum(jnp.zeros(seq, jnp.int32).at[jnp.array([1, 8, 16, 17, 30])].set(1))
    drawn = jnp.cumsum(jax.random.bernoulli(key, 0.2, (seq,)).astype(jnp.int32))
    return jnp.stack([fixed, drawn]) + 3  # ids need not start at 0


CASES = ["plain", "state", "segments", "lengths", "all"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_prefill_matches_reference(case, dtype):
    check_prefill(functools.partial(shortconv_prefill, blocks=STRIP), case, dtype)


def test_prefill_of_whole_runs_matches_reference():
    check_prefill(functools.partial(shortconv_prefill, blocks=STRIP), "all", jnp.bfloat16, seq=WHOLE_RUNS_SEQ)


def check_prefill(kernel, case, dtype, seq=SEQ):
    keys = jax.random.split(jax.random.key(sum(map(ord, case))), 4)
    x = normal(keys[0], (BATCH, seq, CHANNELS), dtype)
    w = normal(keys[1], (CHANNELS, WIDTH), jnp.float32)
    state = normal(keys[2], (BATCH, WIDTH - 1, CHANNELS), dtype) if case in ("state", "all") else None
    segments = segment_ids(keys[3], seq) if case in ("segments", "all") else None
    lengths = jnp.array([2, 30]) if case in ("lengths", "all") else None  # 2 < 3: part of the state survives
    y, new_state = kernel(x, w, state, segments, lengths)
    y_ref, state_ref = reference.shortconv_prefill(x, w, state, segments, lengths)
    assert y.dtype == dtype and new_state.shape == (BATCH, WIDTH - 1, CHANNELS)
    assert_close(y, y_ref)
    np.testing.assert_array_equal(np.asarray(new_state, np.float32), np.asarray(state_ref, np.float32))


def decode_inputs(seed, dtype):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = normal(keys[0], (TOKENS, CHANNELS), dtype)
    w = normal(keys[1], (CHANNELS, WIDTH), jnp.float32)
    pool = normal(keys[2], (POOL_SLOTS, WIDTH - 1, CHANNELS), dtype)
    slots = jax.random.permutation(keys[3], POOL_SLOTS)[:TOKENS]
    return x, w, pool, slots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_matches_reference(dtype):
    x, w, pool, slots = decode_inputs(1, dtype)
    y_ref, pool_ref = reference.shortconv_decode(x, w, pool, slots)
    y, new_pool = shortconv_decode(x, w, pool, slots, blocks=DECODE)
    assert_close(y, y_ref)
    # Rows of slots not decoded are left as they were: that only holds if the pool really is aliased.
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32))


def test_decode_updates_a_donated_pool_in_place():
    x, w, pool, slots = decode_inputs(2, jnp.bfloat16)
    pool_ref = reference.shortconv_decode(x, w, pool, slots)[1]
    step = jax.jit(functools.partial(shortconv_decode, blocks=DECODE), donate_argnums=2)
    address = pool.unsafe_buffer_pointer()
    _, new_pool = step(x, w, pool, slots)
    assert pool.is_deleted()
    assert new_pool.unsafe_buffer_pointer() == address
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(pool_ref, np.float32))


def test_prefill_then_decode_steps_equal_one_prefill():
    """A chunk's final state, placed in a pool slot, lets decode steps continue the sequence exactly."""
    keys = jax.random.split(jax.random.key(3), 3)
    steps = 3
    x = normal(keys[0], (1, SEQ + steps, CHANNELS), jnp.float32)
    w = normal(keys[1], (CHANNELS, WIDTH), jnp.float32)
    y_full, _ = shortconv_prefill(x, w, blocks=STRIP)
    _, state = shortconv_prefill(x[:, :SEQ], w, blocks=STRIP)
    pool = normal(keys[2], (POOL_SLOTS, WIDTH - 1, CHANNELS), jnp.float32).at[4].set(state[0])
    for t in range(SEQ, SEQ + steps):
        y, pool = shortconv_decode(x[:, t], w, pool, jnp.array([4]), blocks=DECODE)
        assert_close(y, y_full[:, t])
