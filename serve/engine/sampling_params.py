"""Per-request sampling parameters (the host side; `sampler.py` applies them on device).

Semantics follow the OpenAI API plus the usual vLLM extensions: temperature 0 is greedy; top_k <= 0, top_p 1 and
min_p 0 switch their filters off; presence and frequency penalties act on the output so far, the repetition
penalty on prompt and output. A seed makes a request's samples reproducible whatever else runs beside it.
"""

from __future__ import annotations

import dataclasses


class InvalidParams(ValueError):
    """A request whose sampling parameters cannot be honoured (the API answers 400)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k most likely
    skip_special_tokens: bool = True

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidParams(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_full_sampler(self) -> bool:
        """More than a temperature draw: filters, penalties or logprobs, which only the engine's `full` sampler
        programs compute (`sampler.sample`)."""
        return (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or self.uses_penalties
                or self.logprobs is not None)

    def for_choice(self, index: int, default_seed: int) -> "SamplingParams":
        """The parameters of choice `index` of an n > 1 request: each choice draws from its own seed."""
        base = default_seed if self.seed is None else self.seed
        return dataclasses.replace(self, seed=(base + index) % 2**32)
