"""fp8 twins of NVFP4 weights (`InklingModel.add_fp8_twins`): wide products take the twin and narrow ones the
NVFP4 form, untouched (bit for bit); the twin carries the NVFP4 values up to fp8's rounding; fusing keeps twins;
a model gives every NVFP4 weight one, and the decode bytes the benchmarks count leave them out. The serving steps
with twins lower for CUDA in tests/test_gpu_lowering.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.model import decode_step_bytes
from inkling_jax import Backend, preset
from inkling_jax.nn.attention import Attention
from inkling_jax.nn.moe import MoE
from inkling_jax.quant import dense_fp8
from inkling_jax.quant.dense_nvfp4 import TWIN_ROWS, Nvfp4Linear
from pallas_kernels.moe.fp8 import Fp8Experts
from pallas_kernels.moe.fp8 import dequantize_experts as fp8_float
from pallas_kernels.moe.nvfp4 import Nvfp4Experts
from pallas_kernels.moe.nvfp4 import dequantize_experts as nvfp4_float
from serve.random_weights import random_model
from tests.test_fp8_experts import _rel, moe_pair


def _linear(shape=(96, 128), seed=0, twin=True):
    linear = Nvfp4Linear.quantize(0.05 * jax.random.normal(jax.random.key(seed), shape, jnp.float32),
                                  backend=Backend(moe="ragged"))  # the jnp formula
    if twin:
        linear.add_fp8_twin()
    return linear


def test_a_dense_twin_takes_only_the_wide_products():
    plain, twinned = _linear(twin=False), _linear()
    values = twinned.twin_fp8.get_value()
    assert values.dtype == jnp.float8_e4m3fn and values.shape == (128, 96)  # [out, in], as dense_fp8 holds it
    assert _rel(values.astype(jnp.float32).T * twinned.twin_out_scale.get_value(), plain.dequantize()) < 0.05
    for rows in (1, TWIN_ROWS):  # narrow: the NVFP4 product, unchanged by the twin
        x = jax.random.normal(jax.random.key(rows), (rows, 96), jnp.float32)
        np.testing.assert_array_equal(twinned(x), plain(x))
    x = jax.random.normal(jax.random.key(7), (2, TWIN_ROWS // 2 + 1, 96), jnp.float32)
    wide = twinned(x)
    np.testing.assert_array_equal(wide, dense_fp8.matmul(x, values, twinned.twin_out_scale.get_value()))
    assert wide.shape == (2, TWIN_ROWS // 2 + 1, 128) and _rel(wide, plain(x)) < 0.05


def test_concatenation_keeps_the_twins_and_refuses_a_mix():
    parts = [_linear((96, 64), 1), _linear((96, 128), 2)]
    fused = Nvfp4Linear.concatenate(parts)
    np.testing.assert_array_equal(fused.twin_fp8.get_value(),
                                  jnp.concatenate([p.twin_fp8.get_value() for p in parts]))
    np.testing.assert_array_equal(fused.twin_out_scale.get_value(),
                                  jnp.concatenate([p.twin_out_scale.get_value() for p in parts]))
    with pytest.raises(ValueError, match="twins"):
        Nvfp4Linear.concatenate([parts[0], _linear((96, 64), 3, twin=False)])


def test_expert_twin_serves_wide_steps(monkeypatch):
    bf16, moe = moe_pair("nvfp4")
    with pytest.raises(ValueError, match="twin"):
        bf16.add_fp8_twin()
    monkeypatch.setattr("inkling_jax.nn.moe.TWIN_TOKENS", 16)
    x = jax.random.normal(jax.random.key(3), (16, 64), jnp.bfloat16)
    before, ids = moe(x)  # the ragged backend (`moe_pair`)
    narrow = moe(x[:15])[0]
    moe.add_fp8_twin()
    assert moe.has_twin and moe.precision == "nvfp4"
    assert isinstance(moe.routed_experts(15), Nvfp4Experts) and isinstance(moe.routed_experts(16), Fp8Experts)
    np.testing.assert_array_equal(moe(x[:15])[0], narrow)
    wide, wide_ids = moe(x)
    for a, b in zip(fp8_float(moe.routed_experts(16)), nvfp4_float(moe.routed_experts())):
        assert _rel(a, b) < 0.05
    np.testing.assert_array_equal(wide_ids, ids)  # routing does not involve the experts' weights
    assert _rel(wide, before) < 0.1


def test_a_model_gives_every_nvfp4_weight_a_twin_that_decode_bytes_leave_out():
    model = random_model(preset("tiny"), jnp.float32)
    with pytest.raises(ValueError, match="NVFP4"):
        model.quantize("fp8", "fp8", fp8_twins=True)
    model.quantize("nvfp4", "nvfp4")
    before = decode_step_bytes(model, 4, 32)
    moes = model._modules(MoE)
    # routed experts of each MoE; q|k|v|r and wo per attention (trunk and MTP); the shared experts' gate|up, down
    assert model.add_fp8_twins() == len(moes) + 2 * len(model._modules(Attention)) + 2 * len(moes)
    assert all(moe.has_twin for moe in moes) and all(m.has_twin for m in model._modules(Nvfp4Linear))
    assert decode_step_bytes(model, 4, 32) == before
