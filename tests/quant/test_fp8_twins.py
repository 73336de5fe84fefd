"""fp8 twins of NVFP4 weights (`QuantConfig(fp8_twins=True)`: `Nvfp4LinearWithTwin`, `Nvfp4RoutedExpertsWithTwin`):
wide products take the twin and narrow ones the NVFP4 form, untouched (bit for bit); the twin carries the NVFP4
values up to fp8's rounding; fusing keeps twins; a view gives every NVFP4 weight one, and the decode bytes the
benchmarks count leave them out. The serving steps with twins lower for CUDA in tests/test_gpu_lowering.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.model import decode_step_bytes
from inkling_jax import Backend, preset
from inkling_jax.nn.attention import Attention
from inkling_jax.quant import QuantConfig, dense_fp8, experts, serving_view
from inkling_jax.quant.dense_nvfp4 import TWIN_ROWS, Nvfp4Linear, Nvfp4LinearWithTwin
from inkling_jax.quant.experts import Nvfp4RoutedExpertsWithTwin
from inkling_jax.quant.moe import ServingMoE
from inkling_jax.quant.view import moe_view
from pallas_kernels.moe.fp8 import Fp8Experts
from pallas_kernels.moe.fp8 import dequantize_experts as fp8_float
from pallas_kernels.moe.nvfp4 import Nvfp4Experts
from pallas_kernels.moe.nvfp4 import dequantize_experts as nvfp4_float
from serve.random_weights import random_model
from tests.quant.test_fp8_experts import _rel, moe_pair


def _linear(shape=(96, 128), seed=0, twin=True):
    linear = Nvfp4Linear.quantize(0.05 * jax.random.normal(jax.random.key(seed), shape, jnp.float32),
                                  backend=Backend(moe="ragged"))  # the jnp formula
    return linear.with_twin() if twin else linear


def test_a_dense_twin_takes_only_the_wide_products():
    plain, twinned = _linear(twin=False), _linear()
    values, scale = twinned.twin.values.get_value(), twinned.twin.scale.get_value()
    assert values.dtype == jnp.float8_e4m3fn and values.shape == (128, 96)  # [out, in], as dense_fp8 holds it
    assert _rel(values.astype(jnp.float32).T * scale, plain.dequantize()) < 0.05
    assert twinned.backend == plain.backend  # the twinned matrix runs the kernels its NVFP4 form ran
    for rows in (1, TWIN_ROWS):  # narrow: the NVFP4 product, unchanged by the twin
        x = jax.random.normal(jax.random.key(rows), (rows, 96), jnp.float32)
        np.testing.assert_array_equal(twinned(x), plain(x))
    x = jax.random.normal(jax.random.key(7), (2, TWIN_ROWS // 2 + 1, 96), jnp.float32)
    wide = twinned(x)
    np.testing.assert_array_equal(wide, dense_fp8.matmul(x, values, scale))
    assert wide.shape == (2, TWIN_ROWS // 2 + 1, 128) and _rel(wide, plain(x)) < 0.05


def test_concatenation_keeps_the_twins_and_refuses_a_mix():
    parts = [_linear((96, 64), 1), _linear((96, 128), 2)]
    fused = Nvfp4LinearWithTwin.concatenate(parts)
    assert isinstance(fused, Nvfp4LinearWithTwin)
    np.testing.assert_array_equal(fused.twin.values.get_value(),
                                  jnp.concatenate([p.twin.values.get_value() for p in parts]))
    np.testing.assert_array_equal(fused.twin.scale.get_value(),
                                  jnp.concatenate([p.twin.scale.get_value() for p in parts]))
    with pytest.raises(ValueError, match="twins"):
        Nvfp4Linear.concatenate([parts[0], _linear((96, 64), 3, twin=False)])


def test_expert_twin_serves_wide_steps(monkeypatch):
    _, plain = moe_pair("nvfp4")
    monkeypatch.setattr(experts, "TWIN_TOKENS", 16)
    x = jax.random.normal(jax.random.key(3), (16, 64), jnp.bfloat16)
    before, ids = plain(x)  # the ragged backend (`moe_pair`)
    narrow = plain(x[:15])[0]
    moe = moe_view(plain, QuantConfig(expert_precision="nvfp4", fp8_twins=True))
    assert isinstance(moe.experts, Nvfp4RoutedExpertsWithTwin) and moe.backend == plain.backend
    assert isinstance(moe.routed_experts(15), Nvfp4Experts) and isinstance(moe.routed_experts(16), Fp8Experts)
    np.testing.assert_array_equal(moe(x[:15])[0], narrow)
    wide, wide_ids = moe(x)
    for a, b in zip(fp8_float(moe.routed_experts(16)), nvfp4_float(moe.routed_experts())):
        assert _rel(a, b) < 0.05
    np.testing.assert_array_equal(wide_ids, ids)  # routing does not involve the experts' weights
    assert _rel(wide, before) < 0.1


def _modules(model, kind) -> list:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, kind)]


def test_a_view_gives_every_nvfp4_weight_a_twin_that_decode_bytes_leave_out():
    with pytest.raises(ValueError, match="NVFP4"):
        QuantConfig("fp8", "fp8", fp8_twins=True)
    plain = serving_view(random_model(preset("tiny"), jnp.float32), QuantConfig("nvfp4", "nvfp4"))
    model = serving_view(plain, QuantConfig(fp8_twins=True, expert_precision="nvfp4"))  # twins for what is NVFP4
    moes = _modules(model, ServingMoE)
    assert moes and all(isinstance(moe.experts, Nvfp4RoutedExpertsWithTwin) for moe in moes)
    # q|k|v|r and wo per attention (trunk and MTP); the shared experts' gate|up and down
    dense = _modules(model, Nvfp4Linear)
    assert len(dense) == 2 * len(_modules(model, Attention)) + 2 * len(moes)
    assert all(isinstance(m, Nvfp4LinearWithTwin) for m in dense)
    assert decode_step_bytes(model, 4, 32) == decode_step_bytes(plain, 4, 32)
