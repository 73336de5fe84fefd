"""Tile shapes of the three kernels (forward, dK/dV, dQ), per layer kind: full causal or sliding window.

Shapes are (rows, keys, warps, stages); rows = block_q tokens x the GQA group's query heads. Chosen by a sweep of
each kernel alone on one H200 (jax 0.11.2) at Inkling's layers: 8192 tokens, 64 query heads; full: 8 KV heads
(group 8), E 1024; sliding: 16 KV heads (group 4), window = E = 512. The current kernel figures:
docs/performance.md. Sliding-layer programs meet only ~9 key tiles each, all carrying bias, so smaller programs
(more of them in flight per SM) win there.
"""

import dataclasses

from pallas_kernels.rel_attention.tiles import Blocks
from pallas_kernels.rel_attention.toeplitz import tokens_per_tile

# (rows, keys, warps, stages) of the forward, dK/dV and dQ kernels.
FULL = ((128, 64, 8, 3), (32, 64, 4, 2), (128, 64, 8, 2))
SLIDING = ((64, 64, 4, 2), (32, 64, 4, 3), (64, 32, 4, 3))


def as_blocks(shape: tuple[int, int, int, int], groups: int) -> Blocks:
    """Blocks of a (rows, keys, warps, stages) shape at a GQA group size (at least 2 tokens per tile)."""
    rows, keys, warps, stages = shape
    return Blocks(block_q=max(rows // groups, 2), block_k=keys, num_warps=warps, num_stages=stages)


def blocks(groups: int, head_dim: int, window: int | None) -> tuple[Blocks, Blocks, Blocks]:
    """Tiles of the forward, dK/dV and dQ kernels of a layer; window None is a full causal layer."""
    del head_dim  # all Inkling layers have head_dim 128
    return tuple(as_blocks(shape, groups) for shape in (FULL if window is None else SLIDING))


# Keys per tile of the Mosaic GPU forward (mgpu_forward.py): 64 is what shared memory allows with double-buffered
# K, V and Tz (128 keys would need ~320 KB of the 227 KB).
MOSAIC_FORWARD_KEYS = 64


def mosaic_forward(groups: int) -> Blocks:
    """The Mosaic GPU forward's tile: two warpgroups of 64 rows (64 / groups tokens each) per CTA."""
    return Blocks(block_q=2 * tokens_per_tile(groups), block_k=MOSAIC_FORWARD_KEYS, mosaic=True)


# The prefill-chunk kernel (chunk.py), both layer kinds: (rows, keys, warps, stages), chosen by a sweep on one
# H200 (jax 0.11.2) over short chunks (32 rows x 128 new tokens) and long caches (8 rows x 256 tokens after 4096
# cached). Its keys are gathered row by row through the page table, which favours smaller programs than the
# forward's.
CHUNK = (64, 64, 4, 2)


def chunk(groups: int, seq_q: int) -> Blocks:
    """The tile of the prefill-chunk kernel, with no more tokens than the chunk's length rounded up to a power
    of two (Triton's tiles are powers of two, with at least 16 rows)."""
    tile = as_blocks(CHUNK, groups)
    tokens = max(1 << max(seq_q - 1, 0).bit_length(), -(-16 // groups))
    return dataclasses.replace(tile, block_q=min(tile.block_q, tokens))
