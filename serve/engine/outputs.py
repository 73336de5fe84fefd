"""What the engine hands out: a `Sample` per generated token, into its request's output parser, and an `Output` per
event of a request, to its sink (the last one of a sequence with the prompt's own logprobs, where asked)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Sample:
    """One sampled token of a sequence, from the device sampler's read-out (`ModelRunner.collect`) to the response
    that reports its logprobs; the text layers carry it beside the token's text."""

    token_id: int
    logprob: float  # of the model's own distribution (0 from the plain sampler, which computes none)
    top: tuple[tuple[int, float], ...]  # the request's `logprobs` most likely (token id, logprob), best first
    finish_reason: str | None = None  # set as the engine applies it: "stop" (EOS, a stop id) or "length"
    rank: int | None = None  # the token's rank in that distribution (1: the most likely); prompt logprobs only


@dataclasses.dataclass
class Output:
    """One event of a request: a token of choice `index` (its new text, maybe none) and its finish reason once it is
    done."""

    index: int
    deltas: list  # what the request's parser released (`serve.http.text_stream.Delta`s for the API)
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    num_output: int
    # With the sequence's last output, where its request asked for prompt logprobs: a Sample per prompt token after
    # the first (which has no logprob), `token_id` the prompt's own token, `top` its `prompt_logprobs` most likely
    prompt_logprobs: list[Sample] | None = None
    # With the sequence's last output, where the engine records routing (`EngineConfig.record_experts`): the experts
    # each MoE layer chose at every position but the last, [tokens - 1, MoE layers, top_k] int32
    routed_experts: np.ndarray | None = None
