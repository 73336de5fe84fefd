"""The adapted MoE's routed experts on the kernels (`Backend` moe and lora "pallas", interpreted): the (token,
expert) rows of several adapter slots over every expert give what the jnp path gives (which test_view.py checks
against merged models), and the compiled step's scratch memory grows with the rows, not with rows x (expert,
slot) groups as `jax.lax.ragged_dot` over the groups needs (XLA pads every group to all rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, with_backend
from inkling_jax.quant.view import serving_view
from serve.lora.view import lora_view, route
from tests.serve.lora.adapters import CONFIG, base_model

TEXT = CONFIG.text

SLOTS, RANK = 32, 8
ROW_SLOTS = np.array([0, 5, 17, 31])  # a base row and three adapters
TOKENS = 256  # per row: 4 x 256 x top-2 = 2048 (token, expert) rows
KERNELS = Backend.parse("reference,moe=pallas,lora=pallas")


def _adapted_moe():
    """Layer 1's AdaptedMoE with random factors in every slot but the base's, its rows in ROW_SLOTS."""
    view = lora_view(serving_view(base_model(), fuse=True), slots=SLOTS, rank=RANK, experts=True)
    moe = view.layers[1].mlp
    rng = np.random.default_rng(0)
    for stack in moe.stacks():
        for adapters in stack.projections():
            for pool in (adapters.a, adapters.b):
                factors = rng.normal(0, 0.1, pool.shape).astype(np.float32)
                factors[:, 0] = 0
                pool.set_value(jnp.asarray(factors))
            adapters.scale.set_value(jnp.asarray(np.r_[0, rng.uniform(0.5, 2, SLOTS - 1)], jnp.float32))
    route(view, ROW_SLOTS)
    return moe


def _compiled(module, x):
    graph, state = nnx.split(module)
    return jax.jit(lambda state, x: nnx.merge(graph, state)(x)[0]).lower(state, x).compile(), state


@pytest.fixture(scope="module")
def setup():
    moe = _adapted_moe()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(len(ROW_SLOTS), TOKENS, TEXT.hidden_size)), jnp.float32)
    kernels, state = _compiled(with_backend(moe, KERNELS), x)
    return moe, x, kernels, state


def test_the_kernels_give_the_jnp_paths_outputs(setup):
    moe, x, kernels, state = setup
    reference, expert_ids = nnx.jit(lambda moe, x: moe(x))(moe, x)
    assert len(np.unique(np.asarray(expert_ids))) == TEXT.num_experts
    base, outputs = np.asarray(moe.moe(x)[0]), np.asarray(kernels(state, x))
    assert np.abs(np.asarray(reference)[1:] - base[1:]).max() > 1e-2  # the adapters change the output
    np.testing.assert_allclose(outputs, np.asarray(reference), rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(outputs[0], base[0], rtol=2e-5, atol=2e-4)  # the base row: the base


def test_the_kernels_scratch_memory_holds_no_rows_by_groups_array(setup):
    """XLA's ragged product over the (expert, slot) groups holds [rows, groups, width] arrays (on the CPU as on
    the GPU); the kernels' step stays below a quarter of one such array at the model's hidden width."""
    _, x, kernels, _ = setup
    rows, groups = x.shape[0] * x.shape[1] * TEXT.num_experts_per_tok, TEXT.num_experts * SLOTS
    padded_bytes = rows * groups * TEXT.hidden_size * 4  # one fp32 [rows, groups, hidden]
    assert kernels.memory_analysis().temp_size_in_bytes < padded_bytes / 4
