"""Work split of the fused decode prologue: one program per (token, group of KV heads).

One KV head per program on both layer kinds at every decode batch size: wider groups were no faster. Chosen by a
sweep on one H200 (jax 0.11.2); the current kernel figures: docs/performance.md.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class PrologueBlocks:
    kv_heads: int = 1  # KV heads per program (a power of two dividing Hkv); it also takes their query heads
    num_warps: int = 4


def prologue_blocks(kv_heads: int) -> PrologueBlocks:
    del kv_heads  # the same split for Hkv = 8 and 16
    return PrologueBlocks()
