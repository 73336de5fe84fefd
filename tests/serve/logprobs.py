"""The numerical reference for the engine's logprobs: the model's own forward over the whole sequence."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels._common import round_up

PAD_TO = 32  # sequences padded to a multiple of this share one compiled forward (the model is causal)
FORWARD = nnx.jit(lambda model, ids: model(ids))  # one program a padded length (op by op: ~1000 small ones a call)


def padded(ids: list[int]) -> jax.Array:
    """ids [1, T'] padded with token 0 to T' = a multiple of PAD_TO: position t's outputs are those of ids alone."""
    return jnp.asarray([list(ids) + [0] * (round_up(len(ids), PAD_TO) - len(ids))])


def model_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax(model(ids)) [len(ids), V] in float32, with the backend the model holds."""
    logits = FORWARD(model, padded(ids))[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[:len(ids)]
