"""The per-row part of the model's cache, as a pytree the engine can gather, scatter and save.

A cache row is one slot. Every LayerCache field is per row except the K/V page pools of full-attention layers,
which all rows share through the page table. A step touching a few rows gathers their ShortConv states into a
small cache, runs the model, and scatters them back; the page pools and the sliding layers' K/V rings stay where
they are (the model addresses rings by `Cache.ring_rows`): copying the rings in and out would cost a decode step
far more than the rest of the gather. A snapshot is one row's whole state (rings and ShortConv states) saved at a
page boundary, for prefix-cache hits.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.config import TextConfig
from inkling_jax.nn.cache import Cache

_KV = ("k", "v")  # page pools on full-attention layers, rings on sliding ones


def row_state(cfg: TextConfig, cache: Cache) -> tuple[dict, ...]:
    """Per layer, the fields indexed by row (leading dim = rows)."""
    return _fields(cache, lambda i, name: cfg.is_local(i) or name not in _KV)


def conv_state(cache: Cache) -> tuple[dict, ...]:
    """Per layer, the ShortConv states: the per-row fields a step gathers."""
    return _fields(cache, lambda i, name: name not in _KV)


def _fields(cache: Cache, keep) -> tuple[dict, ...]:
    return tuple({f.name: getattr(layer, f.name) for f in dataclasses.fields(layer) if keep(i, f.name)}
                 for i, layer in enumerate(cache.layers))


def with_row_state(cache: Cache, state: tuple[dict, ...]) -> Cache:
    return cache.replace(layers=tuple(layer.replace(**fields) for layer, fields in zip(cache.layers, state)))


def take_rows(cache: Cache, rows) -> Cache:
    """A cache of just `rows`: their ShortConv states, lengths and page table, and `ring_rows` naming their
    rings; the page pools and rings are shared, not copied. Rows past the end (a step's padding rows) read the
    last row, the scratch row."""
    take = lambda x: x.at[rows].get(mode="clip")  # noqa: E731
    state = jax.tree.map(take, conv_state(cache))
    return with_row_state(cache, state).replace(lengths=take(cache.lengths), page_table=take(cache.page_table),
                                                ring_rows=jnp.minimum(rows, cache.batch - 1))


def put_rows(cache: Cache, rows, sub: Cache) -> Cache:
    """`cache` with `rows` replaced by the rows of `sub` and its page pools and rings taken from `sub`. `rows`
    must be distinct; rows past the end (padding) are dropped. Declared unique, XLA need not order colliding
    writes (which made a step whose padding rows all wrote one scratch row much slower)."""
    put = lambda x, y: x.at[rows].set(y, mode="drop", unique_indices=True)  # noqa: E731
    state = jax.tree.map(put, conv_state(cache), conv_state(sub))
    return with_row_state(sub, state).replace(lengths=put(cache.lengths, sub.lengths),
                                              page_table=put(cache.page_table, sub.page_table), ring_rows=None)


def clear_conv_state(cache: Cache, starting) -> Cache:
    """`cache` with the ShortConv states of the rows where `starting` [B] holds set to zero: a sequence that enters
    a slot starts from zero inputs (as the model's own forward does), not from the slot's previous occupant's."""
    clear = lambda x: jnp.where(starting[:, None, None], jnp.zeros((), x.dtype), x)  # noqa: E731
    return with_row_state(cache, jax.tree.map(clear, conv_state(cache)))


def empty_snapshots(cfg: TextConfig, cache: Cache, count: int) -> tuple[dict, ...]:
    return jax.tree.map(lambda x: jnp.zeros((count,) + x.shape[1:], x.dtype), row_state(cfg, cache))


def save_snapshots(cfg: TextConfig, cache: Cache, snapshots, pairs):
    """`snapshots` with the state of row pairs[0, i] saved as snapshot pairs[1, i], for i in order (a later pair
    naming the same snapshot wins; one naming a snapshot past the pool saves nothing): one program for several
    chunks of a step. Row by row, so that no copy of all their states is made at once."""
    state = row_state(cfg, cache)
    for i in range(pairs.shape[1]):
        snapshots = jax.tree.map(lambda s, x: s.at[pairs[1, i]].set(x[pairs[0, i]], mode="drop"), snapshots, state)
    return snapshots


def snapshot_batches(saves: list[tuple[int, int]], size: int, pool: int) -> list[np.ndarray]:
    """A step's (row, snapshot id) saves, in order, as [2, size] int32 `pairs` of `save_snapshots`; the last batch
    padded with pairs that save nothing (snapshot id `pool`, past the pool's)."""
    batches = [saves[i:i + size] for i in range(0, len(saves), size)]
    return [np.asarray(batch + [(0, pool)] * (size - len(batch)), np.int32).T for batch in batches]


def restore_snapshot(cfg: TextConfig, cache: Cache, snapshots, row, snapshot) -> Cache:
    state = jax.tree.map(lambda x, s: x.at[row].set(s[snapshot]), row_state(cfg, cache), snapshots)
    return with_row_state(cache, state)


def bytes_per_row(cfg: TextConfig, cache: Cache) -> int:
    return sum(x.size // x.shape[0] * x.dtype.itemsize for x in jax.tree.leaves(row_state(cfg, cache)))
