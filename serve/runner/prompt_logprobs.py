"""Prompt logprobs: each prompt token's log-probability given the tokens before it, its rank, and the most likely
tokens at its place, computed in the prefill that runs anyway (`StepPrograms.prefill` with targets).

Position j of a chunk predicts token j + 1, so a chunk scores the prompt tokens after each of its positions, up to
the prompt's last token (the last position predicts the first output token: the sampler's). A long prompt's
logprobs come chunk by chunk. The log-softmax is taken in float32 over the whole vocabulary, and a token's own
logprob and the top ones are read from the same array, so a greedy token's logprob equals the best one exactly.
The head runs over blocks of positions (`score_positions`): the whole-vocabulary logits of a step's every
position, their log-softmax and top-k, at once, would take many GiB beside the KV pool (33 rows x 128 tokens x
200k tokens of vocabulary are 3.4 GB per float32 array).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from serve.engine.outputs import Sample
from serve.engine.scheduler import Chunk

SCORE_BLOCK = 256  # positions whose logits are held at once (a divisor of the step's positions, at most this)


def prompt_targets(group: list[Chunk], index: list[int], rows: int, chunk: int) -> np.ndarray:
    """[rows, chunk] int32: at each position of a scoring chunk's row (group[i] in row index[i]), the prompt token
    it predicts; -1 where nothing is scored (padding, rows that did not ask, the prompt's last position)."""
    targets = np.full((rows, chunk), -1, np.int32)
    for c, row in zip(group, index):
        if c.scores:
            seq, start = c.seq, c.seq.num_cached
            end = min(start + c.num_tokens, seq.num_prompt - 1)
            targets[row, :max(end - start, 0)] = seq.token_ids[start + 1:end + 1]
    return targets


def score(logits, targets, num_top: int) -> jax.Array:
    """logits [..., V], targets [...] -> int32 [..., 3 + 2K]: per position the target, its logprob (bit-cast)
    and rank (1 + how many tokens are more likely), the K most likely ids and their logprobs (bit-cast)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[..., None], axis=-1)
    rank = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
    as_int = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)  # noqa: E731
    return jnp.concatenate([targets[..., None], as_int(chosen), rank[..., None], top_ids.astype(jnp.int32),
                            as_int(top_logprobs)], axis=-1)


def score_positions(logits_of, hidden, targets, num_top: int) -> jax.Array:
    """hidden [R, T, H], targets [R, T] -> `score` [R, T, 3 + 2K], the logits (`logits_of`: [N, H] -> [N, V]) made
    and scored a block of positions at a time."""
    rows, chunk, width = hidden.shape
    block = math.gcd(rows * chunk, SCORE_BLOCK)
    scored = jax.lax.map(lambda b: score(logits_of(b[0]), b[1], num_top),
                         (hidden.reshape(-1, block, width), targets.reshape(-1, block)))
    return scored.reshape(rows, chunk, -1)


def read_prompt_logprobs(scored: np.ndarray, row: int, num_top: int) -> list[Sample]:
    """Row `row`'s scored positions of a host read-out of `score` [R, T, 3 + 2K], each with its `num_top` most
    likely tokens."""
    ints = np.asarray(scored[row], np.int32)
    ints = ints[ints[:, 0] >= 0]  # the scored positions lead the row
    floats, k = ints.view(np.float32), (ints.shape[-1] - 3) // 2
    top_ids, top_logprobs = ints[:, 3:3 + num_top].tolist(), floats[:, 3 + k:3 + k + num_top].tolist()
    return [Sample(int(ints[j, 0]), float(floats[j, 1]), tuple(zip(top_ids[j], top_logprobs[j])), rank=int(ints[j, 2]))
            for j in range(len(ints))]
