"""What the forward and both backward kernels share: the static geometry, which key/query blocks a block meets,
the row block of a query tile, and the base-2 logits of one (rows x block_k) tile with its relative bias.

Rows of a tile are (token, head) pairs: `block_q` consecutive tokens times the `groups` query heads that share one
KV head, row = token * groups + head_in_group. The K/V tile is then shared by the whole group, and the distances of
a tile span only block_q + block_k - 1 values, so the relative bias of the tile is a diagonal shear of the small
band matrix M = r_rows @ P[:, band] ([rows, 2 * block_k]): bias[row, j] = M[row, token(row) - j + block_k - 1].
The dK/dV kernel works on transposed (keys-major) tiles, as FlashAttention-2 does, so that no probability tile
has to be transposed in registers.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.rel_attention.row_gather import take_along_axis

LOG2E = 1.4426950408889634
NEG = -1e30  # finite "minus infinity": fully masked rows stay finite instead of NaN


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile and launch parameters of one kernel (block_q counts tokens; a tile has block_q * groups rows)."""
    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    mosaic: bool = False  # a tile of a Mosaic GPU kernel (mgpu_forward.py, mgpu_dkdv.py; block_q in tokens)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static description of one call; seq_q and seq_k are padded to a multiple of every block size."""
    groups: int
    head_dim: int
    d_rel: int
    extent: int
    window: int | None
    q_offset: int
    segmented: bool
    scale: float
    seq_q: int
    seq_k: int
    rel_left: int  # P is padded on the left by this many zero columns, so that negative distances index it
    interpret: bool
    blocks: Blocks

    @property
    def rows(self):
        return self.blocks.block_q * self.groups

    @property
    def masked(self):
        """Whether tiles away from the diagonal still need a mask (sliding window, packed sequences)."""
        return self.window is not None or self.segmented


def compiler_params(geo: Geometry):
    return plt.CompilerParams(num_warps=geo.blocks.num_warps, num_stages=geo.blocks.num_stages)


def batch_spec(shape):
    """BlockSpec of an array whose leading axis is the batch: one whole batch row per program (grid axis 2)."""
    return pl.BlockSpec((None, *shape[1:]), lambda i, g, b: (b,) + (0,) * (len(shape) - 1))


def whole_spec(shape):
    return pl.BlockSpec(shape, lambda i, g, b: (0,) * len(shape))


def ceil_div(a, b):
    return (a + b - 1) // b


def key_block_ranges(geo: Geometry, p0):
    """Key blocks met by the query block whose first token sits at position p0, as four bounds:
    [lo, near) lie entirely beyond the relative extent (no bias), [near, diag) are fully causal, and
    [diag, end) cross the diagonal. Blocks entirely outside the sliding window are never visited."""
    bk = geo.blocks.block_k
    end = jnp.minimum(p0 + geo.blocks.block_q - 1, geo.seq_k - 1) // bk + 1
    lo = 0 if geo.window is None else jnp.maximum(p0 - geo.window + 1, 0) // bk
    near = jnp.clip(jnp.maximum(p0 - geo.extent + 1, 0) // bk, lo, end)
    diag = jnp.clip((p0 + 1) // bk, near, end)
    return lo, near, diag, end


def query_block_ranges(geo: Geometry, k0):
    """Query blocks met by the key block starting at k0: [lo, diag) cross the diagonal, [diag, near) carry bias,
    [near, end) lie beyond the relative extent; blocks entirely past the sliding window are never visited."""
    tq, n_blocks = geo.blocks.block_q, geo.seq_q // geo.blocks.block_q
    k_last = k0 + geo.blocks.block_k - 1 - geo.q_offset  # last key, in query-token coordinates

    def first_block_with_start_at_least(t):
        return ceil_div(jnp.maximum(t, 0), tq)

    lo = jnp.minimum(jnp.maximum(k0 - geo.q_offset, 0) // tq, n_blocks)
    end = n_blocks if geo.window is None else jnp.clip(
        first_block_with_start_at_least(k_last + geo.window), lo, n_blocks)
    diag = jnp.clip(first_block_with_start_at_least(k_last), lo, end)
    near = jnp.clip(first_block_with_start_at_least(k_last + geo.extent), diag, end)
    return lo, diag, near, end


def fori(lo, hi, body, carry, *, descending=False):
    if descending:
        return lax.fori_loop(0, hi - lo, lambda i, c: body(hi - 1 - i, c), carry)
    return lax.fori_loop(lo, hi, body, carry)


def bias_loops(geo: Geometry, start, split, stop, *, diagonal_first):
    """(lo, hi, mask) loops over the blocks that carry bias, [start, split) then [split, stop): the diagonal
    part (the first one if diagonal_first, else the second) is masked, the other is not, unless every tile
    needs a mask anyway (sliding window, packed sequences): then it is a single masked loop."""
    if geo.masked:
        return ((start, stop, True),)
    return (start, split, diagonal_first), (split, stop, not diagonal_first)


def row_index(geo: Geometry, t0, g):
    """(token, head) of every row of the query block starting at token t0, for KV head g."""
    i = lax.broadcasted_iota(jnp.int32, (geo.rows,), 0)
    return t0 + i // geo.groups, g * geo.groups + i % geo.groups


class Rows(NamedTuple):
    """One query block, loaded once and reused for every key tile."""
    q: jax.Array  # [rows, D]
    r: jax.Array  # [rows, d_rel]
    rt2: jax.Array  # r * tau * log2(e): the operand that makes the band matrix in base-2 logit units
    tau: jax.Array  # [rows] fp32
    coef2: jax.Array  # scale * tau * log2(e): multiplies q.k
    pos: jax.Array  # [rows] absolute positions
    seg: jax.Array  # [rows] segment ids
    p0: jax.Array  # position of the first token


def load_rows(geo: Geometry, t0, g, q_ref, r_ref, tau_ref, qseg_ref, q_offset=None) -> Rows:
    """q_offset: the key index of query token 0, geo.q_offset unless given (traced, per batch row: chunk.py);
    without qseg_ref (no packed segments) `seg` is None."""
    q_offset = geo.q_offset if q_offset is None else q_offset
    tok, head = row_index(geo, t0, g)
    r = r_ref[tok, head, :]
    tau = tau_ref[tok].astype(jnp.float32)
    rt2 = (r.astype(jnp.float32) * (tau * LOG2E)[:, None]).astype(r.dtype)
    return Rows(q_ref[tok, head, :], r, rt2, tau, tau * (geo.scale * LOG2E), tok + q_offset,
                None if qseg_ref is None else qseg_ref[tok], q_offset + t0)


def online_softmax_step(carry, s, v):
    """One key tile of the forward's online softmax: carry (m, l, acc) of base-2 logits s [rows, keys] against
    values v [keys, D]."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    return m_new, l * alpha + p.sum(axis=1), acc * alpha[:, None] + dot(p.astype(v.dtype), v)


def load_band(geo: Geometry, p_ref, p0, k0):
    """P[:, d] for the 2 * block_k distances d = p0 - k0 - block_k + 1 + c of a tile, c in [0, 2 * block_k)."""
    bk = geo.blocks.block_k
    return p_ref[:, pl.ds(geo.rel_left + p0 - k0 - bk + 1, 2 * bk)]


def _band_column(geo: Geometry, width, keys_major=False):
    shape = (width, geo.rows) if keys_major else (geo.rows, width)
    row_axis, col_axis = (1, 0) if keys_major else (0, 1)
    tok = lax.broadcasted_iota(jnp.int32, shape, row_axis) // geo.groups
    return tok - lax.broadcasted_iota(jnp.int32, shape, col_axis) + geo.blocks.block_k - 1


def shear_index(geo: Geometry, keys_major=False):
    """Band column that holds the bias of (row, key j): token(row) - j + block_k - 1; [rows, block_k], or
    [block_k, rows] for keys-major tiles."""
    return _band_column(geo, geo.blocks.block_k, keys_major)


def unshear_index(geo: Geometry):
    """The inverse map, band column c -> key j = token(row) - c + block_k - 1 of the same row, and whether
    that key lies in the tile (the same formula: the shear is its own inverse on the band)."""
    j = _band_column(geo, 2 * geo.blocks.block_k)
    inside = (j >= 0) & (j < geo.blocks.block_k)
    return jnp.where(inside, j, 0), inside


# HIGHEST keeps fp32 operands out of TF32 (the Triton lowering's reading of DEFAULT); bf16 is unaffected.
def dot_t(a, b):
    """a @ b.T with fp32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def dot(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def sheared_bias(rows: Rows, band, shear, keys_major=False):
    """fp32 bias tile in base-2 logit units from the band matrix M = rt2 @ band: [rows, block_k], or
    [block_k, rows] when keys_major (then `shear` is shear_index(geo, keys_major=True))."""
    if keys_major:  # band^T @ rt2^T: [2 * block_k, rows]
        m = lax.dot_general(band, rows.rt2, (((0,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    else:
        m = dot(rows.rt2, band)
    return take_along_axis(m.astype(rows.rt2.dtype), shear, 0 if keys_major else 1).astype(jnp.float32)


def in_view(geo: Geometry, dist):
    """Whether a key `dist` positions before its query may be seen: not a future key, and on sliding layers not
    one past the window. Every kernel's mask (Triton and Mosaic GPU) asks this."""
    seen = dist >= 0
    return seen if geo.window is None else seen & (dist < geo.window)


def tile_logits(geo: Geometry, rows: Rows, k, k0, kseg_ref, *, bias=None, mask=False, keys_major=False):
    """Base-2 logits of one tile: tau * (q.k * scale + bias) * log2(e), masked to NEG; [rows, block_k], or
    [block_k, rows] when keys_major. `bias` is the tile's fp32 bias in base-2 units (same orientation), given on
    tiles that carry relative bias."""
    per_row = (lambda x: x[None, :]) if keys_major else (lambda x: x[:, None])
    per_key = (lambda x: x[:, None]) if keys_major else (lambda x: x[None, :])
    s = (dot_t(k, rows.q) if keys_major else dot_t(rows.q, k)) * per_row(rows.coef2)
    if bias is not None:
        s = s + bias
    if mask:
        bk = geo.blocks.block_k
        dist = per_row(rows.pos) - per_key(k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0))
        visible = in_view(geo, dist)
        if geo.segmented:
            visible &= per_row(rows.seg) == per_key(kseg_ref[pl.ds(k0, bk)])
        s = jnp.where(visible, s, NEG)
    return s
