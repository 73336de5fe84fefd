"""Block sizes and launch parameters for decode attention.

Chosen by a sweep on one H200 (jax 0.11.2) at Hq 64, D 128, bf16, batch 1, 8 and 64: context 8192 (paged, page
128, Hkv 8) and window 512 (ring, Hkv 16); the current kernel figures: docs/performance.md.
"""

# Keys per loop step of the paged kernel (pages per step = this // page_size, at least one page): 128 keys keep
# one K and one V tile at 32 KiB each, double-buffered.
PAGED_BLOCK_TOKENS = 128
# Split-K: splits are added until batch * kv_heads * splits reaches this many programs (1 split at batch 64, 4 at
# batch 8, 32 at batch 1); more splits cost more than the extra parallelism gains.
PAGED_TARGET_PROGRAMS = 256
# Ring slots per loop step of the sliding-window kernel (the largest power of two up to this dividing W).
RING_BLOCK_SLOTS = 128
# Ring split-K target: 1 split at batch 64, 4 at batch 1 and 8 (the window has only 4 blocks of 128).
RING_TARGET_PROGRAMS = 512
NUM_WARPS = 4
NUM_STAGES = 2
