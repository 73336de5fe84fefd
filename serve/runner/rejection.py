"""Which drafted tokens a round keeps, so that its output is distributed exactly as plain decoding's.

Position j of a verify holds the target's logits after the row's last token and drafts d1 .. dj. p_j is what
the plain sampler would draw from there (penalties counting d1 .. dj, then temperature, top-k, top-p, min-p:
`sampler.target_logits`). The drafter proposes its argmax, so its distribution q_j is a point mass on d_{j+1}, and
speculative sampling's rule (accept with probability min(1, p/q); on a rejection draw from the normalised
residual max(0, p - q)) becomes: accept d_{j+1} with probability p_j(d_{j+1}); at the first rejection draw from
p_j without d_{j+1}; after the last accepted draft draw from p_j itself (the bonus token). Each emitted token is
then distributed as p given the tokens before it. Greedy rows accept exactly the drafts that equal the argmax
(their draw at a rejection is the argmax, which is not the draft).

The acceptance uniform and the draws depend only on the row's (seed, output index of the position), as the plain
sampler's draws do, so a seeded request gives the same tokens alone or batched, and after a preemption.
"""

import jax
import jax.numpy as jnp

from serve.runner.sampler import (SamplingBatch, apply_penalties, gumbel_noise, target_logits, uniform_noise,
                                  with_logprobs, without_logprobs)

ACCEPT_SEED_MIX = 0x2545F491  # the acceptance uniforms' stream, apart from the draws' (same seed and index)


def verify(logits, ids, n_new, params: SamplingBatch, counts, prompt_mask, num_top: int, full: bool,
           filters: bool = True):
    """logits [R, T, V] of a verify over ids [R, T] (each row's last token, then its drafts; n_new [R] = 1 + its
    drafts); params per row at the output index of position 0; counts and prompt_mask [R, V] the rows' penalty
    state (read with `full` only, which also computes logprobs and, with `filters`, filters: `sampler.sample`).

    Returns (Sampled [R, T(, N)]: position j's token is d_{j+1} where accepted, else its draw, with the model's
    own logprobs (zeros without `full`); accepted [R], the number of leading drafts kept)."""
    rows, width, vocab = logits.shape
    flat = logits.reshape(rows * width, vocab).astype(jnp.float32)
    spread = lambda x: jnp.repeat(x, width, axis=0)  # noqa: E731  [R, ...] -> [R * T, ...]
    p = jax.tree.map(spread, params)
    p = p.replace(index=p.index + jnp.tile(jnp.arange(width, dtype=jnp.int32), rows))
    x = flat
    if full:
        drafted = jax.nn.one_hot(ids[:, 1:], vocab, dtype=jnp.int32).cumsum(axis=1)
        before = jnp.concatenate([jnp.zeros((rows, 1, vocab), jnp.int32), drafted], axis=1)
        penalised = counts[:, None] + before * params.uses_penalties[:, None, None]
        x = apply_penalties(flat, penalised.reshape(rows * width, vocab), spread(prompt_mask), p)
    x = target_logits(x, p, filtered=full and filters)
    proposed = jnp.concatenate([ids[:, 1:], jnp.zeros((rows, 1), ids.dtype)], axis=1).reshape(-1)
    has_draft = (jnp.arange(width)[None, :] < n_new[:, None] - 1).reshape(-1)
    chance = jnp.exp(jnp.take_along_axis(x, proposed[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(x, axis=-1))
    uniform = uniform_noise(p.seed ^ jnp.uint32(ACCEPT_SEED_MIX), p.index, 1)[:, 0]
    greedy = p.temperature == 0
    agree = jnp.where(greedy, proposed == jnp.argmax(x, axis=-1), uniform < chance) & has_draft
    accepted = jnp.sum(jnp.cumprod(agree.reshape(rows, width), axis=1), axis=1)
    residual = jnp.where(has_draft[:, None] & (jnp.arange(vocab)[None, :] == proposed[:, None]), -jnp.inf, x)
    noise = jnp.where(greedy[:, None], 0.0, gumbel_noise(p.seed, p.index, vocab))
    draws = jnp.argmax(residual + noise, axis=-1).astype(jnp.int32).reshape(rows, width)
    tokens = jnp.where(jnp.arange(width)[None, :] < accepted[:, None], proposed.reshape(rows, width), draws)
    out = with_logprobs(flat, tokens.reshape(-1), num_top) if full else without_logprobs(tokens.reshape(-1), num_top)
    return jax.tree.map(lambda a: a.reshape(rows, width, *a.shape[1:]), out), accepted
