"""The prompts of a run: vLLM's `random` workload (nothing to download) or ShareGPT-format conversations from a
local file.

Random prompts are lists of token ids, which `/v1/completions` takes on every OpenAI-compatible server (vLLM,
SGLang, this one), so that their length is exact without a tokenizer on the client. The ids are drawn uniformly
from `token_range`, by default ids that are ordinary tokens in every common vocabulary (above the byte and control
tokens, below 30,000). ShareGPT prompts are text; their lengths are counted by a `count_tokens` function (the
server's `/tokenize`, see `client.server_token_counter`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import numpy as np

DEFAULT_TOKEN_RANGE = (1000, 30000)
# vLLM's pruning of ShareGPT pairs: too short a prompt or answer, or too long, is skipped.
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048


@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt: list[int] | str  # token ids (random) or text (ShareGPT)
    prompt_len: int  # tokens, as the client knows them; the server's `usage` has the last word
    output_len: int  # max_tokens of the request


def random_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths drawn uniformly from [floor(mean (1 - r)), ceil(mean (1 + r))], at least 1 (vLLM's definition:
    r = 0 is every length `mean`)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"the range ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, n)


def random_prompts(n: int, input_len: int, output_len: int, range_ratio: float, rng: np.random.Generator,
                   token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[Prompt]:
    inputs = random_lengths(input_len, range_ratio, n, rng)
    outputs = random_lengths(output_len, range_ratio, n, rng)
    return [Prompt(rng.integers(*token_range, int(i)).tolist(), int(i), int(o)) for i, o in zip(inputs, outputs)]


def sharegpt_prompts(path: str, n: int, rng: np.random.Generator, count_tokens: Callable[[str], int],
                     output_len: int | None = None) -> list[Prompt]:
    """n prompts from a ShareGPT-format JSON file (a list of {"conversations": [{"from", "value"}, ...]}): each
    conversation's first turn is the prompt and the second's length in tokens the output length (or `output_len`
    for all), in a shuffled order; pairs too short or too long are skipped as vLLM skips them."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [[turn["value"] for turn in entry["conversations"][:2]] for entry in data
             if len(entry.get("conversations", [])) >= 2]
    prompts = []
    for i in rng.permutation(len(pairs)):
        if len(prompts) == n:
            break
        text, answer = pairs[i]
        prompt_len = count_tokens(text)
        wanted = output_len if output_len is not None else count_tokens(answer)
        if output_len is None and not _plausible(prompt_len, wanted):
            continue
        prompts.append(Prompt(text, prompt_len, wanted))
    if len(prompts) < n:
        raise ValueError(f"{path} has {len(prompts)} usable conversations, fewer than the {n} prompts asked for")
    return prompts


def _plausible(prompt_len: int, output_len: int) -> bool:
    return (prompt_len >= MIN_TOKENS and output_len >= MIN_TOKENS and prompt_len <= MAX_PROMPT_TOKENS
            and prompt_len + output_len <= MAX_TOTAL_TOKENS)
