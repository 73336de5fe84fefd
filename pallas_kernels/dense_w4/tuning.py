"""Slab sizes of the dense W4A16 product. The tile shapes are the routed experts' (`kernel_w4.config_for`, tuned
there); the product adds only how it cuts its rows into slabs and how it splits K."""

DECODE_TOKENS = 64  # up to this many rows run as one slab padded to kernel_w4.N_ALIGN (decode steps)
# More rows run in slabs of pallas_kernels.moe.nvfp4.PREFILL_SLAB. A slab with fewer output tiles than the GPU
# has SMs splits K (`kernel_w4.k_splits_to_fill`), so that every SM works.
