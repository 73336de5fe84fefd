"""Tile sizes of the LoRA kernels (Triton backend: every tile dimension a power of two, a matmul's at least 16).

UNTUNED: chosen from register budgets, not measured; a sweep on the H200 (`python -m benchmarks.kernels`, the
LoRA rows) has yet to set them. A program's A or B tile is [k or out, padded rank] in fp32, so the wider the
adapters (a fused q|k|v|r projection holds 4 x the rank), the fewer columns per step.
"""

import dataclasses

# A step whose rows hold fewer tokens each than this (decode, speculative verification) runs the gathered form,
# one program per token; longer runs of tokens sharing a slot (prefill chunks) run the segmented form.
SEGMENTED_MIN_TOKENS = 16


def _power_of_two(name: str, value: int, least: int) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"LoRA tile {name} must be a power of two >= {least}, got {value}")


@dataclasses.dataclass(frozen=True)
class GatheredBlocks:
    """Programs of one token each: the shrink reads its slot's A in `k_tiles` steps of `k` input columns per
    program, the expand B in tiles of `out` columns."""
    k: int = 64
    out: int = 128
    num_warps: int = 4
    k_tiles: int = 4

    def __post_init__(self):
        _power_of_two("k", self.k, 1)
        _power_of_two("out", self.out, 1)
        if self.k_tiles < 1:
            raise ValueError(f"LoRA tile k_tiles must be >= 1, got {self.k_tiles}")


@dataclasses.dataclass(frozen=True)
class SegmentedBlocks:
    """A tile of `rows` tokens per program, one matmul per run of a slot in it; A in steps of `k` input
    columns, B in tiles of `out` columns."""
    rows: int = 64
    k: int = 64
    out: int = 64
    num_warps: int = 4

    def __post_init__(self):
        for name in ("rows", "k", "out"):
            _power_of_two(name, getattr(self, name), 16)


# padded rank up to -> (gathered, segmented) tiles
TABLE = ((32, GatheredBlocks(k=128, out=128), SegmentedBlocks(rows=64, k=64, out=128)),
         (64, GatheredBlocks(k=64, out=128), SegmentedBlocks(rows=64, k=64, out=64)),
         (128, GatheredBlocks(k=32, out=64), SegmentedBlocks(rows=64, k=32, out=64)),
         (None, GatheredBlocks(k=16, out=32), SegmentedBlocks(rows=32, k=16, out=32)))


def blocks_for(padded_rank: int) -> tuple[GatheredBlocks, SegmentedBlocks]:
    """The tiles of adapters of `padded_rank` (`tiles.padded_rank`)."""
    _, gathered, segmented = next(row for row in TABLE if row[0] is None or padded_rank <= row[0])
    return gathered, segmented
