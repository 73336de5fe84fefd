"""The choice of grouped matmuls (`MatmulKernels`): jax's Mosaic-GPU ragged dot runs where it is chosen and only
there, inside our custom VJPs, with the gradients of the reference.

jax's kernels run compiled only, so on CPU they are replaced by stand-ins with their contract (jnp products that
leave NaN, like unwritten memory, in the rows of no group); tests/test_gpu_lowering.py lowers the real ones for
CUDA. The Pallas side runs interpreted as in test_moe.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import MatmulKernels, grouped_matmul, jax_mgpu, moe_ffn, reference
from pallas_kernels.moe.test_moe import (
    GROUP_SIZES,
    check_moe,
    moe_inputs,
    normal,
    rel_err,
    small_configs,
    value_and_vjp,
)

PALLAS, JAX = jax_mgpu.PALLAS, jax_mgpu.JAX_MGPU


def _no_group_rows_nan(out, group_sizes):
    rows = jnp.arange(out.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.nan).astype(out.dtype)


class StandIns:
    """jnp versions of jax's two kernels that record how they were called."""

    def __init__(self):
        self.calls = []

    def ragged_dot(self, lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n,
                   transpose_rhs=False):
        rhs = rhs.transpose(0, 2, 1) if transpose_rhs else rhs
        assert lhs.shape[1] % block_k == 0 and rhs.shape[2] % block_n == 0
        self.calls.append(("ragged_dot", transpose_rhs))
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        return _no_group_rows_nan(out, group_sizes).astype(lhs.dtype)

    def transposed_ragged_dot(self, lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                              grid_block_n):
        assert lhs.shape[1] % block_m == 0 and rhs.shape[1] % block_n == 0
        self.calls.append(("transposed_ragged_dot", None))
        onehot = jax.nn.one_hot(reference.group_ids(group_sizes, lhs.shape[0]), group_sizes.shape[0])
        out = jnp.einsum("mg,mk,mn->gkn", onehot, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
        return out.astype(lhs.dtype)


@pytest.fixture
def stand_ins(monkeypatch):
    """jax's kernels replaced by recording stand-ins; they take any interpret flag, so that ours can run
    interpreted beside them. The kernels' entries are jitted: their traces of earlier tests are dropped, so that
    this test's calls trace (and record) anew."""
    jax.clear_caches()
    fakes = StandIns()
    monkeypatch.setattr(jax_mgpu, "kernels", lambda interpret: (fakes.ragged_dot, fakes.transposed_ragged_dot))
    return fakes


# jax's products: the forward's gate, up and down; the backward's two dgrads and three weight gradients.
MOE_CALLS = {"forward": [("ragged_dot", False)] * 3,
             "backward": [("ragged_dot", True)] * 2 + [("transposed_ragged_dot", None)] * 3}
CHOICES = [(PALLAS, JAX), (JAX, PALLAS), (JAX, JAX)]


def _expected(calls, forward, backward):
    """The kinds of call to jax's kernels (a jitted entry traces its forward for the primal and again for the
    gradient: kinds, not counts)."""
    return set((calls["forward"] if forward == JAX else []) + (calls["backward"] if backward == JAX else []))


@pytest.mark.parametrize("forward,backward", CHOICES)
def test_moe_ffn_runs_the_chosen_matmuls(stand_ins, forward, backward):
    args = moe_inputs(jax.random.key(3), 300, 192, 192, GROUP_SIZES, jnp.bfloat16)
    check_moe(lambda *a: moe_ffn(*a, interpret=True, configs=small_configs(jnp.bfloat16),
                                 kernels=MatmulKernels(forward, backward)), args, jnp.bfloat16)
    assert set(stand_ins.calls) == _expected(MOE_CALLS, forward, backward)


@pytest.mark.parametrize("forward,backward", CHOICES)
def test_grouped_matmul_runs_the_chosen_matmuls(stand_ins, forward, backward):
    m, k, n = 300, 192, 128
    gs = jnp.array(GROUP_SIZES, jnp.int32)
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x, w, dy = (normal(kx, (m, k), jnp.bfloat16), normal(kw, (len(GROUP_SIZES), k, n), jnp.bfloat16, 0.1),
                normal(kd, (m, n), jnp.bfloat16))
    out, grads = value_and_vjp(lambda x, w: grouped_matmul(x, w, gs, interpret=True,
                                                           configs=small_configs(jnp.bfloat16),
                                                           kernels=MatmulKernels(forward, backward)), (x, w), dy)
    want, grads_ref = value_and_vjp(lambda x, w: reference.grouped_matmul(x, w, gs), (x, w), dy)
    assert not np.any(np.asarray(out[sum(GROUP_SIZES):], np.float32))
    for got, ref in zip((out, *grads), (want, *grads_ref)):
        assert rel_err(got, ref) < 2e-2
    calls = {"forward": [("ragged_dot", False)],
             "backward": [("ragged_dot", True), ("transposed_ragged_dot", None)]}
    assert set(stand_ins.calls) == _expected(calls, forward, backward)


def test_jax_matmuls_refuse_what_they_cannot_run():
    x, w, gs = jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16), jnp.array([64, 64])
    with pytest.raises(ValueError, match="runs compiled only"):
        grouped_matmul(x, w, gs, interpret=True, kernels=MatmulKernels(forward=JAX))
    with pytest.raises(TypeError, match="16-bit operands"):
        grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), gs, interpret=False,
                       kernels=MatmulKernels(forward=JAX))
    with pytest.raises(ValueError, match="divisible by 64, got 96"):
        jax_mgpu.ragged_dot(x, jnp.zeros((2, 64, 96), jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="backward matmuls must be one of"):
        MatmulKernels(backward="triton")
    with pytest.raises(ValueError, match="forward matmuls must be one of"):
        MatmulKernels(forward="auto")  # "auto" is the Backend's word, resolved before it gets here
