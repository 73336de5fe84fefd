"""The numerical reference for the engine's logprobs: the model's own forward over the whole sequence."""

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.generate import StepFunctions

PAD_TO = 32  # sequences padded to a multiple of this share one compiled forward (the model is causal)
_steps = weakref.WeakKeyDictionary()  # model -> its StepFunctions, compiled once per padded length


def model_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax(model(ids)) [len(ids), V] in float32, with the backend the model holds; one jitted forward
    (op by op, each call compiled a thousand small programs)."""
    if model not in _steps:
        _steps[model] = StepFunctions(model)
    width = -(-len(ids) // PAD_TO) * PAD_TO
    logits = _steps[model].forward([list(ids) + [0] * (width - len(ids))])[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[:len(ids)]
