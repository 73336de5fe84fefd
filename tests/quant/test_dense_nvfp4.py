"""NVFP4 dense weights (inkling_jax/quant/dense_nvfp4.py, `QuantConfig(dense_precision="nvfp4")`): both paths of
the product pad and slice alike (the kernel itself: pallas_kernels/dense_w4), the format keeps NVFP4's error bound
and concatenates without requantising, and the quantised view is fused, close to the float model, and refused
with a tensor mesh (tests/quant/test_fp8_dense.py runs it on a mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, preset, with_backend
from inkling_jax.checkpoint import nvfp4
from inkling_jax.nn.attention import Attention
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.attention import FusedAttention
from inkling_jax.quant.dense_fp8 import Fp8Linear
from inkling_jax.quant.dense_nvfp4 import Nvfp4Linear
from inkling_jax.quant.head import Fp8HeadModel
from inkling_jax.quant.mlp import FusedMLP, SplitMLP
from inkling_jax.quant.moe import ServingMoE, WidenedSharedExperts
from serve.random_weights import random_model

TOKENS = jnp.asarray([[5, 17, 3, 99, 42, 7, 7, 1]])


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _matrix(shape, seed=0):
    return 0.05 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_matmul_pads_and_slices_odd_widths_the_same_on_both_paths():
    w = _matrix((100, 72))  # inputs padded to 128, outputs to 128
    linear = Nvfp4Linear.quantize(w)
    assert linear.nvfp4_codes.get_value().shape == (1, 2, 4, 8, 128) and linear.nvfp4_scale2.get_value().shape == (72,)
    x = jax.random.normal(jax.random.key(2), (2, 3, 100), jnp.float32)
    formula = with_backend(linear, Backend(moe="ragged"))(x)
    kernel = with_backend(linear, Backend(moe="pallas"))(x)
    assert formula.shape == kernel.shape == (2, 3, 72) and kernel.dtype == x.dtype
    assert _rel(kernel, formula) < 1e-2
    np.testing.assert_allclose(formula, x @ linear.dequantize(), rtol=1e-2, atol=1e-3)
    assert _rel(formula, x @ w) < 0.15  # 4-bit weights


def test_format_keeps_the_nvfp4_error_bound_and_concatenates_without_requantising():
    gate, up = _matrix((96, 64), 3), _matrix((96, 128), 4) * 10
    parts = [Nvfp4Linear.quantize(gate), Nvfp4Linear.quantize(up)]
    for part, w in zip(parts, (gate, up)):
        scale2 = part.nvfp4_scale2.get_value()
        assert np.all(scale2 == scale2[0])  # one global scale per matrix, as NVFP4 has
        bound = nvfp4.error_bound(np.asarray(w.T)[None], scale2[:1])[0].T
        assert np.all(np.abs(np.asarray(part.dequantize()) - np.asarray(w)) <= bound * (1 + 1e-6))
    fused = Nvfp4Linear.concatenate(parts)
    assert (fused.in_features, fused.out_features) == (96, 192)
    np.testing.assert_array_equal(fused.dequantize(), jnp.concatenate([p.dequantize() for p in parts], axis=1))
    with pytest.raises(ValueError, match="concatenate"):
        Nvfp4Linear.concatenate([Nvfp4Linear.quantize(_matrix((96, 40))), parts[0]])


def test_an_nvfp4_dense_mlp_fuses_gate_and_up_without_requantising():
    mlp = DenseMLP(64, 128, dtype=jnp.float32, rngs=nnx.Rngs(0))
    split = SplitMLP(*(Nvfp4Linear.quantize(w[...]) for w in (mlp.w_gate, mlp.w_up, mlp.w_down)), mlp.global_scale)
    x = jax.random.normal(jax.random.key(5), (3, 64), jnp.float32)
    split = with_backend(split, Backend(moe="ragged"))
    fused = split.fused()
    want, got = split(x)[0], fused(x)[0]
    assert isinstance(fused, FusedMLP) and isinstance(fused.w_gate_up, Nvfp4Linear)
    assert fused.w_gate_up.backend == Backend(moe="ragged")  # the fused matrix keeps the parts' backend
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_quantised_model_is_fused_and_stays_close():
    config = preset("tiny")
    model = random_model(config, jnp.float32, backend=Backend.parse("reference"))
    view = serving_view(model, QuantConfig(dense_precision="nvfp4"), fuse=False)  # NVFP4 fuses all the same
    forward = nnx.jit(lambda model, tokens: model(tokens))  # compiled: op by op is slow on CPU
    want, got = forward(model, TOKENS), forward(view, TOKENS)
    attentions = [node for _, node in nnx.iter_graph(view) if isinstance(node, Attention)]
    assert len(attentions) == config.text.num_layers + config.mtp.num_layers
    for attention in attentions:  # trunk and MTP
        assert isinstance(attention, FusedAttention)
        assert isinstance(attention.wqkvr, Nvfp4Linear) and isinstance(attention.wo, Nvfp4Linear)
    moes = [layer.mlp for layer in view.layers if isinstance(layer.mlp, ServingMoE)]
    assert moes and all(isinstance(moe.shared, WidenedSharedExperts) for moe in moes)
    assert all(isinstance(moe.shared.w_gate_up, Nvfp4Linear) and isinstance(moe.shared.w_down, Nvfp4Linear)
               for moe in moes)
    dense = [layer.mlp for layer in view.layers if isinstance(layer.mlp, DenseMLP)]  # fp8, fused
    assert dense and all(isinstance(m, FusedMLP) and isinstance(m.w_gate_up, Fp8Linear) for m in dense)
    assert isinstance(view, Fp8HeadModel)
    # the NVFP4 matrices run the kernels of the modules they were made from
    assert {node.backend for _, node in nnx.iter_graph(view) if isinstance(node, Nvfp4Linear)} == {model.backend}
    assert 1e-3 < _rel(got, want) < 0.15


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_a_tensor_mesh_is_refused():
    from inkling_jax.parallel.mesh import MeshError
    from serve.runner.placement import Placement

    with pytest.raises(MeshError, match="nvfp4"):
        Placement.from_spec("tensor=2").check(preset("tiny").text, dense_precision="nvfp4")
    Placement.from_spec("expert=2").check(preset("tiny").text, dense_precision="nvfp4")
