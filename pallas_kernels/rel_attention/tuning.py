"""Tile shapes of the three kernels (forward, dK/dV, dQ), per layer kind: full causal or sliding window.

Shapes are (rows, keys, warps, stages); rows = block_q tokens x the GQA group's query heads. Measured on one H200
(jax 0.11.2, Pallas Triton backend, 2026-11-29) at Inkling's layers: 8192 tokens, 64 query heads; full: 8 KV
heads (group 8), E 1024; sliding: 16 KV heads (group 4), window = E = 512. Times of that kernel alone.
  Full layer (bench/rel_attention.py):
    forward: 128/64/8/3 3.40-4.10 ms; 128/64/8/2 4.44; 128/128/8/2 6.98; 128/64/4/2 11.1; 128/128/8/3 needs
      260 KB of shared memory (227 KB available).
    dK/dV, keys-major tiles: 64/64/4/2 10.1 ms; 64/64/8/2 10.5. Before the keys-major rewrite: 64/64/4/2 11.0;
      64/128/8/2 22.3; 32/128/4/3 52.7.
    dQ: 128/64/8/2 5.69-5.71 ms; 64/64/4/2 7.55; 128/32/4/3 10.7.
  Sliding layer (bench/rel_attention_forward.py, the forward alone): 64/64/4/2 0.902 ms against 128/64/8/3
    1.344 (FlexAttention 1.553, cuDNN without bias 0.409): each program meets only ~9 key tiles, all carrying
    bias, so smaller programs (more of them in flight per SM) win. Its backward shapes are the full layer's,
    not yet swept there (bench/rel_attention_tiles.py sweeps them).
"""

from pallas_kernels.rel_attention.tiles import Blocks

# (rows, keys, warps, stages) of the forward, dK/dV and dQ kernels.
FULL = ((128, 64, 8, 3), (64, 64, 4, 2), (128, 64, 8, 2))
SLIDING = ((64, 64, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2))


def as_blocks(shape: tuple[int, int, int, int], groups: int) -> Blocks:
    """Blocks of a (rows, keys, warps, stages) shape at a GQA group size (at least 2 tokens per tile)."""
    rows, keys, warps, stages = shape
    return Blocks(block_q=max(rows // groups, 2), block_k=keys, num_warps=warps, num_stages=stages)


def blocks(groups: int, head_dim: int, window: int | None) -> tuple[Blocks, Blocks, Blocks]:
    """Tiles of the forward, dK/dV and dQ kernels of a layer; window None is a full causal layer."""
    del head_dim  # all Inkling layers have head_dim 128
    return tuple(as_blocks(shape, groups) for shape in (FULL if window is None else SLIDING))
