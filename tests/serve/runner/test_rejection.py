"""The round's accept/resample rule (`serve.runner.rejection.verify`) emits tokens distributed as plain sampling
draws them: on a 6-token vocabulary, 100,000 seeded rows of one call, each emitted position is checked against the
target distribution (temperature, top-k, top-p applied) with a chi-square test.

Power: at alpha = 1e-4 with up to 5 degrees of freedom the critical value is ~25.7. The conditional positions see
fewer rows (those that accepted the drafts before them, here > 9,000); moving 0.03 of probability between two
tokens of probability ~0.25 gives a noncentrality of 9,000 x 2 x 0.03^2 / 0.25 = 65 there, detected with power
> 0.999. The draft is a token of moderate probability, so both branches (accept, resample the residual) carry
thousands of rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serve.engine.sampling_params import SamplingParams
from serve.runner.rejection import verify
from serve.runner.sampler import batch_of

VOCAB, ROWS = 6, 100_000
LOGITS = np.array([[2.0, 1.6, 1.2, 0.3, -0.5, -1.0],  # position 0: after the row's last token
                   [0.2, 1.5, 1.4, 0.9, 0.0, -2.0],  # position 1: after draft 1
                   [1.0, 0.1, 0.8, 1.1, -0.3, 0.4]], np.float32)  # position 2: after draft 2 (the bonus)
DRAFTS = [1, 1]  # draft 1 is position 0's second most likely token; draft 2 position 1's most likely


def target(logits, temperature, top_k, top_p):
    """The distribution plain sampling draws from, by its definition (sort, cut at top_k, then the smallest head
    holding top_p of the rest)."""
    p = np.exp(logits / temperature - np.max(logits / temperature))
    order = np.argsort(-p)
    keep = np.zeros(VOCAB, bool)
    keep[order[:top_k]] = True
    p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    head = np.cumsum(p[order])
    keep[order[np.searchsorted(head, top_p) + 1:]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def chi_square_p_value(tokens, expected):
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[expected == 0].sum() == 0  # nothing drawn outside the target's support
    support = expected > 0
    share = expected[support].astype(np.float64)
    share /= share.sum()
    return stats.chisquare(counts[support], share * counts.sum()).pvalue


@pytest.mark.parametrize("full", [True, False], ids=["filters", "temperature only"])
def test_emitted_tokens_follow_the_target_distribution(full):
    temperature, top_k, top_p = (0.8, 5, 0.9) if full else (0.8, 0, 1.0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    batch = batch_of([params] * ROWS, [7] * ROWS)
    batch = batch.replace(seed=np.arange(ROWS, dtype=np.uint32) * 7919)  # a different seed per row
    ids = np.tile(np.array([[0] + DRAFTS], np.int32), (ROWS, 1))
    logits = np.tile(LOGITS[None], (ROWS, 1, 1))
    zeros = np.zeros((ROWS, VOCAB), np.int32)
    out, accepted = jax.jit(verify, static_argnames=("num_top", "full"))(
        jnp.asarray(logits), jnp.asarray(ids), jnp.full((ROWS,), 3, jnp.int32), batch, zeros, zeros.astype(bool),
        num_top=1, full=full)
    tokens, accepted = np.asarray(out.tokens), np.asarray(accepted)
    expected = [target(LOGITS[j], temperature, top_k or VOCAB, top_p) for j in range(3)]
    # Position j is emitted where the drafts before it were accepted; its token is then distributed as p_j.
    for j in range(3):
        reached = accepted >= j
        assert reached.sum() > 9000
        assert chi_square_p_value(tokens[reached, j], expected[j]) > 1e-4, j
    # The rule itself: draft 1 accepted with probability p_0(d1) (a binomial 5-sigma band)
    rate, chance = (accepted >= 1).mean(), expected[0][DRAFTS[0]]
    assert abs(rate - chance) < 5 * np.sqrt(chance * (1 - chance) / ROWS)


def test_a_seeded_row_draws_the_same_tokens_and_greedy_rows_keep_the_argmax_prefix():
    batch = batch_of([SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0)], [4, 4])
    ids = jnp.asarray([[0] + DRAFTS, [0, 0, 3]], jnp.int32)  # row 1: draft 1 is position 0's argmax, draft 2 not
    logits = jnp.asarray(np.stack([LOGITS, LOGITS]))
    zeros = jnp.zeros((2, VOCAB), jnp.int32)
    run = lambda: verify(logits, ids, jnp.asarray([3, 3]), batch, zeros, zeros.astype(bool), 1, False)  # noqa: E731
    (first, accepted), (again, _) = run(), run()
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert int(accepted[1]) == 1 and int(first.tokens[1, 1]) == int(np.argmax(LOGITS[1]))
