"""Tile sizes for the ShortConv kernels (Triton backend: every tile dimension a power of two).

Chosen by a sweep on one H200 (jax 0.11.2, bf16) at Inkling's widths, C = 6144 and 2048; the current kernel
figures: docs/performance.md.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    channels: int = 512  # one token per program; a program streams `channels` columns of x and 3 state rows
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class StripBlocks:
    """Work of one program of the strip prefill (strip.py). Short runs make many programs (3072 at 6144 channels,
    1024 at 2048), hence many bytes in flight per SM; they also bound the work of a decode-time call (T = 1: one
    run of 64 rows, all but one masked)."""
    channels: int = 256  # 8 bf16 channels per thread with 1 warp (16 B loads), 4 with 2 warps (8 B loads)
    rows: int = 64  # time steps per program; a multiple of unroll
    unroll: int = 16  # rows loaded per loop step before any is used
    num_warps: int = 2


def strip_blocks(channels: int) -> StripBlocks:
    # Below 4096 channels one warp per program was the sweep's best.
    return StripBlocks() if channels >= 4096 else StripBlocks(num_warps=1)


def decode_blocks(channels: int) -> DecodeBlocks:
    return DecodeBlocks() if channels >= 4096 else DecodeBlocks(channels=256, num_warps=2)
