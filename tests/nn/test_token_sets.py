"""`InklingModel.extend_sets`: a set of decode rows and a set of prompt-chunk rows in one pass (every position-wise
module over both sets' tokens at once, the attention per set with the shared K/V pools passed from set to set)
equals the two sets run one after the other by `extend_routed`: hidden states, experts and every cache field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax import Backend, preset
from inkling_jax.nn.cache import init_cache
from inkling_jax.nn.token_sets import ChunkSet
from serve.random_weights import random_model
from serve.runner.cache_rows import take_rows
from tests.backends import REFERENCE

# tiny: sliding layers (window 8) and a full-attention layer, a dense MLP layer and MoE layers.
CONFIG = preset("tiny")
PAGE, PAGES_PER_ROW, CHUNK = 8, 6, 16
ROWS = 4  # rows 0-2 decode, row 3 takes a prompt chunk


# "pallas_decode" (interpreted on CPU): the decode set runs the fused decode prologue and the decode kernel.
BACKENDS = {"reference": REFERENCE, "pallas_decode": Backend.parse("reference,moe=dense,decode_attention=pallas")}


@pytest.fixture(scope="module", params=list(BACKENDS))
def model(request):
    return random_model(CONFIG, seed=2, backend=BACKENDS[request.param])


def _primed_cache(model):
    """A shared pool of pages, rows' pages interleaved; rows 0-2 hold 5, 13 and 20 tokens (within and past the
    window), row 3 holds 11 that its chunk continues."""
    cache = init_cache(CONFIG.text, ROWS, PAGE * PAGES_PER_ROW, page_size=PAGE, num_pages=ROWS * PAGES_PER_ROW + 3)
    table = np.random.default_rng(0).permutation(ROWS * PAGES_PER_ROW + 3)[:ROWS * PAGES_PER_ROW]
    cache = cache.replace(page_table=jnp.asarray(table.reshape(ROWS, PAGES_PER_ROW), jnp.int32))
    n_new = np.array([5, 13, 20, 11])
    ids = np.random.default_rng(1).integers(0, CONFIG.text.unpadded_vocab_size, (ROWS, 20)).astype(np.int32)
    _, cache, _ = jax.jit(model.extend_routed)(ids, cache, jnp.asarray(n_new))
    return cache


def _sets(cache):
    """The decode set (ids [3, 1] of rows 0-2, one of them idle) and the prefill set (a chunk [1, CHUNK] of 9 real
    tokens for row 3)."""
    rng = np.random.default_rng(2)
    decode_rows, prefill_rows = jnp.array([0, 1, 2]), jnp.array([3])
    decode = ChunkSet(jnp.asarray(rng.integers(0, 300, (3, 1)), jnp.int32), take_rows(cache, decode_rows),
                      jnp.array([1, 0, 1], jnp.int32))
    prefill = ChunkSet(jnp.asarray(rng.integers(0, 300, (1, CHUNK)), jnp.int32), take_rows(cache, prefill_rows),
                       jnp.array([9], jnp.int32))
    return decode, prefill


def test_two_sets_in_one_pass_equal_the_sets_one_after_the_other(model):
    decode, prefill = _sets(_primed_cache(model))

    @jax.jit
    def one_after_the_other(decode, prefill):
        hidden_d, cache_d, experts_d = model.extend_routed(decode.input_ids, decode.cache, decode.n_new)
        ids, cache, n_new, _ = prefill
        pools = [layer.replace(k=d.k, v=d.v) for layer, d in zip(cache.layers, cache_d.layers)]
        hidden_p, cache_p, experts_p = model.extend_routed(ids, cache.replace(layers=tuple(pools)), n_new)
        return [hidden_d, hidden_p], [cache_d, cache_p], [experts_d, experts_p]

    expected_hidden, expected_caches, expected_experts = one_after_the_other(decode, prefill)
    hidden, caches, experts = jax.jit(model.extend_sets)([decode, prefill])
    for got, want in zip(hidden, expected_hidden):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(experts[0], expected_experts[0])
    np.testing.assert_array_equal(experts[1][:, :9], expected_experts[1][:, :9])  # padding positions route noise
    for got, want in zip(caches, expected_caches):
        for name, got_leaf, want_leaf in zip(("lengths", "page_table"), (got.lengths, got.page_table),
                                             (want.lengths, want.page_table)):
            np.testing.assert_array_equal(got_leaf, want_leaf, err_msg=name)
        for i, (got_layer, want_layer) in enumerate(zip(got.layers, want.layers)):
            for field in ("k_conv", "v_conv", "attn_conv", "mlp_conv"):
                np.testing.assert_allclose(getattr(got_layer, field), getattr(want_layer, field), rtol=1e-5,
                                           atol=1e-5, err_msg=f"layer {i} {field}")
    # Each set's cache holds the pools with both sets' writes: the decode rows' and the chunk's.
    for got in caches:
        for i, (got_layer, want_layer) in enumerate(zip(got.layers, expected_caches[1].layers)):
            for field in ("k", "v"):
                np.testing.assert_allclose(getattr(got_layer, field), getattr(want_layer, field), rtol=1e-5,
                                           atol=1e-5, err_msg=f"layer {i} {field}")
