"""Count baselines for held-out losses: a unigram and a bigram model of the training rows, scored on exactly
the (token, next token) pairs the model's loss counts (same segment, target's loss_mask set).

- unigram: add-one counts of the training targets over the whole vocabulary;
- bigram: interpolated absolute discounting (D = 0.75) down to that unigram, so a pair never seen in training
  still has a probability. No parameter is fitted on the held-out data.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from train.data import Packed

DISCOUNT = 0.75


def counted_pairs(packed: Packed) -> tuple[np.ndarray, np.ndarray]:
    """(previous, next) token ids [N] of every pair the next-token loss counts."""
    ids, seg, mask = packed.input_ids, packed.segment_ids, packed.loss_mask
    valid = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0) & (mask[:, 1:] > 0)
    return ids[:, :-1][valid].astype(np.int64), ids[:, 1:][valid].astype(np.int64)


@dataclasses.dataclass(frozen=True)
class NgramBaselines:
    vocab_size: int
    unigram: np.ndarray  # [V] probabilities
    pair_codes: np.ndarray  # sorted distinct previous * V + next of the training pairs
    pair_counts: np.ndarray  # their counts
    prev_counts: np.ndarray  # [V] pairs starting with each token
    prev_types: np.ndarray  # [V] distinct successors of each token

    @classmethod
    def fit(cls, packed: Packed, vocab_size: int) -> "NgramBaselines":
        prev, nxt = counted_pairs(packed)
        if prev.size == 0:
            raise ValueError("the training rows hold no counted token pairs")
        unigram = np.bincount(nxt, minlength=vocab_size).astype(np.float64) + 1.0
        codes, counts = np.unique(prev * vocab_size + nxt, return_counts=True)
        return cls(vocab_size, unigram / unigram.sum(), codes, counts,
                   np.bincount(prev, minlength=vocab_size).astype(np.float64),
                   np.bincount(codes // vocab_size, minlength=vocab_size).astype(np.float64))

    def losses(self, packed: Packed) -> dict[str, float]:
        """Mean negative log-likelihood (nats per token) of both baselines on the counted pairs of `packed`."""
        prev, nxt = counted_pairs(packed)
        if prev.size == 0:
            raise ValueError("the held-out rows hold no counted token pairs")
        codes = prev * self.vocab_size + nxt
        at = np.minimum(np.searchsorted(self.pair_codes, codes), len(self.pair_codes) - 1)
        pair = np.where(self.pair_codes[at] == codes, self.pair_counts[at], 0).astype(np.float64)
        seen = self.prev_counts[prev]
        context = np.maximum(seen, 1.0)
        backoff = np.where(seen > 0, DISCOUNT * self.prev_types[prev] / context, 1.0)
        bigram = np.maximum(pair - DISCOUNT, 0.0) / context + backoff * self.unigram[nxt]
        return {"unigram_loss": float(-np.log(self.unigram[nxt]).mean()),
                "bigram_loss": float(-np.log(bigram).mean()), "tokens": int(prev.size)}
