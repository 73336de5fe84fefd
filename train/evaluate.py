"""Held-out evaluation during and after training (`train.run --eval-data`): the mean next-token loss and
perplexity over every counted token of a fixed set of packed rows (the same tokens every time), the MTP head's
loss when the model has one, and once, on the same tokens, the unigram and bigram baselines of the training
rows (`train.ngram`).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from train.data import Packed
from train.ngram import NgramBaselines


class Evaluator:
    def __init__(self, packed: Packed, rows_per_batch: int):
        """rows_per_batch: rows per evaluation batch; the last batch is filled with empty rows (segment 0),
        which count nothing."""
        self.packed, self.rows_per_batch = packed, rows_per_batch

    def batches(self):
        n, size = len(self.packed), self.rows_per_batch
        for start in range(0, n, size):
            rows = self.packed.rows(np.arange(start, min(start + size, n)))
            pad = size - rows["input_ids"].shape[0]
            yield {k: np.pad(v, ((0, pad), (0, 0)))[None] for k, v in rows.items()}

    def evaluate(self, trainer, state, frozen) -> dict[str, float]:
        """{"eval_loss", "eval_perplexity", "eval_tokens"} (+ "eval_mtp_loss") of the model in `state`."""
        total: dict[str, float] = {}
        for batch in self.batches():
            sums = jax.device_get(trainer.eval_sums(state, frozen, trainer.place_batch(batch)))
            for k, v in sums.items():
                total[k] = total.get(k, 0.0) + float(v)
        tokens = max(total.pop("tokens"), 1.0)
        out = {"eval_loss": total["loss"] / tokens, "eval_tokens": int(tokens)}
        out["eval_perplexity"] = math.exp(out["eval_loss"])
        if "mtp_loss" in total:
            out["eval_mtp_loss"] = total["mtp_loss"] / tokens
        return out

    def baselines(self, train_rows: Packed, vocab_size: int) -> dict[str, float]:
        """{"eval_unigram_loss", "eval_bigram_loss"} (and their perplexities) of count models of `train_rows`,
        on the evaluated tokens."""
        scores = NgramBaselines.fit(train_rows, vocab_size).losses(self.packed)
        out = {}
        for name in ("unigram", "bigram"):
            out[f"eval_{name}_loss"] = scores[f"{name}_loss"]
            out[f"eval_{name}_perplexity"] = math.exp(scores[f"{name}_loss"])
        return out
