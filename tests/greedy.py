"""The reference that served greedy tokens are compared with: the model's own full-sequence forward."""

import jax.numpy as jnp

from inkling_jax.generate import StepFunctions


def greedy_tokens(model, prompt: list[int], count: int) -> list[int]:
    """The `count` tokens that the argmax of the model's full-sequence logits picks one after another after
    `prompt`. Every forward takes the sequence padded to its final length, so one compiled program serves all
    steps (the model is causal: what follows position t leaves t's logits alone); op by op, on CPU, the same
    loop took ~80 s of CI time for six tokens of a two-layer model. Not `inkling_jax.generate.greedy_generate`:
    that runs the cache path, which the served tokens are checked against, not with."""
    steps = StepFunctions(model)
    ids = list(prompt)
    for _ in range(count):
        n = len(ids)
        logits = steps.forward([ids + [0] * (len(prompt) + count - n)])
        ids.append(int(jnp.argmax(logits[0, n - 1])))
    return ids[len(prompt):]
