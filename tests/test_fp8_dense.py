"""fp8 dense MLPs and LM head (`InklingModel.quantize_dense`, inkling_jax/quant/dense_fp8.py): the W8A8 product is its
formula, the bf16 weights are replaced and freed, the logits stay within fp8's error, and the sharded, loaded
and served forms equal the one-device model (the sharded and served ones also with NVFP4 dense weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, preset, with_backend
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.quant import dense_fp8
from pallas_kernels.moe.fp8 import quantize_rows
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from tests.greedy import greedy_tokens

TOKENS = jnp.asarray([[5, 17, 3, 99, 42, 7, 7, 1]])
REFERENCE = Backend.parse("reference")  # the MoE and the NVFP4 products by XLA's ragged_dot and formula


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_the_product_is_its_formula_and_stays_close_to_bf16():
    x = jax.random.normal(jax.random.key(0), (2, 3, 96), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (96, 40), jnp.bfloat16).at[:, 7].set(0)  # [in, out], a zero column
    values, scale = dense_fp8.quantize(w, transpose=True)
    assert values.shape == (40, 96) and values.dtype == jnp.float8_e4m3fn and scale.shape == (40,)
    assert scale[7] == 1.0
    got = dense_fp8.matmul(x, values, scale)
    assert got.shape == (2, 3, 40) and got.dtype == jnp.bfloat16
    qx, sx = quantize_rows(x.reshape(6, 96))
    formula = (qx.astype(jnp.float32) * sx[:, None]) @ (values.astype(jnp.float32) * scale[:, None]).T
    np.testing.assert_allclose(np.asarray(got, np.float32).reshape(6, 40), formula, rtol=2e-2, atol=1e-2)
    assert not np.asarray(got[..., 7]).any()
    want = x.astype(jnp.float32) @ w.astype(jnp.float32)
    assert 1e-3 < _rel(got, want) < 0.06  # e4m3's 3 mantissa bits on both operands


def test_quantised_model_drops_its_dense_weights_and_its_logits_stay_close():
    config = preset("tiny")
    model = with_backend(random_model(config, jnp.bfloat16), Backend(moe="ragged"))
    forward = nnx.jit(lambda model, tokens: model(tokens))  # compiled: op by op is slow on CPU
    want = forward(model, TOKENS)
    changed = model.quantize_dense()
    got = forward(model, TOKENS)
    assert changed == 3 * len(config.text.dense_layer_ids) + 1  # gate, up, down per dense layer; the LM head
    assert model.quantize_dense() == 0  # already done
    dense = [layer.mlp for layer in model.layers if isinstance(layer.mlp, DenseMLP)]
    assert dense and all(m.fp8 and not hasattr(m, "w_gate") for m in dense)
    assert not hasattr(model, "unembed") and model.unembed_fp8.get_value().shape == (config.text.vocab_size, 64)
    assert model.layers[0].attn.wq.kernel.get_value().dtype == jnp.bfloat16  # projections stay
    assert got.shape == want.shape
    assert 1e-4 < _rel(got, want) < 0.1


@pytest.mark.parametrize("dense_precision", ["fp8", "nvfp4"])
def test_engine_on_fp8_weights_decodes_the_quantised_models_greedy_tokens(dense_precision):
    """The serving path (paged cache, prefill then decode steps) gives the tokens that the quantised model's own
    full-sequence forward picks greedily. (fp8 experts with bf16 dense weights are served in
    tests/test_fp8_experts.py's mesh test.)"""
    config = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
    model = with_backend(random_model(config, jnp.float32, seed=1), REFERENCE)
    model.quantize("fp8", dense_precision)
    assert model.layers[1].mlp.fp8 and model.layers[0].mlp.fp8 == (dense_precision != "bf16")
    prompt = [3, 14, 15, 92, 65, 35]
    want = greedy_tokens(model, prompt, 6)
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=32, page_size=8,
                                        chunk_buckets=(1, 16), row_buckets=(2,), num_pages=8, decode_steps=2),
                    eos_token_id=config.eos_token_id)
    engine.start()
    try:
        got = generate(engine, [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6))[0]
    finally:
        engine.shutdown(drain_seconds=0)
    assert got.token_ids == want


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("precision, spec", [("fp8", "tensor=2"), ("fp8", "fsdp=2,tensor=2,expert=2"),
                                             ("nvfp4", "fsdp=2,expert=2")])
def test_quantised_model_on_a_mesh_equals_one_device(precision, spec, monkeypatch):
    """The fp8 values and their scales shard by the table (the dense width and the vocabulary over `tensor`),
    and the per-row activation scales span the whole row, so the sharded logits equal one device's. NVFP4's
    fused matrices (inkling_jax/quant/dense_nvfp4.py) stay whole on every device; its case runs with fp8 twins,
    which every product here takes (the thresholds lowered), the experts' split over `expert`."""
    from inkling_jax.nn import moe
    from inkling_jax.parallel.mesh import make_mesh
    from inkling_jax.parallel.placement import shard_model
    from inkling_jax.quant import dense_nvfp4

    monkeypatch.setattr(moe, "TWIN_TOKENS", 1)
    monkeypatch.setattr(dense_nvfp4, "TWIN_ROWS", 1)

    def quantised():
        model = with_backend(random_model(preset("tiny"), jnp.float32, seed=2), REFERENCE)
        model.quantize(precision, precision, fp8_twins=precision == "nvfp4")
        return model

    want = nnx.jit(lambda m, t: m(t))(quantised(), TOKENS)
    model = shard_model(quantised(), make_mesh(spec))
    if precision == "fp8":
        assert model.layers[0].mlp.w_gate_fp8.get_value().sharding.spec[0] == "tensor"  # [width, hidden]
        assert model.unembed_fp8.get_value().sharding.spec[0] == "tensor"  # [vocab, hidden]
    else:
        assert model.layers[0].attn.wqkvr_nvfp4.nvfp4_codes.get_value().sharding.is_fully_replicated
        assert model.layers[0].attn.wqkvr_nvfp4.twin_fp8.get_value().sharding.is_fully_replicated
        assert model.layers[1].mlp.w_gate_fp8.get_value().sharding.spec[0] == "expert"  # the experts' twin
    got = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_loading_with_quantised_dense_weights_equals_quantising_after(checkpoints, precision):
    from inkling_jax import load_pretrained

    path, _ = checkpoints("base")
    direct = load_pretrained(path, progress=False, dense_precision=precision)
    after = load_pretrained(path, progress=False)
    after.quantize_dense(precision)
    assert direct.unembed_fp8.get_value().dtype == jnp.float8_e4m3fn
    for a, b in zip(jax.tree.leaves(nnx.state(direct, nnx.Param)), jax.tree.leaves(nnx.state(after, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="dense_precision must be one of"):
        load_pretrained(path, progress=False, dense_precision="int4")
