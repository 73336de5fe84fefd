"""The on-device sampler: one row per sequence, each with its own parameters, in one fixed-shape program.

Order: penalties -> (greedy argmax | temperature -> top-k -> top-p -> min-p -> Gumbel-max draw). Reported
logprobs are those of the model's own distribution (before penalties and temperature), as OpenAI reports them.
The random draw of a row depends only on (seed, index of the token in its output), so a seeded request gives
the same tokens alone or batched with others, and after a preemption.
"""

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingBatch:
    """Per-row parameters [R] (see `serve.sampling.SamplingParams`)."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array  # <= 0: off
    min_p: jax.Array
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    seed: jax.Array  # uint32
    index: jax.Array  # int32: how many tokens the row has sampled before this one


@struct.dataclass
class Sampled:
    tokens: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] logprob of the chosen token
    top_ids: jax.Array  # [R, K]
    top_logprobs: jax.Array  # [R, K]


def sample(logits, params: SamplingBatch, counts, prompt_mask, num_top: int, full: bool = True) -> Sampled:
    """logits [R, V]; counts [R, V] (output tokens so far) and prompt_mask [R, V] feed the penalties."""
    adjusted = apply_penalties(logits.astype(jnp.float32), counts, prompt_mask, params)
    return choose(logits, adjusted, params, num_top, full)


def choose(logits, adjusted, params: SamplingBatch, num_top: int, full: bool) -> Sampled:
    """Pick each row's token from its penalised logits `adjusted`; logprobs come from the model's `logits`.

    Branch-free: a data-dependent `lax.cond` makes the GPU program wait for its predicate on the host, which
    stops the host from queueing the next decode step ahead. `full` (static) adds the top-k / top-p filters
    and the top-`num_top` logprobs, which cost a sort and a top-k over [R, V]; without it those are off (the
    caller sends rows that need them to a `full` program)."""
    # logprob = logit - logsumexp: only the chosen (and top) entries, never the whole [R, V] log-softmax
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    adjusted = adjusted.astype(jnp.float32)
    greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
    tokens = jnp.where(params.temperature == 0, greedy, _draw(adjusted, params, full))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    rows = logits.shape[0]
    if full:
        top_logits, top_ids = jax.lax.top_k(logits, num_top)
        top_logprobs = top_logits - lse[:, None]
    else:
        top_logprobs, top_ids = jnp.zeros((rows, num_top), jnp.float32), jnp.zeros((rows, num_top), jnp.int32)
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)


def apply_penalties(x, counts, prompt_mask, params: SamplingBatch):
    seen = prompt_mask | (counts > 0)
    rep = params.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - params.frequency[:, None] * counts - params.presence[:, None] * (counts > 0)


def _draw(x, params: SamplingBatch, filtered: bool):
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    x = x / temperature[:, None]
    if filtered:
        x = top_k_top_p(x, params.top_k, params.top_p)
    floor = jnp.log(jnp.maximum(params.min_p, 1e-30))[:, None]
    x = jnp.where((params.min_p[:, None] > 0) & (x - x.max(-1, keepdims=True) < floor), -jnp.inf, x)

    def gumbel(seed, index):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), index), x.shape[-1:])

    noise = jax.vmap(gumbel)(params.seed, params.index)
    return jnp.argmax(x + noise, axis=-1).astype(jnp.int32)


def top_k_top_p(x, top_k, top_p):
    """Keep the top_k largest (<= 0: all), then the smallest head of those whose probability reaches top_p."""
    vocab = x.shape[-1]
    ranked = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    in_k = jnp.arange(vocab)[None, :] < k
    probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(in_k & (before < top_p[:, None]), axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(ranked, jnp.maximum(kept - 1, 0), axis=-1)
    return jnp.where(x >= cutoff, x, -jnp.inf)
