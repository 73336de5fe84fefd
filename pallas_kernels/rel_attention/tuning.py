"""Tile shapes of the three kernels (forward, dK/dV, dQ), per layer kind: full causal or sliding window.

Shapes are (rows, keys, warps, stages); rows = block_q tokens x the GQA group's query heads. Measured on one H200
(jax 0.11.2, Pallas Triton backend, 2026-11-29) at Inkling's layers: 8192 tokens, 64 query heads; full: 8 KV
heads (group 8), E 1024; sliding: 16 KV heads (group 4), window = E = 512. Times of that kernel alone.
  Tile sweep, 18:22 UTC (`PYTHONPATH=. python bench/rel_attention_tiles.py`; each kernel alone, ms):
    full    forward 128/64/8/3 3.50. dK/dV 32/64/4/2 7.48; 64/64/4/2 7.97; 128/64/8/2 9.55.
            dQ (with the dP reduction) 128/64/8/2 5.59; 64/64/4/2 7.79.
    sliding forward 64/64/4/2 0.845; 64/32/4/2 0.892; 128/64/8/3 1.32; 32/64/4/2 1.60.
            dK/dV 32/64/4/2 1.38; 64/32/4/2 1.75; 64/64/4/2 1.76; 32/32/4/2 2.19; 16/64/4/2 2.24; 128/64/8/2 3.63.
            dQ 64/32/4/2 1.79; 64/64/4/2 2.49; 32/64/4/2 2.51; 128/64/4/2 3.88; 128/64/8/2 3.94.
    Sliding-layer programs meet only ~9 key tiles each, all carrying bias, so smaller programs (more of them in
    flight per SM) win there.
  Pipeline stages of the sliding backward's tiles, 2026-11-30 ~15:40 UTC (a throwaway sweep through
  bench/rel_attention_tiles.sweep, two runs, ms): dK/dV 32/64/4 with 2 / 3 / 4 / 5 stages 1.366 / 1.272 / 1.317 /
  1.706; dQ 64/32/4 1.786-1.799 / 1.732-1.758 / 1.746 / 2.616. Also slower: dK/dV 32/64/8/2 3.03, 32/128/4/2 3.52,
  16/32/4/2 3.57, 32/32/2/2 1.96; dQ 32/32/2/2 2.25, 64/16/4/2 2.41, 128/32/8/2 2.43, 64/32/8/2 3.75.
  Earlier (same day, bench/rel_attention.py): full forward 128/64/8/2 4.44; 128/128/8/2 6.98; 128/64/4/2 11.1;
    128/128/8/3 needs 260 KB of shared memory (227 KB available); dQ 128/32/4/3 10.7.
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
# K, V and Tz (128 keys would need ~320 KB of the 227 KB). Measured on one H200 (bench/rel_attention_tiles.py
# --forward-only, bench/kernels.py): full layer 2.52 ms against the Triton forward's 3.41 ms (2026-11-29); sliding
# layer, with its warpgroups sharing one Tz stream (mgpu_window.py), 0.76-0.80 against 0.86 ms (2026-11-30).
MOSAIC_FORWARD_KEYS = 64


def mosaic_forward(groups: int) -> Blocks:
    """The Mosaic GPU forward's tile: two warpgroups of 64 rows (64 / groups tokens each) per CTA."""
    return Blocks(block_q=2 * tokens_per_tile(groups), block_k=MOSAIC_FORWARD_KEYS, mosaic=True)


# The prefill-chunk kernel (chunk.py), both layer kinds: (rows, keys, warps, stages). Measured on one H200
# (2026-11-30 04:57, `bench/chunk_attention.py --sweep`; ms full / sliding layer): 32 rows x 128 new tokens
# 0.180 / 0.168 (the full forward's 128/64/8/3: 0.214 / 0.221; best 128/32/4/3 0.163 and 64/32/4/3 0.152);
# 8 rows x 256 tokens after 4096 cached 1.252 / 0.328 (128/64/8/3: 1.646 / 0.428; 128/128/8/2 1.355 / 0.753).
# Its keys are gathered row by row through the page table, which favours smaller programs than the forward's.
CHUNK = (64, 64, 4, 2)


def chunk(groups: int, seq_q: int) -> Blocks:
    """The tile of the prefill-chunk kernel, with no more tokens than the chunk's length rounded up to a power
    of two (Triton's tiles are powers of two, with at least 16 rows)."""
    tile = as_blocks(CHUNK, groups)
    tokens = max(1 << max(seq_q - 1, 0).bit_length(), -(-16 // groups))
    return dataclasses.replace(tile, block_q=min(tile.block_q, tokens))
