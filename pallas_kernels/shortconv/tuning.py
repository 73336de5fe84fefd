"""Tile sizes for the ShortConv kernels (Triton backend: every tile dimension a power of two).

Measured on one NVIDIA H200, jax 0.11.2, 2026-11-29 (bench/shortconv.py sweep, bf16, one run; settings within
~5% of each other are not told apart by it): decode N=256 best at 512 channels / 4 warps for C=6144 (17.6 us)
and 256 / 2 warps for C=2048 (7.1 us); the prefill's settings are StripBlocks' own.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    channels: int = 512  # one token per program; a program streams `channels` columns of x and 3 state rows
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class StripBlocks:
    """Work of one program of the strip prefill (strip.py), measured on one NVIDIA H200, jax 0.11.2, Pallas
    Triton backend, 2026-11-29 ~18:07 UTC, bf16, one run of
    `python bench/shortconv.py --prefill-sweep` (16 settings per width; bench/results/shortconv.md):
      1x8192x6144: 256 channels, 64 rows, unroll 16, 2 warps: 63.0 us = 1.03 of y = 2x (64.9 us);
                   with a state (the model's call) 65.5 us = 0.99. The earlier default (512, 256, 8, 2): 0.84.
      1x8192x2048: the same with 1 warp: 23.5 us = 1.15 of y = 2x (26.9 us); with a state 29.5 us = 0.91.
                   2 warps ran 24.9 us (1.08), inside this shape's run-to-run spread. Earlier default: 0.74.
    Short runs make many programs (3072 at 6144 channels, 1024 at 2048), hence many bytes in flight per SM; they
    also bound the work of a decode-time call (T = 1: one run of 64 rows, all but one masked)."""
    channels: int = 256  # 8 bf16 channels per thread with 1 warp (16 B loads), 4 with 2 warps (8 B loads)
    rows: int = 64  # time steps per program; a multiple of unroll
    unroll: int = 16  # rows loaded per loop step before any is used
    num_warps: int = 2


def strip_blocks(channels: int) -> StripBlocks:
    # Below 4096 channels one warp per program measured best (see StripBlocks).
    return StripBlocks() if channels >= 4096 else StripBlocks(num_warps=1)


def decode_blocks(channels: int) -> DecodeBlocks:
    return DecodeBlocks() if channels >= 4096 else DecodeBlocks(channels=256, num_warps=2)
