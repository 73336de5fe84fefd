"""Speculative decoding's acceptance, summarised from rounds of (drafts verified, drafts accepted)."""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Acceptance:
    rounds: int
    mean_length: float  # tokens emitted per round: accepted drafts + the target's own token
    position_rates: tuple[float, ...]  # position i + 1: accepted / verified drafts at that position


def summarize(rounds: Iterable[tuple[int, int]]) -> Acceptance:
    rounds = list(rounds)
    longest = max((verified for verified, _ in rounds), default=0)
    verified = [sum(v > i for v, _ in rounds) for i in range(longest)]
    accepted = [sum(a > i for _, a in rounds) for i in range(longest)]
    mean = sum(a + 1 for _, a in rounds) / len(rounds) if rounds else 0.0
    return Acceptance(len(rounds), mean, tuple(a / v for a, v in zip(accepted, verified)))
