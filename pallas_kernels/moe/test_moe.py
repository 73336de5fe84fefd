"""Grouped matmul and MoE FFN kernels vs the ragged_dot reference: forward and every gradient.

On CPU this runs the portable kernels in interpret mode; on a GPU the same tests run the Mosaic-GPU kernels
compiled. MOE_MOSAIC_INTERPRET=1 adds the Mosaic-GPU kernels through Pallas's GPU interpreter on CPU (minutes;
use jax >= 0.11, whose interpreter zero-fills partially out-of-bounds TMA reads like the hardware).
Shapes have 3 row blocks (M not a multiple of the block), 3 n-blocks, 3 k-steps, an empty group, uneven groups
and rows past sum(group_sizes).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import interpret_default
from pallas_kernels.moe import (DECODE_MAX_ROWS, GmmConfig, KernelConfigs, WgradConfig, grouped_matmul, moe_ffn,
                                moe_ffn_decode, reference)
from pallas_kernels.moe import matmuls, tuning
from pallas_kernels.moe.groups import row_block_passes
from pallas_kernels.moe.matmuls import MOSAIC

DTYPES = [jnp.float32, jnp.bfloat16]
# jax 0.10's GPU interpreter has no wgmma on a transposed operand (the dgrads' weights): the thread running it
# fails and the others wait at a barrier for ever, so there the opt-in interpreted kernels are skipped.
_MOSAIC_INTERPRETED = pytest.param(MOSAIC, marks=pytest.mark.skipif(
    jax.__version_info__ < (0, 11), reason="jax 0.10's GPU interpreter has no transposed wgmma operand"))
BACKENDS = [None] + ([_MOSAIC_INTERPRETED] if interpret_default() and os.environ.get("MOE_MOSAIC_INTERPRET") else [])
GROUP_SIZES = (61, 0, 130, 17, 52)  # sum 260 of 300 rows: an empty group, blocks straddling groups


def small_configs(dtype):
    """3 blocks per tiled axis at the test shapes; fp32 (tf32) needs 32-element K tiles."""
    bk = 64 if dtype == jnp.bfloat16 else 32
    return KernelConfigs(gmm=GmmConfig(block_n=64, block_k=bk, stages=3),
                         swiglu=GmmConfig(block_n=64, block_k=bk, stages=3),
                         gmm_pairs=GmmConfig(block_n=64, block_k=bk // 2, stages=3),
                         wgrad=WgradConfig(block_n=64, block_rows=bk, stages=3))


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def tolerance(dtype):
    if dtype == jnp.bfloat16:
        return 2e-2
    return 1e-5 if interpret_default() else 1e-2  # the GPU kernel multiplies fp32 as tf32


def normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@pytest.mark.parametrize("rows_per_group", [tuning.LARGE_ROWS_PER_GROUP - 1, tuning.LARGE_ROWS_PER_GROUP])
def test_steps_of_many_rows_per_group_take_the_large_tiles(monkeypatch, rows_per_group):
    """bf16 `moe_ffn` (traced, not run): its gate|up (swiglu) and down (gmm) kernels get `tuning.LARGE`'s tiles from
    `LARGE_ROWS_PER_GROUP` rows per group on, `DEFAULTS`' below, on rows padded per group to their block rows."""
    seen, gmm = {}, matmuls.gmm

    def recording(lhs, rhs, *args, cfg, **kwargs):
        seen["swiglu" if len(rhs) == 2 else "gmm"] = cfg, lhs[0].shape[0]
        return gmm(lhs, rhs, *args, cfg=cfg, **kwargs)
    monkeypatch.setattr(matmuls, "gmm", recording)
    groups, bf16, shape = 32, jnp.bfloat16, jax.ShapeDtypeStruct
    rows = groups * rows_per_group
    jax.eval_shape(lambda *a: moe_ffn(*a, interpret=False), shape((rows, 256), bf16),
                   shape((groups, 256, 128), bf16), shape((groups, 256, 128), bf16), shape((groups, 128, 256), bf16),
                   shape((groups,), jnp.int32), shape((rows,), jnp.float32))
    table = tuning.LARGE if rows_per_group >= tuning.LARGE_ROWS_PER_GROUP else tuning.DEFAULTS
    for role in ("gmm", "swiglu"):
        cfg, slab_rows = seen[role]
        assert cfg == table[role][jnp.dtype(bf16)], role
        # every group padded to whole blocks: room for the rows and up to a block less one per group
        assert slab_rows % cfg.block_rows == 0 and slab_rows >= rows + groups * (cfg.block_rows - 1)


def test_row_block_passes_schedule():
    passes = row_block_passes(jnp.array([3, 0, 6, 2], jnp.int32), 16, 4)
    # Blocks [0,4) [4,8) [8,12) [12,16); groups 0:[0,3) 2:[3,9) 3:[9,11); rows 11.. belong to none.
    np.testing.assert_array_equal(passes.first_pass, [0, 1, 1, 3])
    np.testing.assert_array_equal(passes.num_passes, [2, 1, 2, 0])
    np.testing.assert_array_equal(passes.mixed[:3], [1, 0, 1])
    np.testing.assert_array_equal(passes.group[:3], [0, 2, 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["w", "w_transposed"])
def test_grouped_matmul_forward_and_grads(dtype, backend, transpose_rhs):
    m, k, n = 300, 192, 192
    gs = jnp.array(GROUP_SIZES, jnp.int32)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x, w, dy = normal(kx, (m, k), dtype), normal(kw, (len(GROUP_SIZES), k, n), dtype, 0.1), normal(kd, (m, n), dtype)
    stored = lambda w: w.transpose(0, 2, 1) if transpose_rhs else w  # noqa: E731  (w as the kernel takes it)
    out, grads = value_and_vjp(lambda x, w: grouped_matmul(x, stored(w), gs, transpose_rhs=transpose_rhs,
                                                           interpret=backend, configs=small_configs(dtype)), (x, w), dy)
    want, grads_ref = value_and_vjp(lambda x, w: reference.grouped_matmul(x, w, gs), (x, w), dy)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, want) < tolerance(dtype)
    assert rel_err(out, reference.grouped_matmul_dense(x, w, gs)) < tolerance(dtype)
    assert not np.any(np.asarray(out[sum(GROUP_SIZES):], np.float32))
    for got, ref in zip(grads, grads_ref):
        assert rel_err(got, ref) < tolerance(dtype)


def moe_inputs(key, m, h, i, group_sizes, dtype):
    ks = jax.random.split(key, 6)
    g = len(group_sizes)
    return (normal(ks[0], (m, h), dtype), normal(ks[1], (g, h, i), dtype, h ** -0.5),
            normal(ks[2], (g, h, i), dtype, h ** -0.5), normal(ks[3], (g, i, h), dtype, i ** -0.5),
            jnp.array(group_sizes, jnp.int32), jax.random.uniform(ks[4], (m,), jnp.float32, 0.1, 1.0),
            normal(ks[5], (m, h), dtype))


def value_and_vjp(fn, args, cotangent):
    """fn(*args) and its VJP at `cotangent`, under one jit (one compile instead of one per kernel call)."""
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)
    return jax.jit(run)(args, cotangent)


def check_moe(fn, args, dtype):
    x, wg, wu, wd, gs, rw, dy = args
    out, grads = value_and_vjp(lambda x, wg, wu, wd, rw: fn(x, wg, wu, wd, gs, rw), (x, wg, wu, wd, rw), dy)
    want, grads_ref = value_and_vjp(lambda x, wg, wu, wd, rw: reference.moe_ffn(x, wg, wu, wd, gs, rw),
                                    (x, wg, wu, wd, rw), dy)
    assert out.dtype == dtype
    assert rel_err(out, want) < tolerance(dtype)
    assert not np.any(np.asarray(out[int(gs.sum()):], np.float32))
    for name, got, ref in zip(["x", "w_gate", "w_up", "w_down", "row_weights"], grads, grads_ref):
        assert got.dtype == ref.dtype, name
        assert rel_err(got, ref) < tolerance(dtype), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_ffn_forward_and_grads(dtype, backend):
    args = moe_inputs(jax.random.key(3), 300, 192, 192, GROUP_SIZES, dtype)
    check_moe(lambda *a: moe_ffn(*a, interpret=backend, configs=small_configs(dtype)), args, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_ffn_decode_sized(backend):
    # 5 tokens x (top-2 + 2 shared) = 20 rows over 6 groups, one untouched: moe_ffn takes the decode layout.
    args = moe_inputs(jax.random.key(4), 20, 64, 192, (3, 0, 2, 5, 5, 5), jnp.bfloat16)
    assert args[0].shape[0] <= DECODE_MAX_ROWS
    check_moe(lambda *a: moe_ffn(*a, interpret=backend), args, jnp.bfloat16)


@pytest.mark.parametrize("bound", [24, None], ids=["bounded", "slabs_per_group"])
def test_moe_ffn_decode_explicit_bound(bound):
    # 24 tokens x 4 rows = 96 rows (> DECODE_MAX_ROWS); no group exceeds the 24-token bound. Unbounded, the
    # groups of 70 and 2 rows take two slabs and one.
    sizes = (24, 10, 0, 14, 24, 24) if bound else (70, 2, 0, 10, 14, 0)
    args = moe_inputs(jax.random.key(5), 120 if bound is None else 96, 128, 128, sizes, jnp.float32)
    check_moe(lambda *a: moe_ffn_decode(*a, max_group_rows=bound), args, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_narrow_widths(backend):
    # The tiny model's experts: width 32. The weight gradient's output rows are tiled by 64-row warpgroups, so
    # K = 32 once left w's gradient unwritten (NaN); 16-bit MoE weights are padded to width 64 and a grouped
    # matmul's 16-bit K of 32 to 64 (Mosaic GPU cannot lay out tiles narrower than a 128-byte span), fp32 ones keep
    # 32. 160 rows take the row-blocked path.
    sizes = (30, 0, 41, 9, 20, 25, 15, 12)
    gs = jnp.array(sizes, jnp.int32)
    kx, kw, kd = jax.random.split(jax.random.key(7), 3)
    for dtype in DTYPES:
        x, w, dy = normal(kx, (160, 32), dtype), normal(kw, (8, 32, 64), dtype, 0.2), normal(kd, (160, 64), dtype)
        out, grads = value_and_vjp(lambda x, w: grouped_matmul(x, w, gs, interpret=backend), (x, w), dy)
        want, grads_ref = value_and_vjp(lambda x, w: reference.grouped_matmul(x, w, gs), (x, w), dy)
        for got, ref in zip((out, *grads), (want, *grads_ref)):
            assert got.shape == ref.shape and rel_err(got, ref) < tolerance(dtype)
    for dtype in DTYPES:
        args = moe_inputs(jax.random.key(6), 160, 64, 32, sizes, dtype)
        check_moe(lambda *a: moe_ffn(*a, interpret=backend), args, dtype)


def _column_pads(jaxpr):
    """(input, output) shapes of every pad in a jaxpr, nested ones included, that widens the columns."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pad" and eqn.invars[0].aval.shape[1:] != eqn.outvars[0].aval.shape[1:]:
            found.append((eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += _column_pads(inner)
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_narrow_weight_gradient_is_the_transposed_product(backend):
    # fp32 weight rows K = 32 (one 128-byte span, under a warpgroup's 64 rows): dy^T @ x with 3 row blocks of 64
    # (N = 192) and 10 contraction blocks, transposed back, instead of x padded to 64 columns.
    m, k, n = 300, 32, 192
    gs = jnp.array(GROUP_SIZES, jnp.int32)
    kx, kd = jax.random.split(jax.random.key(8))
    x, dy = normal(kx, (m, k), jnp.float32), normal(kd, (m, n), jnp.float32)
    interpret = interpret_default() if backend is None else backend

    def wgrad(x, dy):
        return matmuls.tgmm(x, dy, gs, cfg=small_configs(x.dtype).wgrad, interpret=interpret)
    onehot = jax.nn.one_hot(reference.group_ids(gs, m), len(GROUP_SIZES))
    want = jnp.einsum("mg,mk,mn->gkn", onehot, x, dy, precision=jax.lax.Precision.HIGHEST)
    assert rel_err(jax.jit(wgrad)(x, dy), want) < tolerance(jnp.float32)
    assert not _column_pads(jax.make_jaxpr(wgrad)(x, dy).jaxpr)
    # 16-bit rows of 32 are half a span: those activations are padded to the warpgroup's 64 rows. Traced with
    # the 16-bit tiles: compiled, tracing lowers the kernel (`lowered_once`), and Mosaic GPU lowers no 16-bit
    # kernel of the fp32 tiles' 32-row blocks.
    half = jax.make_jaxpr(wgrad)(x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)).jaxpr
    assert _column_pads(half) == [((m, k), (m, 64))]
