"""NVFP4 routed experts in the model (`InklingModel.quantize_routed_experts("nvfp4")`): the bf16 weights are
replaced and freed, an NVFP4 checkpoint keeps its values through loading, bad precision names are refused.
Routing, closeness, the kernels against the formula and meshes: tests/test_fp8_experts.py, for both formats."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import preset
from inkling_jax.mlp import MoE
from pallas_kernels.moe.nvfp4 import dequantize
from serve.random_weights import random_model
from tests.test_fp8_experts import moe_pair


def test_quantised_layer_drops_its_bf16_experts():
    _, nvfp4 = moe_pair("nvfp4")
    assert nvfp4.precision == "nvfp4" and not nvfp4.fp8 and not hasattr(nvfp4, "w_gate")
    experts = nvfp4.routed_experts()
    assert experts.w13.dtype == jnp.uint8 and experts.w13.shape == (8, 256, 32)  # gate and up, width padded to 128
    assert experts.w2.shape == (8, 64, 64) and experts.w2_scale2.dtype == jnp.float32
    assert nvfp4.shared_gate.dtype == jnp.bfloat16  # the shared experts are not quantised


def test_an_nvfp4_checkpoint_loads_into_nvfp4_experts_with_its_own_values(checkpoints, tmp_path):
    """The NVFP4 repo's packed experts are dequantised as they are read and quantised back layer by layer:
    the same experts as quantising after a full-precision load; those stored in NVFP4 keep their own values."""
    from inkling_jax import load_pretrained, nvfp4

    source = tmp_path / "nvfp4"
    assert nvfp4.quantize_checkpoint(checkpoints("base")[0], str(source))
    direct = load_pretrained(source, progress=False, expert_precision="nvfp4")
    after = load_pretrained(source, progress=False)
    # the release stores the experts of layers 3.. in NVFP4 (the earlier ones are bf16 there, and lose precision)
    moes = [layer.mlp for i, layer in enumerate(after.layers)
            if isinstance(layer.mlp, MoE) and i >= nvfp4.FIRST_QUANTISED_LAYER]
    assert moes
    read = [(m.w_gate[...], m.w_up[...], m.w_down[...]) for m in moes]
    after.quantize_routed_experts("nvfp4")
    for a, b in zip(jax.tree.leaves(nnx.state(direct, nnx.Param)), jax.tree.leaves(nnx.state(after, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for moe, (gate, up, down) in zip(moes, read):
        experts = moe.routed_experts()
        width = gate.shape[2]
        w13 = dequantize(experts.w13, experts.w13_scale, experts.w13_scale2, 2)
        w2 = dequantize(experts.w2, experts.w2_scale, experts.w2_scale2, 1)[:, 0]
        # equal up to scale2, which XLA may compute with a reciprocal (1 ulp from numpy's division)
        same = functools.partial(np.testing.assert_allclose, rtol=3e-7, atol=0)
        same(w13[:, 0, :width], np.asarray(gate).transpose(0, 2, 1))
        same(w13[:, 1, :width], np.asarray(up).transpose(0, 2, 1))
        same(w2[:, :, :width], np.asarray(down).transpose(0, 2, 1))


def test_precision_names_are_checked():
    model = random_model(preset("tiny"), jnp.bfloat16)
    with pytest.raises(ValueError, match="expert_precision"):
        model.quantize("fp4")
    with pytest.raises(ValueError, match="dense_precision"):
        model.quantize(dense_precision="nvfp4")
