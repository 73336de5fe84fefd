"""Work split of the fused decode prologue: one program per (token, group of KV heads).

Measured on one NVIDIA H200, jax 0.11.2, 2026-11-29 (bench/shortconv.py, bf16, Hq 64, D 128, N = 1..256):
one KV head per program was fastest or within noise of it at every N on both layer kinds (sum over N of
16.8 us vs 17.2 us for two heads on global layers, 19.0 vs 20.6 on local ones); four was always slower.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrologueBlocks:
    kv_heads: int = 1  # KV heads per program (a power of two dividing Hkv); it also takes their query heads
    num_warps: int = 4


def prologue_blocks(kv_heads: int) -> PrologueBlocks:
    del kv_heads  # the same split for Hkv = 8 and 16
    return PrologueBlocks()
