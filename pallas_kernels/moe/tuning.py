"""Tile sizes for the MoE grouped-matmul kernels.

`DEFAULTS` and `LARGE` (prefill and training; `LARGE` for steps of at least `LARGE_ROWS_PER_GROUP` rows per
group): the bf16 tiles come from `python -m benchmarks.moe_tiles` on one H100 (jax 0.11.2: `LARGE` at Inkling's
training step, 16k tokens x 8 experts each, hidden 6144, width 3072, 2026-12-06; `DEFAULTS` the 2026-12-05
sweep's), the threshold from `python -m benchmarks.moe_layouts`; the other dtypes' are starting points sized for
Hopper (227 KiB SMEM per block, 132 SMs). `DECODE` was chosen by a sweep on one H200 (jax 0.11.2) at a 32-token
decode step. The current kernel figures: docs/performance.md. Every kernel has two compute warpgroups (one for
decode) that each own `wg_rows` rows of the output tile (64 or 128: one or two 64-row wgmmas per operand tile),
plus one warpgroup issuing TMA. `stages` is an upper bound that `fit_stages` lowers to what SMEM holds (3 for the
128-row tiles)."""

import dataclasses

import jax.numpy as jnp

from pallas_kernels import mgpu


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Row-blocked grouped matmul: out tile = (compute_wgs * wg_rows) x block_n per accumulator."""

    wg_rows: int = 64
    compute_wgs: int = 2
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    epi_n: int = 64  # columns per TMA store of the epilogue
    grid_tile_width: int = 8  # n-blocks visited together before moving to the next row blocks

    @property
    def block_rows(self) -> int:
        return self.wg_rows * self.compute_wgs


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Per-group x^T @ dy: out tile = (compute_wgs * wg_rows) x block_n, contracting block_rows rows a step."""

    wg_rows: int = 64
    compute_wgs: int = 2
    block_n: int = 256
    block_rows: int = 64
    stages: int = 4
    epi_n: int = 64
    grid_tile_width: int = 4

    @property
    def block_rows_out(self) -> int:
        return self.wg_rows * self.compute_wgs


_BF16, _F32, _FP8 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn)
# Defaults per role and dtype. fp32 runs as tf32, which wgmma takes only with 32-element K-minor tiles; fp8
# (pallas_kernels/moe/fp8.py, forward only) with K-minor tiles of 128 elements, one 128-byte swizzle span.
DEFAULTS = {
    # out = x @ w[g] (down projection) and dgrad (dy @ w[g]^T).
    "gmm": {_BF16: GmmConfig(block_n=128), _F32: GmmConfig(block_n=128, block_k=32),
            _FP8: GmmConfig(block_k=128)},
    # Fused gate/up: two accumulators of block_n columns each.
    "swiglu": {_BF16: GmmConfig(block_n=128, stages=2), _F32: GmmConfig(block_n=64, block_k=32),
               _FP8: GmmConfig(block_n=128, block_k=128)},
    # dx = dgate @ w_gate^T + dup @ w_up^T: two operand pairs per step.
    "gmm_pairs": {_BF16: GmmConfig(block_n=128, stages=2, grid_tile_width=4), _F32: GmmConfig(block_n=128, block_k=16)},
    "wgrad": {_BF16: WgradConfig(stages=3), _F32: WgradConfig(block_n=128, block_rows=32)},
}
# Steps of at least LARGE_ROWS_PER_GROUP rows per group on average (`large_steps`): 256-row blocks, two 128-row
# warpgroups, which run a product faster per FLOP where groups are large enough that padding each group to whole
# blocks (`moe_ffn`'s slab layout) costs less than that.
LARGE = {
    "gmm": {_BF16: GmmConfig(wg_rows=128, block_n=128, stages=3)},
    "swiglu": {_BF16: GmmConfig(wg_rows=128, block_n=64, stages=3)},
}
LARGE_ROWS_PER_GROUP = 160
# Decode: one 64-row tile per touched expert, n-blocks narrow enough that every SM streams weights.
DECODE = {
    "gmm": {_BF16: GmmConfig(compute_wgs=1, block_n=256, stages=4, grid_tile_width=1),
            _F32: GmmConfig(compute_wgs=1, block_n=64, block_k=32, stages=8, grid_tile_width=1),
            _FP8: GmmConfig(compute_wgs=1, block_n=256, block_k=128, stages=4, grid_tile_width=1)},
    "swiglu": {_BF16: GmmConfig(compute_wgs=1, block_n=128, stages=5, grid_tile_width=1),
               _F32: GmmConfig(compute_wgs=1, block_n=64, block_k=32, stages=4, grid_tile_width=1),
               _FP8: GmmConfig(compute_wgs=1, block_n=128, block_k=128, stages=5, grid_tile_width=1)},
}


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
    """Per-role tile overrides (None: the default for the dtype). Hashable, so it can be a static argument."""

    gmm: GmmConfig | None = None
    swiglu: GmmConfig | None = None
    gmm_pairs: GmmConfig | None = None
    wgrad: WgradConfig | None = None
    decode: bool = False  # start from the decode defaults where they exist
    large: bool = False  # start from the LARGE tiles where they exist (`large_steps`)

    def get(self, role: str, dtype):
        override = getattr(self, role)
        if override is not None:
            return override
        dtype = jnp.dtype(dtype)
        if self.decode and role in DECODE:
            return DECODE[role][dtype]
        if self.large and dtype in LARGE.get(role, {}):
            return LARGE[role][dtype]
        return DEFAULTS[role][dtype]


def large_steps(num_rows: int, num_groups: int) -> bool:
    """Whether a step of num_rows rows sorted into num_groups groups takes the LARGE tiles."""
    return num_rows >= LARGE_ROWS_PER_GROUP * num_groups


def fit_stages(cfg, stage_bytes: int, fixed_bytes: int):
    """Lowers `stages` until the pipeline buffers plus the epilogue buffers fit in SMEM."""
    stages = cfg.stages
    while stages > 2 and stages * stage_bytes + fixed_bytes > mgpu.smem_budget(cfg.compute_wgs + 1):
        stages -= 1
    return dataclasses.replace(cfg, stages=stages)


def fit_dims(cfg, n: int, k: int | None = None):
    """Halves block_n (and block_k, when given k) until they divide the problem; small test shapes need it.

    For the weight gradient, k is the output rows: it falls back to one compute warpgroup (64 rows).
    """
    block_n = cfg.block_n
    while n % block_n and block_n > 16:
        block_n //= 2
    cfg = dataclasses.replace(cfg, block_n=block_n, epi_n=min(cfg.epi_n, block_n))
    if n % block_n:
        raise ValueError(f"the kernels need a width divisible by 16, got {n}")
    if k is None:
        return cfg
    if isinstance(cfg, WgradConfig):  # the caller pads k to a multiple of block_rows_out
        return dataclasses.replace(cfg, compute_wgs=1) if k % cfg.block_rows_out else cfg
    block_k = cfg.block_k
    while k % block_k and block_k > 16:
        block_k //= 2
    if k % block_k:
        raise ValueError(f"the kernels need a contraction divisible by 16, got {k}")
    return dataclasses.replace(cfg, block_k=block_k)
