"""Routing replay's record in the engine: the experts each MoE layer chose at every computed position, kept on the
host at the place in the page pool where that position's keys and values went.

With `EngineConfig.record_experts` the step programs (`serve.runner.steps`) append to each row's packed samples,
for every position of its chunk, the pool slot (page * page_size + offset, as attention writes it; -1 where
nothing is computed) and the position's choice [MoE layers, top_k] (`routing_columns`); the runner's read-out
writes them into `RoutingRecord`, a host array indexed like the pool, before reading the samples. A sequence's
record is read out of its pages when it leaves the engine (`read`), so positions that a prefix-cache hit took
from another sequence carry the choice of the computation that filled those pages (what the sequence's later
tokens attended to), and a preempted sequence's recomputed pages are rewritten. Its format is SGLang's
`routed_experts`: [positions, MoE layers, top_k], for a finished sequence every position but the last (the
sampled tokens depend on no other).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from inkling_jax.config import TextConfig


def pool_slots(page_rows, lengths, n_new, page_size: int, width: int):
    """[R, width] the pool slot of each position of the rows' chunks (position lengths[r] + t, t < n_new[r]), -1
    past n_new: where the full-attention layers write its keys and values."""
    offset = jnp.arange(width)[None, :]
    positions = lengths[:, None] + offset
    page = jnp.take_along_axis(page_rows, jnp.minimum(positions // page_size, page_rows.shape[1] - 1), axis=1)
    return jnp.where(offset < n_new[:, None], page * page_size + positions % page_size, -1)


def routing_columns(experts, slots):
    """experts [R, T, MoE layers, top_k] and slots [R, T] -> int32 [R, T * (1 + layers * top_k)]: per position its
    slot then its choice, the columns appended to the packed samples."""
    rows, width = slots.shape
    return jnp.concatenate([slots[..., None], experts.reshape(rows, width, -1)], axis=-1).reshape(rows, -1)


class RoutingRecord:
    def __init__(self, num_pages: int, page_size: int, text: TextConfig):
        moe_layers = sum(not text.is_dense(i) for i in range(text.num_layers))
        if not moe_layers:
            raise ValueError("record_experts: this model has no MoE layer whose routing could be recorded")
        dtype = np.uint8 if text.num_experts <= 256 else np.int32  # Inkling's 256 experts: a byte per choice
        self.page_size, self.shape = page_size, (moe_layers, text.num_experts_per_tok)
        self.choices = np.zeros((num_pages * page_size, *self.shape), dtype)

    def take(self, packed: np.ndarray, sample_columns: int) -> np.ndarray:
        """Write the routing columns of a step's read-out [..., R, sample_columns + routing columns] into the
        record; returns the samples' own columns."""
        per_position = packed[..., sample_columns:].reshape(-1, 1 + self.shape[0] * self.shape[1])
        written = per_position[:, 0] >= 0
        self.choices[per_position[written, 0]] = per_position[written, 1:].reshape(-1, *self.shape)
        return packed[..., :sample_columns]

    def read(self, block_ids: list[int], num_positions: int) -> np.ndarray:
        """[num_positions, MoE layers, top_k] int32: the choices at positions 0, 1, ... of a sequence holding
        these pages."""
        positions = np.arange(min(num_positions, len(block_ids) * self.page_size))
        slots = np.asarray(block_ids, np.int64)[positions // self.page_size] * self.page_size
        return self.choices[slots + positions % self.page_size].astype(np.int32)
