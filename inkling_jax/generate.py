"""Jitted prefill / decode steps over the explicit cache, and a small greedy generator built on them.

The steps are pure functions of (parameters, inputs, cache), with fixed shapes per (batch, chunk, max_len), so
they compile once; this is the contract the server builds on.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.nn.cache import Cache
from inkling_jax.nn.model import InklingModel


def flat_params(model: InklingModel):
    """(leaves, merge): the model's parameters as a flat list of arrays, and the function that rebuilds the model
    from such a list inside a jitted program. A flat list is what jitted steps should take: flattening an
    nnx.State at every call costs host time of the order of a small decode step."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return leaves, lambda values: nnx.merge(graphdef, jax.tree.unflatten(treedef, values))


class StepFunctions:
    """Jitted entry points of one model: `extend(ids [B, T], cache, n_new [B]) -> (logits, cache)` (the cache
    donated) and `forward(ids [B, T]) -> logits`."""

    def __init__(self, model: InklingModel):
        self.leaves, merged = flat_params(model)
        self._extend = jax.jit(lambda leaves, ids, cache, n_new: merged(leaves).extend(ids, cache, n_new),
                               donate_argnums=(2,))
        self._forward = jax.jit(lambda leaves, ids: merged(leaves)(ids))

    def forward(self, ids):
        """Logits of whole text sequences [B, T] (no cache), jitted."""
        return self._forward(self.leaves, jnp.asarray(ids, jnp.int32))

    def extend(self, ids, cache: Cache, n_new=None):
        ids = jnp.asarray(ids, jnp.int32)
        if n_new is None:
            n_new = np.full((ids.shape[0],), ids.shape[1], np.int32)
        return self._extend(self.leaves, ids, cache, jnp.asarray(n_new, jnp.int32))


def greedy_generate(model: InklingModel, prompt_ids, max_new_tokens: int, *, max_len: int | None = None,
                    steps: StepFunctions | None = None) -> np.ndarray:
    """Greedy continuation of equal-length prompts [B, T]: returns the new tokens [B, max_new_tokens]."""
    prompt_ids = np.asarray(prompt_ids, np.int32)
    batch, length = prompt_ids.shape
    steps = steps or StepFunctions(model)
    cache = model.init_cache(batch, max_len or length + max_new_tokens)
    logits, cache = steps.extend(prompt_ids, cache)
    token = jnp.argmax(logits[:, -1], axis=-1)
    out = [token]
    for _ in range(max_new_tokens - 1):
        logits, cache = steps.extend(token[:, None], cache)
        token = jnp.argmax(logits[:, -1], axis=-1)
        out.append(token)
    return np.asarray(jnp.stack(out, axis=1))
