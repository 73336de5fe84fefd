"""Block sizes and launch parameters for decode attention.

Measured on one H200 (jax 0.11.2, Pallas Triton backend) by bench/decode_attention.py at Hq 64, D 128, bf16,
context 8192 (paged, page 128, Hkv 8) and window 512 (ring, Hkv 16); table in bench/results/decode_attention.md.
"""

# Keys per loop step of the paged kernel (pages per step = this // page_size, at least one page): 128 keys keep
# one K and one V tile at 32 KiB each, double-buffered; 256 keys with 8 warps was 12% slower at batch 64.
PAGED_BLOCK_TOKENS = 128
# Split-K: splits are added until batch * kv_heads * splits reaches this many programs. 256 gave the fastest
# split count at batch 64 (1 split, 4.05 TB/s), 8 (4 splits, 3.20 TB/s) and 1 (32 splits); more splits cost
# more than the extra parallelism gains.
PAGED_TARGET_PROGRAMS = 256
# Ring slots per loop step of the sliding-window kernel (the largest power of two up to this dividing W).
RING_BLOCK_SLOTS = 128
# Ring split-K target: 1 split at batch 64, 4 at batch 1 and 8 (the window has only 4 blocks of 128).
RING_TARGET_PROGRAMS = 512
# At batch 64: 8 warps was 4% slower (paged) and 18% slower (ring); 3 stages was equal (paged) and 12% slower
# (ring; 5% faster with 64-slot ring blocks, which were 21% slower at batch 8).
NUM_WARPS = 4
NUM_STAGES = 2
