"""The on-device sampler: filters, seeds and logprobs, the sort-free top-k / top-p, packed samples, the draw's
distribution and noise, penalties, the plain sampler against the full one, and the host's read-out of a row."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.runner.sampler import (
    SamplingBatch,
    gumbel_noise,
    with_logprobs,
    pack_samples,
    read_samples,
    sample,
    top_k_top_p,
    unpack_samples,
)

RNG = np.random.default_rng(0)


def batch(rows, **values):
    defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                    repetition_penalty=1.0, seed=0, index=0)
    defaults.update(values)
    dtypes = dict(top_k=jnp.int32, seed=jnp.uint32, index=jnp.int32)
    return SamplingBatch(**{k: jnp.broadcast_to(jnp.asarray(v, dtypes.get(k, jnp.float32)), (rows,))
                            for k, v in defaults.items()})


run_sampler = jax.jit(lambda logits, params, counts, mask: sample(logits, params, counts, mask, 3))


def draw(logits, counts=None, mask=None, **values):
    rows = logits.shape[0]
    counts = jnp.zeros(logits.shape, jnp.int32) if counts is None else counts
    mask = jnp.zeros(logits.shape, bool) if mask is None else mask
    return run_sampler(logits, batch(rows, **values), counts, mask)


def test_sampler_filters_seeds_and_logprobs():
    vocab = 12
    logits = jnp.asarray(RNG.normal(0, 2, (256, vocab)), jnp.float32)
    best = np.argmax(np.asarray(logits), -1)
    for filters in (dict(temperature=0.0), dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        np.testing.assert_array_equal(draw(logits, **filters, seed=jnp.arange(256)).tokens, best)
    out = draw(logits, seed=jnp.arange(256) % 7, index=3)
    np.testing.assert_allclose(out.logprobs, np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                                                                np.asarray(out.tokens)[:, None], 1)[:, 0], rtol=1e-6,
                               atol=1e-6)
    assert np.all(np.diff(np.asarray(out.top_logprobs), axis=1) <= 0)
    # A row's draw depends on its own seed and index only, not on its neighbours.
    same = draw(jnp.broadcast_to(logits[5], logits.shape), seed=5 % 7, index=3)
    assert np.all(np.asarray(same.tokens) == int(out.tokens[5]))
    top2 = np.argsort(-np.asarray(logits), -1)[:, :2]
    chosen = np.asarray(draw(logits, top_k=2, seed=jnp.arange(256)).tokens)
    assert all(chosen[i] in top2[i] for i in range(256))


def _kept_by_definition(x, top_k, top_p):
    """The kept entries of top-k then top-p in float64, and each row's distance from a float32 rounding call:
    the smallest gap between top_p and the mass before any of its top-k entries."""
    kept, margin = np.zeros(x.shape, bool), np.zeros(len(x))
    for i, row in enumerate(np.asarray(x, np.float64)):
        k = min(top_k[i], row.size) if top_k[i] > 0 else row.size
        ranked = np.sort(row)[::-1][:k]
        probs = np.exp(ranked - ranked[0]) / np.exp(ranked - ranked[0]).sum()
        before = np.cumsum(probs) - probs
        kept[i] = row >= ranked[max(int(np.sum(before < top_p[i])), 1) - 1]
        margin[i] = np.abs(before - top_p[i]).min()
    return kept, margin


@pytest.mark.parametrize("digit_bits", [2, 4])
def test_top_k_top_p_keeps_what_the_definition_keeps(digit_bits):
    checked = 0
    top_k_top_p_at = jax.jit(functools.partial(top_k_top_p, digit_bits=digit_bits))
    # the last: Inkling's vocabulary, where a float32 running sum of the probabilities reaches 1 before the row ends
    for rows, vocab, scale, shift in ((48, 7, 1.0, 0.0), (48, 300, 4.0, -50.0), (48, 1000, 0.3, 20.0),
                                      (48, 500, 30.0, 0.0), (8, 200058, 3.0, 0.0)):
        x = RNG.normal(0, scale, (rows, vocab)).astype(np.float32) + shift
        x[::5, ::7] = -np.inf  # entries a penalty or mask took out
        top_k = RNG.integers(-1, vocab + 3, rows).astype(np.int32)
        top_p = RNG.choice([1e-6, 0.2, 0.5, 0.9, 1.0], rows).astype(np.float32)
        top_k[:2], top_p[:2] = (0, -1), 1.0  # filters off: the whole row stays
        want, margin = _kept_by_definition(x, top_k, top_p)
        filtered = np.asarray(top_k_top_p_at(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
        kept = np.isfinite(filtered)
        clear = margin > 1e-4  # rows whose cut float32 sums cannot move
        np.testing.assert_array_equal(kept[clear], want[clear])
        checked += int(clear.sum())
        np.testing.assert_array_equal(filtered[kept], x[kept])  # kept values are the row's own, the rest -inf
        assert kept[top_p == 1e-6].sum(-1).tolist() == [1] * int((top_p == 1e-6).sum())
        assert (kept == np.isfinite(x))[(top_p == 1.0) & (top_k <= 0)].all()
    assert checked > 100
    # ties at the cut are all kept, whether top_k or top_p makes it
    tied = jnp.asarray([[1.0, 1.0, 1.0, 0.0, -2.0]] * 3)
    kept = np.isfinite(np.asarray(top_k_top_p_at(tied, jnp.asarray([2, 4, 4]), jnp.asarray([1.0, 0.5, 0.95]))))
    assert kept.tolist() == [[True] * 3 + [False] * 2, [True] * 3 + [False] * 2, [True] * 4 + [False]]


def test_samples_pack_into_one_array_and_back_exactly():
    logits = jnp.asarray(RNG.normal(0, 2, (5, 40)), jnp.float32)
    out = draw(logits, seed=jnp.arange(5))
    packed = jax.jit(pack_samples)(out)
    assert packed.dtype == jnp.int32 and packed.shape == (5, 2 + 2 * 3)
    back = unpack_samples(np.stack([packed, packed]))  # two steps, as a decode run fetches them
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(back, name)[1], np.asarray(getattr(out, name)))
    assert back.top_ids.shape == (2, 5, 3)


def test_sampler_draws_follow_the_softmax():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (4000, 4)))
    tokens = np.asarray(draw(logits, seed=jnp.arange(4000, dtype=jnp.uint32)).tokens)
    np.testing.assert_allclose(np.bincount(tokens, minlength=4) / 4000, probs, atol=0.03)
    hot = np.asarray(draw(logits, temperature=0.25, seed=jnp.arange(4000, dtype=jnp.uint32)).tokens)
    assert np.mean(hot == 0) > 0.85  # low temperature sharpens toward the mode


def test_gumbel_noise_is_standard_gumbel_independent_across_rows_positions_and_steps():
    seeds = jnp.arange(16, dtype=jnp.uint32)
    g = np.asarray(gumbel_noise(seeds, jnp.zeros(16, jnp.int32), 50000), np.float64)
    assert np.isfinite(g).all()
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.var() - np.pi ** 2 / 6) < 0.03
    assert np.abs(np.corrcoef(g) - np.eye(16)).max() < 0.03  # rows (seeds)
    assert abs(np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1]) < 0.01  # neighbouring positions
    later = np.asarray(gumbel_noise(seeds, jnp.ones(16, jnp.int32), 50000), np.float64)
    assert abs(np.corrcoef(g.ravel(), later.ravel())[0, 1]) < 0.01  # the next token's draw


def test_sampler_penalties():
    logits = jnp.asarray([[2.0, 1.9, -1.0, 0.5]] * 3, jnp.float32)
    counts = jnp.asarray([[1, 0, 0, 0]] * 3, jnp.int32)
    mask = jnp.asarray([[False, False, False, True]] * 3)
    greedy = dict(temperature=0.0)
    assert draw(logits, counts, mask, **greedy).tokens.tolist() == [0, 0, 0]
    assert draw(logits, counts, mask, presence_penalty=jnp.asarray([0.5, 0, 0]),
                frequency_penalty=jnp.asarray([0, 0.2, 0]), **greedy).tokens.tolist() == [1, 1, 0]
    # Repetition: a seen positive logit is divided, so 2.0 / 1.1 < 1.9.
    assert draw(logits, counts, mask, repetition_penalty=1.1, **greedy).tokens.tolist() == [1, 1, 1]


def test_the_plain_sampler_draws_what_the_full_one_draws_where_nothing_else_is_asked():
    logits = jnp.asarray(RNG.normal(0, 2, (96, 300)), jnp.float32)
    params = batch(96, temperature=jnp.tile(jnp.asarray([0.0, 0.7, 1.3]), 32), seed=jnp.arange(96), index=5)
    zeros = jnp.zeros(logits.shape, jnp.int32)
    full = jax.jit(lambda x: sample(x, params, zeros, zeros > 0, 3))(logits)
    plain = jax.jit(lambda x: sample(x, params, None, None, 3, full=False))(logits)
    np.testing.assert_array_equal(plain.tokens, full.tokens)
    assert len(set(np.asarray(plain.tokens)[1::3].tolist())) > 10  # sampled rows drew, not all the argmax
    assert not np.asarray(plain.logprobs).any() and plain.top_ids.shape == (96, 3)


def test_the_full_sampler_without_filters_draws_and_scores_as_with_them_where_no_row_filters():
    logits = jnp.asarray(RNG.normal(0, 2, (64, 300)), jnp.float32)
    params = batch(64, temperature=jnp.tile(jnp.asarray([0.0, 0.7, 1.3, 1.0]), 16), seed=jnp.arange(64), index=2,
                   presence_penalty=jnp.tile(jnp.asarray([0.0, 0.5]), 32))
    counts = jnp.asarray(RNG.integers(0, 2, logits.shape), jnp.int32)
    run = jax.jit(lambda x, filters: sample(x, params, counts, counts > 1, 3, filters=filters), static_argnums=1)
    with_filters, without = run(logits, True), run(logits, False)
    for got, want in zip(jax.tree.leaves(without), jax.tree.leaves(with_filters)):
        np.testing.assert_array_equal(got, want)
    filtered = jax.jit(lambda x: sample(x, params.replace(top_k=jnp.full((64,), 2, jnp.int32)), counts,
                                        counts > 1, 3, filters=False))(logits)
    np.testing.assert_array_equal(filtered.tokens, without.tokens)  # the static flag decides, not the rows


def test_a_rows_samples_are_read_out_with_the_top_tokens_asked_for():
    logits = jnp.asarray(RNG.normal(0, 2, (4, 40)), jnp.float32)
    out = draw(logits, seed=jnp.arange(4))
    host = unpack_samples(np.stack([np.asarray(pack_samples(out))] * 2))  # a run of two steps
    samples = read_samples(host, row=2, count=2, num_top=2)
    assert [s.token_id for s in samples] == [int(out.tokens[2])] * 2 and samples[0].logprob == float(out.logprobs[2])
    assert samples[1].top == tuple(zip(out.top_ids[2, :2].tolist(), out.top_logprobs[2, :2].tolist()))
    assert read_samples(host, row=0, count=1, num_top=0)[0].top == ()  # no logprobs asked: none carried


def test_no_top_tokens_asked_for_give_the_chosen_logprob_alone():
    logits = jnp.asarray(RNG.normal(0, 2, (4, 50)), jnp.float32)
    tokens = jnp.asarray([3, 0, 49, 17], jnp.int32)
    none, some = with_logprobs(logits, tokens, 0), with_logprobs(logits, tokens, 3)
    np.testing.assert_allclose(none.logprobs, jax.nn.log_softmax(logits)[jnp.arange(4), tokens], rtol=1e-6)
    np.testing.assert_array_equal(none.logprobs, some.logprobs)
    assert none.top_ids.shape == none.top_logprobs.shape == (4, 0)
    assert unpack_samples(pack_samples(none)).top_ids.shape == (4, 0)
