"""The per-row part of the model's cache, as a pytree the engine can gather, scatter and save.

A cache row is one slot. Every LayerCache field is per row except the K/V page pools of full-attention layers,
which all rows share through the page table. A step touching a few rows gathers theirs into a small cache (the
pools pass through), runs the model, and scatters the rows back. A snapshot is one row's state (sliding-window
rings and ShortConv states) saved at a page boundary, for prefix-cache hits.
"""

import dataclasses

import jax
import jax.numpy as jnp

from inkling_jax.cache import Cache
from inkling_jax.config import TextConfig

_POOLED = ("k", "v")  # fields that are page pools on full-attention layers


def _per_row(cfg: TextConfig, layer: int, name: str) -> bool:
    return cfg.is_local(layer) or name not in _POOLED


def row_state(cfg: TextConfig, cache: Cache) -> tuple[dict, ...]:
    """Per layer, the fields indexed by row (leading dim = rows)."""
    return tuple({f.name: getattr(layer, f.name) for f in dataclasses.fields(layer) if _per_row(cfg, i, f.name)}
                 for i, layer in enumerate(cache.layers))


def with_row_state(cache: Cache, state: tuple[dict, ...]) -> Cache:
    return cache.replace(layers=tuple(layer.replace(**fields) for layer, fields in zip(cache.layers, state)))


def take_rows(cfg: TextConfig, cache: Cache, rows) -> Cache:
    """A cache of just `rows` (lengths and page table included); the page pools are shared, not copied.
    Rows past the end (a step's padding rows) read the last row, the scratch row."""
    take = lambda x: x.at[rows].get(mode="clip")  # noqa: E731
    state = jax.tree.map(take, row_state(cfg, cache))
    return with_row_state(cache, state).replace(lengths=take(cache.lengths), page_table=take(cache.page_table))


def put_rows(cfg: TextConfig, cache: Cache, rows, sub: Cache) -> Cache:
    """`cache` with `rows` replaced by the rows of `sub` and its page pools taken from `sub`. `rows` must be
    distinct; rows past the end (padding) are dropped. The indices are declared unique so that XLA need not
    order colliding writes (on the H200 a 32-row gathered decode step cost ~3 ms more than the in-place all-rows
    step while padding rows all shared one scratch row; whether this removes it is not measured yet)."""
    put = lambda x, y: x.at[rows].set(y, mode="drop", unique_indices=True)  # noqa: E731
    state = jax.tree.map(put, row_state(cfg, cache), row_state(cfg, sub))
    return with_row_state(sub, state).replace(lengths=put(cache.lengths, sub.lengths),
                                              page_table=put(cache.page_table, sub.page_table))


def empty_snapshots(cfg: TextConfig, cache: Cache, count: int) -> tuple[dict, ...]:
    return jax.tree.map(lambda x: jnp.zeros((count,) + x.shape[1:], x.dtype), row_state(cfg, cache))


def save_snapshot(cfg: TextConfig, cache: Cache, snapshots, row, snapshot):
    return jax.tree.map(lambda s, x: s.at[snapshot].set(x[row]), snapshots, row_state(cfg, cache))


def restore_snapshot(cfg: TextConfig, cache: Cache, snapshots, row, snapshot) -> Cache:
    state = jax.tree.map(lambda x, s: x.at[row].set(s[snapshot]), row_state(cfg, cache), snapshots)
    return with_row_state(cache, state)


def bytes_per_row(cfg: TextConfig, cache: Cache) -> int:
    return sum(x.size // x.shape[0] * x.dtype.itemsize for x in jax.tree.leaves(row_state(cfg, cache)))
