"""The reference that served greedy tokens are compared with: the model's own full-sequence forward."""

import numpy as np

from inkling_jax.generate import StepFunctions


def greedy_continuations(model, prompts: list[list[int]], count: int) -> list[list[int]]:
    """For each prompt, the `count` tokens that the argmax of the model's full-sequence logits picks one after
    another after it. Every forward takes the prompts together, each padded to the longest final length, so one
    compiled program serves all steps (the model is causal: what follows position t leaves t's logits alone); op
    by op, on CPU, the same loop took ~80 s of CI time for six tokens of a two-layer model. Not
    `inkling_jax.generate.greedy_generate`: that runs the cache path, which the served tokens are checked
    against, not with."""
    steps = StepFunctions(model)
    width = max(map(len, prompts)) + count
    ids = [list(p) for p in prompts]
    for _ in range(count):
        logits = np.asarray(steps.forward([s + [0] * (width - len(s)) for s in ids]))
        for row, s in enumerate(ids):
            s.append(int(logits[row, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(ids, prompts)]


def greedy_tokens(model, prompt: list[int], count: int) -> list[int]:
    """`greedy_continuations` of one prompt."""
    return greedy_continuations(model, [prompt], count)[0]
