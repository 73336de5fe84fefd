"""Tile sizes of the three kernels (forward, dK/dV, dQ), by GQA group size.

A tile has rows = block_q tokens x the group's query heads. Measured on one H200 (jax 0.11.2, Pallas Triton
backend, 2026-11-29, bench/rel_attention.py; full layer: 8192 tokens, 64 query heads, 8 KV heads, E 1024),
as rows/keys/warps/stages: time of that kernel alone.
  forward: 128/64/8/3 4.09-4.10 ms; 128/64/8/2 4.44; 128/128/8/2 6.98; 128/64/4/2 11.1; 128/128/8/3 needs
    260 KB of shared memory (227 KB available).
  dK/dV, keys-major tiles: 64/64/4/2 10.1 ms; 64/64/8/2 10.5. Before the keys-major rewrite: 64/64/4/2 11.0;
    64/128/8/2 22.3; 32/128/4/3 52.7.
  dQ: 128/64/8/2 5.69-5.71 ms; 64/64/4/2 7.55; 128/32/4/3 10.7.
The sliding layer (group 4) uses the same tile shapes; they were not swept there.
"""

from pallas_kernels.rel_attention.tiles import Blocks

FORWARD_ROWS, DKDV_ROWS, DQ_ROWS = 128, 64, 128


def blocks(groups: int, head_dim: int) -> tuple[Blocks, Blocks, Blocks]:
    del head_dim  # all Inkling layers have head_dim 128
    tokens = lambda rows: max(rows // groups, 2)
    return (Blocks(block_q=tokens(FORWARD_ROWS), block_k=64, num_warps=8, num_stages=3),
            Blocks(block_q=tokens(DKDV_ROWS), block_k=64, num_warps=4, num_stages=2),
            Blocks(block_q=tokens(DQ_ROWS), block_k=64, num_warps=8, num_stages=2))
