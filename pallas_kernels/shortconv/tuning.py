"""Tile sizes for the ShortConv kernels (Triton backend: every tile dimension a power of two).

Measured on one NVIDIA H200, jax 0.11.2, 2026-11-29 (bench/shortconv.py sweep, bf16, one run; settings within
~5% of each other are not told apart by it): prefill 1x8192x6144 best at 16x256 rows x channels with 4 warps
(87.9 us), 2048 channels best at 16x128 with 2 warps (35.6 us at 1x8192, 113.4 us at 4x8192); decode N=256 best
at 512 channels / 4 warps for C=6144 (17.6 us) and 256 / 2 warps for C=2048 (7.1 us).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
    time: int = 16  # rows per tile; each tile re-reads a 3-row halo, so larger tiles waste less
    channels: int = 256
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    channels: int = 512  # one token per program; a program streams `channels` columns of x and 3 state rows
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class StripBlocks:
    """Work of one program of the strip prefill (strip.py). Not yet measured on a GPU: a first guess of 8 rows
    of 16-byte loads per thread in flight (8 bf16 channels per thread) and runs of 256 rows (1.2% halo)."""
    channels: int = 512
    rows: int = 256  # time steps per program; a multiple of unroll
    unroll: int = 8  # rows loaded per loop step before any is used
    num_warps: int = 2


def strip_blocks(channels: int) -> StripBlocks:
    # Narrower strips and shorter runs below 4096 channels keep 8192 tokens at 384+ programs (132 SMs).
    return StripBlocks() if channels >= 4096 else StripBlocks(channels=256, rows=128, num_warps=1)


def prefill_blocks(channels: int) -> PrefillBlocks:
    return PrefillBlocks() if channels >= 4096 else PrefillBlocks(time=16, channels=128, num_warps=2)


def decode_blocks(channels: int) -> DecodeBlocks:
    return DecodeBlocks() if channels >= 4096 else DecodeBlocks(channels=256, num_warps=2)
