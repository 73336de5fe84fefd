"""The numerical reference for the engine's logprobs: the model's own forward over the whole sequence."""

import jax
import jax.numpy as jnp
import numpy as np


def model_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax(model(ids)) [len(ids), V] in float32, with the backend the model holds."""
    logits = model(jnp.asarray([ids]))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
