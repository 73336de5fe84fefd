"""Per-request sampling parameters: the one definition of their names, defaults and valid values.

The names are the OpenAI API's (plus the usual vLLM extensions), and every layer uses them: the request schema
(`serve.http.protocol`), these parameters, and the device sampler's per-row arrays (`serve.runner.sampler`).
Temperature 0 is greedy; top_k <= 0, top_p 1 and min_p 0 switch their filters off; presence and frequency
penalties act on the output so far, the repetition penalty on prompt and output. A seed makes a request's
samples reproducible whatever else runs beside it. Prompt logprobs (vLLM's `prompt_logprobs`) with max_tokens 0
score the prompt and generate nothing.
"""

from __future__ import annotations

import dataclasses

MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256


class InvalidParams(ValueError):
    """Sampling parameters that cannot be honoured (the API answers 400, naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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
    prompt_logprobs: int | None = None  # likewise for every prompt token after the first, given those before it
    skip_special_tokens: bool = True

    def __post_init__(self):
        checks = [
            ("max_tokens", self.max_tokens >= 0, "must be >= 0"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (off) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS and all(0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
             f"takes up to {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_LENGTH} characters"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0"),
        ]
        for param, ok, rule in checks:
            if not ok:
                raise InvalidParams(f"{param} {rule}", param)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_full_sampler(self) -> bool:
        """More than a temperature draw: filters, penalties or logprobs, which only the engine's `full` sampler
        programs compute (`serve.runner.sampler.sample`)."""
        return (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or self.uses_penalties
                or self.logprobs is not None)

    def for_choice(self, index: int, default_seed: int) -> "SamplingParams":
        """The parameters of choice `index` of an n > 1 request: each choice draws from its own seed."""
        base = default_seed if self.seed is None else self.seed
        return dataclasses.replace(self, seed=(base + index) % 2**32)
