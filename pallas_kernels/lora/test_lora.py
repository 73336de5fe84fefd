"""The LoRA kernels against their reference: both forms over 3+ tiles of every tiled axis, at sizes no tile
divides, in fp32 and bf16, with rows of the base and of several adapters mixed; in Pallas's interpreter on CPU,
compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora import GatheredBlocks, SegmentedBlocks, lora_add, reference

FAN_IN, RANK, FAN_OUT = 53, 5, 61  # 4 tiles of 16 each way; the rank padded to 16
SLOTS = 4
# 50 tokens in 4 tiles of 16: runs across tile edges, a tile of four runs, a run of the base, and a slot
# that comes back after others
SEGMENTS = np.array([1] * 10 + [0] * 7 + [3] * 20 + [2] * 3 + [1] * 4 + [3] * 6)
SEGMENTED = SegmentedBlocks(rows=16, k=16, out=16)


def _normal(key, shape, dtype):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def _pools(dtype):
    """Factors of SLOTS slots, slot 0's NaN: the kernels never read the base's slot."""
    a = _normal(1, (SLOTS, FAN_IN, RANK), dtype).at[0].set(jnp.nan)
    b = _normal(2, (SLOTS, RANK, FAN_OUT), dtype).at[0].set(jnp.nan)
    return a, b, jnp.array([0.0, 0.5, 2.0, 1.0], jnp.float32)


def _check(got, y, x, a, b, scale, slots):
    """got equals the reference (slot 0's factors zero there) within the rounding of y's dtype, and the base's
    rows are y's exactly."""
    want = reference.lora_add(y, x, a.at[0].set(0), b.at[0].set(0), scale, slots)
    assert got.shape == y.shape and got.dtype == y.dtype
    tol = 1e-5 if y.dtype == jnp.float32 else 1e-2
    got, want, y = (np.asarray(v, np.float32) for v in (got, want, y))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    base = np.asarray(slots) == 0
    np.testing.assert_array_equal(got[base], y[base])
    assert np.abs(got[~base] - y[~base]).max() > 0.1  # the adapters change the other rows


@pytest.mark.parametrize("dtype, k_tiles", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.float32, 3)])
def test_gathered_form_matches_reference(dtype, k_tiles):
    """The shrink's input columns split over 4 programs of one tile, or 2 of three (the last past the end)."""
    slots = jnp.array([0, 1, 3, 3, 0, 2, 1])  # a decode step: one token per row
    x, y = _normal(3, (7, FAN_IN), dtype), _normal(4, (7, FAN_OUT), dtype)
    a, b, scale = _pools(dtype)
    blocks = GatheredBlocks(k=16, out=16, k_tiles=k_tiles)
    _check(lora_add(y, x, a, b, scale, slots, blocks=blocks), y, x, a, b, scale, slots)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_segmented_form_matches_reference(dtype):
    slots = jnp.asarray(SEGMENTS)
    x, y = _normal(5, (len(SEGMENTS), FAN_IN), dtype), _normal(6, (len(SEGMENTS), FAN_OUT), dtype)
    a, b, scale = _pools(jnp.float32)
    _check(lora_add(y, x, a, b, scale, slots, blocks=SEGMENTED), y, x, a, b, scale, slots)


def test_segmented_form_is_right_for_slots_in_any_order():
    """Every token its own run (a tile of 16 runs): slow, still right."""
    slots = jnp.asarray(np.random.default_rng(0).integers(0, SLOTS, 40))
    x, y = _normal(7, (40, FAN_IN), jnp.float32), _normal(8, (40, FAN_OUT), jnp.float32)
    a, b, scale = _pools(jnp.float32)
    _check(lora_add(y, x, a, b, scale, slots, blocks=SEGMENTED), y, x, a, b, scale, slots)


@pytest.mark.parametrize("tokens, form", [(1, "gathered"), (3, "gathered"), (16, "segmented")])
def test_rows_of_tokens_take_the_form_their_length_calls_for(tokens, form):
    """[rows, tokens, in]: every token of a row with the row's slot; decode-sized rows gathered, chunks
    segmented (by the kernels the step holds)."""
    slots = jnp.array([2, 0, 2, 1])
    x, y = _normal(9, (4, tokens, FAN_IN), jnp.float32), _normal(10, (4, tokens, FAN_OUT), jnp.float32)
    a, b, scale = _pools(jnp.float32)
    assert f"lora_{form}_shrink" in str(jax.make_jaxpr(lambda *v: lora_add(*v))(y, x, a, b, scale, slots))
    got = lora_add(y, x, a, b, scale, slots)
    flat = lambda v: v.reshape(4 * tokens, -1)  # noqa: E731
    _check(flat(got), flat(y), flat(x), a, b, scale, jnp.repeat(slots, tokens))


@pytest.mark.parametrize("change, message", [
    (dict(x=np.zeros((7, FAN_IN + 1))), r"do not take x \(7, 54\)"),
    (dict(y=np.zeros((6, FAN_OUT))), r"must be \[rows, ..., in\] and \[rows, ..., out\]"),
    (dict(scale=np.zeros(SLOTS + 1)), r"must be \[slots, in, rank\]"),
    (dict(slots=np.zeros(7, np.float32)), r"one integer per row"),
])
def test_bad_arguments_are_refused_with_what_is_wrong(change, message):
    a, b, scale = _pools(jnp.float32)
    args = dict(y=np.zeros((7, FAN_OUT)), x=np.zeros((7, FAN_IN)), a=a, b=b, scale=scale, slots=np.zeros(7, np.int32))
    with pytest.raises(ValueError, match=message):
        lora_add(**{**args, **change})


def test_tiles_must_be_powers_of_two():
    with pytest.raises(ValueError, match="rows must be a power of two >= 16, got 8"):
        SegmentedBlocks(rows=8)
    with pytest.raises(ValueError, match="out must be a power of two >= 1, got 48"):
        GatheredBlocks(out=48)
