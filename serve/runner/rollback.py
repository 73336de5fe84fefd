"""Undoing what speculative decoding wrote past the tokens a row keeps.

Full-attention K/V pages are addressed by absolute position and nothing reads past a row's length, so there a
rejection is just not advancing the length; so it is in the model's sliding rings, which hold K slots past the
window (`SpeculativeConfig.ring_slots`). The drafter's rings have the window's length (its chain's decode steps
read them with the ring kernel): a draft chain of T tokens from length L overwrites the slots of positions
L - window .. L + T - 1 - window, which the row still attends to. `ring_slots` reads those slots before the
chain and `restore_ring_slots` puts them back (T <= window, so no two positions of one chain share a slot). The
ShortConv states come back from a verify with every input (`keep_conv_inputs`), and `keep_conv_prefix` keeps
the state after the kept tokens.
"""

import jax
import jax.numpy as jnp

from inkling_jax.nn.attention import scatter_rows
from inkling_jax.nn.cache import Cache
from serve.runner.cache_rows import conv_state, with_row_state


def _ring_index(cache: Cache, window: int, positions):
    """[B, S] flat row of each position's slot in a ring pool [rows * window, ...]."""
    rows = jnp.arange(cache.batch) if cache.ring_rows is None else cache.ring_rows
    return rows[:, None] * window + positions % window


def ring_slots(cache: Cache, local: tuple[bool, ...], positions) -> tuple:
    """Per layer, the (k, v) [B, S, Hkv, D] that the ring slots of `positions [B, S]` hold now (None for a
    full-attention layer)."""
    saved = []
    for layer, is_local in zip(cache.layers, local):
        if not is_local:
            saved.append(None)
            continue
        index = _ring_index(cache, layer.k.shape[1], positions)
        saved.append(tuple(x.reshape(-1, *x.shape[2:])[index] for x in (layer.k, layer.v)))
    return tuple(saved)


def restore_ring_slots(cache: Cache, positions, saved: tuple) -> Cache:
    """`cache` with the ring slots of `positions [B, S]` set back to `saved` (`ring_slots`)."""
    layers = []
    for layer, kv in zip(cache.layers, saved):
        if kv is not None:
            index = _ring_index(cache, layer.k.shape[1], positions)
            layer = layer.replace(k=scatter_rows(layer.k, index, kv[0]), v=scatter_rows(layer.v, index, kv[1]))
        layers.append(layer)
    return cache.replace(layers=tuple(layers))


def keep_conv_prefix(cache: Cache, kept, history: int) -> Cache:
    """`cache` whose ShortConv states are a verify's windows [B, history + T, C] (`keep_conv_inputs`), with each
    row's state after its first `kept [B]` tokens: rows kept .. kept + history - 1 of its window."""
    index = (kept[:, None] + jnp.arange(history)[None, :])[..., None]
    take = lambda x: jnp.take_along_axis(x, index, axis=1)  # noqa: E731
    return with_row_state(cache, jax.tree.map(take, conv_state(cache)))
