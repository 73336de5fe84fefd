"""jax's own Mosaic-GPU grouped matmuls (`jax.experimental.pallas.ops.gpu`: `ragged_dot_mgpu` and
`transposed_ragged_dot_mgpu`) with the contracts of our kernels (`matmuls.gmm` with a plain epilogue, `matmuls.tgmm`),
so that `ops` can run either in the forward or the backward of its custom VJPs (`MatmulKernels`).

jax's kernels run compiled only (they have no interpreter form), take 16-bit operands, and leave the output rows
past sum(group_sizes) unwritten, which `gmm` zeroes. Their tiles are those `benchmarks/moe.py` measured them with.
"""

import dataclasses

import jax
import jax.numpy as jnp

try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
except ImportError as exc:  # an older or newer jax without them
    ragged_dot_mgpu = transposed_ragged_dot_mgpu = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = ""

PALLAS, JAX_MGPU = "pallas", "jax_mgpu"
IMPLEMENTATIONS = (PALLAS, JAX_MGPU)


@dataclasses.dataclass(frozen=True)
class MatmulKernels:
    """Which grouped matmuls run a layer's forward (gate/up and down) and its backward (dgrads and weight
    gradients): PALLAS (ours) or JAX_MGPU (jax's). Hashable: a static argument."""

    forward: str = PALLAS
    backward: str = PALLAS

    def __post_init__(self):
        for name in ("forward", "backward"):
            if getattr(self, name) not in IMPLEMENTATIONS:
                raise ValueError(f"MoE {name} matmuls must be one of {IMPLEMENTATIONS}, not {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 8


RAGGED_DOT_TILES = Tiles()
TRANSPOSED_TILES = Tiles(grid_block_n=4)


def kernels(interpret):
    """(ragged_dot, transposed_ragged_dot) from jax; a clear error where this jax has none, or for an
    interpreted run (they have no interpreted form)."""
    if interpret is not False:
        raise ValueError("jax's Mosaic-GPU ragged dot runs compiled only (interpret=False); it has no "
                         f"interpreted form, got interpret={interpret!r}")
    if ragged_dot_mgpu is None:
        raise RuntimeError(f"jax {jax.__version__} has no Mosaic-GPU ragged dot (jax.experimental.pallas.ops.gpu."
                           f"ragged_dot_mgpu / transposed_ragged_dot_mgpu: {_IMPORT_ERROR}); choose the pallas "
                           "MoE matmuls instead")
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _fit(block: int, dim: int, smallest: int, what: str) -> int:
    """`block` halved until it divides `dim`, not below `smallest`."""
    while dim % block and block > smallest:
        block //= 2
    if dim % block:
        raise ValueError(f"jax's Mosaic-GPU ragged dot needs {what} divisible by {smallest}, got {dim}")
    return block


def _check(*operands):
    for a in operands:
        if jnp.dtype(a.dtype).itemsize != 2:
            raise TypeError(f"jax's Mosaic-GPU ragged dot takes 16-bit operands, got {a.dtype}")


def ragged_dot(lhs, w, group_sizes, *, transpose_rhs: bool = False, interpret=False):
    """jax's kernel as it is: lhs [M, K] @ w[g] ([G, K, N], or [G, N, K] with transpose_rhs) for the rows of g;
    rows past sum(group_sizes) are left unwritten."""
    n = w.shape[1] if transpose_rhs else w.shape[2]
    tiles = RAGGED_DOT_TILES
    tiles = dataclasses.replace(tiles, block_n=_fit(tiles.block_n, n, 64, "the output width"),
                                block_k=_fit(tiles.block_k, lhs.shape[1], 16, "the contraction"))
    return kernels(interpret)[0](lhs, w, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=transpose_rhs,
                                 **dataclasses.asdict(tiles))


def transposed_ragged_dot(x, dy, group_sizes, *, interpret=False):
    """jax's kernel as it is: out[g] = x[rows of g]^T @ dy[rows of g], x [M, K], dy [M, N] -> [G, K, N]."""
    tiles = TRANSPOSED_TILES
    tiles = dataclasses.replace(tiles, block_m=_fit(tiles.block_m, x.shape[1], 64, "the weight rows"),
                                block_n=_fit(tiles.block_n, dy.shape[1], 64, "the weight columns"))
    return kernels(interpret)[1](x, dy, group_sizes=group_sizes.astype(jnp.int32), **dataclasses.asdict(tiles))


def gmm(lhs, weights, group_sizes, *, transpose_rhs: bool, pairs, interpret):
    """`matmuls.gmm` with one accumulator and the plain epilogue: the sum over `pairs` (lhs index, rhs index, 0)
    as one product, the pairs' operands concatenated along the contraction; zeros past sum(group_sizes)."""
    if any(a for _, _, a in pairs):
        raise ValueError(f"jax's Mosaic-GPU ragged dot computes one accumulator, got pairs {pairs}")
    _check(*lhs, *weights)
    contraction = 2 if transpose_rhs else 1
    x = jnp.concatenate([lhs[li] for li, _, _ in pairs], axis=1)
    w = jnp.concatenate([weights[ri] for _, ri, _ in pairs], axis=contraction)
    out = ragged_dot(x, w, group_sizes, transpose_rhs=transpose_rhs, interpret=interpret)
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes.astype(jnp.int32)), out, jnp.zeros((), out.dtype))


def tgmm(x, dy, group_sizes, *, interpret):
    """`matmuls.tgmm`: per-group x[rows of g]^T @ dy[rows of g] -> [G, K, N] in x.dtype (empty groups: zeros)."""
    _check(x, dy)
    return transposed_ragged_dot(x, dy, group_sizes, interpret=interpret)
