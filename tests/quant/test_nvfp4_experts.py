"""NVFP4 routed experts (`QuantConfig(expert_precision="nvfp4")`: `Nvfp4RoutedExperts`): the view holds them in
place of the bf16 ones, an NVFP4 checkpoint's packed experts load as stored (onto a mesh too), bad precision names
are refused.
Routing, closeness, the kernels against the formula and meshes: tests/quant/test_fp8_experts.py, for both formats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax.nn.moe import MoE
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.experts import Nvfp4RoutedExperts
from pallas_kernels.moe.nvfp4 import dequantize
from tests.quant.test_fp8_experts import moe_pair

NVFP4 = QuantConfig(expert_precision="nvfp4")


def test_quantised_layer_holds_nvfp4_experts_in_place_of_its_bf16_ones():
    _, nvfp4 = moe_pair("nvfp4")
    assert isinstance(nvfp4.experts, Nvfp4RoutedExperts) and not hasattr(nvfp4, "w_gate")
    experts = nvfp4.routed_experts()
    assert experts.w13.dtype == jnp.uint8 and experts.w13.shape == (8, 4, 2, 8, 128)  # gate and up, width padded to 128
    assert experts.w2.shape == (8, 1, 4, 8, 128) and experts.w2_scale2.dtype == jnp.float32
    assert nvfp4.shared.shared_gate.dtype == jnp.bfloat16  # the shared experts are not quantised


@pytest.fixture(scope="module")
def nvfp4_source(checkpoints, tmp_path_factory):
    """A tiny checkpoint in the NVFP4 repo's layout (routed experts of layers 3.. packed)."""
    from inkling_jax.checkpoint import nvfp4

    source = tmp_path_factory.mktemp("nvfp4") / "model"
    assert nvfp4.quantize_checkpoint(checkpoints("base")[0], str(source))
    return source


def test_an_nvfp4_checkpoint_loads_into_nvfp4_experts_as_stored(nvfp4_source, monkeypatch):
    """The NVFP4 repo's packed experts become NVFP4 experts with their stored codes and scales, never
    dequantised; the experts it stores in bf16 are quantised after loading as from any checkpoint."""
    from inkling_jax import load_pretrained
    from inkling_jax.checkpoint import hub_source, nvfp4
    from inkling_jax.checkpoint.safetensors_io import HubCheckpoint

    source = nvfp4_source
    loaded = load_pretrained(source, progress=False)  # packed experts dequantised as read
    read = {i: (layer.mlp.w_gate[...], layer.mlp.w_up[...], layer.mlp.w_down[...])
            for i, layer in enumerate(loaded.layers) if isinstance(layer.mlp, MoE)}
    after = serving_view(loaded, NVFP4, fuse=False)
    monkeypatch.setattr(hub_source.nvfp4, "dequantize", lambda *a: pytest.fail("a packed tensor was dequantised"))
    direct = load_pretrained(source, progress=False, quant=NVFP4)

    stored = HubCheckpoint(str(source))
    packed_layers = [i for i in read if i >= nvfp4.FIRST_QUANTISED_LAYER]
    assert packed_layers and len(packed_layers) < len(read)  # the release keeps layer 2's experts in bf16
    for i, (gate, up, down) in read.items():
        got, requantised = direct.layers[i].mlp.routed_experts(), after.layers[i].mlp.routed_experts()
        if i not in packed_layers:
            for a, b in zip(got, requantised):
                assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
            continue
        prefix = f"model.llm.layers.{i}.mlp.experts"
        np.testing.assert_array_equal(got.w13_scale2, stored.read(f"{prefix}.w13_weight.scale2"))
        np.testing.assert_array_equal(got.w2_scale2, stored.read(f"{prefix}.w2_weight.scale2"))
        width = gate.shape[2]
        w13 = dequantize(got.w13, got.w13_scale, got.w13_scale2, 2)
        w2 = dequantize(got.w2, got.w2_scale, got.w2_scale2, 1)[:, 0]
        np.testing.assert_array_equal(w13[:, 0, :width], np.asarray(gate).transpose(0, 2, 1))
        np.testing.assert_array_equal(w13[:, 1, :width], np.asarray(up).transpose(0, 2, 1))
        np.testing.assert_array_equal(w2[:, :, :width], np.asarray(down).transpose(0, 2, 1))
        assert not np.any(w13[:, :, width:]) and not np.any(w2[:, :, width:])

    tokens = jnp.arange(1, 13, dtype=jnp.int32)[None]
    forward = nnx.jit(lambda model, tokens: model(tokens))  # one compiled program for both
    want = forward(after, tokens)  # the same weights, each packed tensor's scales factored differently
    np.testing.assert_allclose(forward(direct, tokens), want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_packed_experts_load_straight_into_their_shards(nvfp4_source):
    from inkling_jax import load_pretrained
    from inkling_jax.checkpoint import nvfp4
    from inkling_jax.parallel.mesh import make_mesh

    one = load_pretrained(nvfp4_source, progress=False, quant=NVFP4)
    sharded = load_pretrained(nvfp4_source, progress=False, quant=NVFP4, mesh=make_mesh("tensor=2,expert=4"))
    moe = sharded.layers[nvfp4.FIRST_QUANTISED_LAYER].mlp
    assert moe.experts.w13_nvfp4.get_value().sharding.spec[:2] == ("expert", "tensor")
    for a, b in zip(jax.tree.leaves(nnx.state(one, nnx.Param)), jax.tree.leaves(nnx.state(sharded, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_precision_names_are_checked():
    with pytest.raises(ValueError, match="expert_precision"):
        QuantConfig("fp4")
    with pytest.raises(ValueError, match="dense_precision"):
        QuantConfig(dense_precision="int4")
