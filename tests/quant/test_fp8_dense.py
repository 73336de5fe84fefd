"""fp8 dense MLPs and LM head (`QuantConfig(dense_precision="fp8")`, inkling_jax/quant/dense_fp8.py): the W8A8
product is its formula, the view holds fp8 matrices in place of the bf16 ones, the logits stay within fp8's error,
and the sharded, loaded and served forms equal the one-device model (the sharded and served ones also with NVFP4
dense weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, preset
from inkling_jax.nn.attention import Attention
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.quant import QuantConfig, dense_fp8, serving_view
from inkling_jax.quant.attention import FusedAttention
from inkling_jax.quant.dense_fp8 import Fp8Linear
from inkling_jax.quant.experts import Fp8RoutedExperts
from inkling_jax.quant.head import Fp8HeadModel
from inkling_jax.quant.mlp import SplitMLP
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


def test_quantised_view_holds_fp8_dense_weights_and_its_logits_stay_close():
    config = preset("tiny")
    model = random_model(config, jnp.bfloat16, backend=Backend(moe="ragged"))
    fp8 = QuantConfig(dense_precision="fp8")
    view = serving_view(model, fp8, fuse=False)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # compiled: op by op is slow on CPU
    want, got = forward(model, TOKENS), forward(view, TOKENS)
    dense = [layer.mlp for layer in view.layers if isinstance(layer.mlp, DenseMLP)]
    assert len(dense) == len(config.text.dense_layer_ids)
    assert all(isinstance(m, SplitMLP) and isinstance(m.w_gate, Fp8Linear) for m in dense)
    assert isinstance(view, Fp8HeadModel) and not hasattr(view, "unembed")
    assert view.head.values.get_value().shape == (config.text.vocab_size, 64)
    assert type(view.layers[0].attn) is Attention and view.layers[0].attn.wq.kernel.get_value().dtype == jnp.bfloat16
    again = serving_view(view, fp8, fuse=False)  # already in that form: the same weights
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, nnx.state(again), nnx.state(view)))
    assert got.shape == want.shape
    assert 1e-4 < _rel(got, want) < 0.1


@pytest.mark.parametrize("dense_precision", ["fp8", "nvfp4"])
def test_engine_on_fp8_weights_decodes_the_quantised_models_greedy_tokens(dense_precision):
    """The serving path (paged cache, prefill then decode steps) gives the tokens that the quantised model's own
    full-sequence forward picks greedily. (fp8 experts with bf16 dense weights are served in
    tests/quant/test_fp8_experts.py's mesh test.)"""
    config = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
    model = serving_view(random_model(config, jnp.float32, seed=1, backend=REFERENCE),
                         QuantConfig("fp8", dense_precision), fuse=False)
    assert isinstance(model.layers[1].mlp.experts, Fp8RoutedExperts)
    assert isinstance(model.layers[0].mlp.w_gate_up if dense_precision == "nvfp4" else model.layers[0].mlp.w_gate,
                      Fp8Linear)
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
    from inkling_jax.parallel.mesh import make_mesh
    from inkling_jax.parallel.placement import shard_model
    from inkling_jax.quant import dense_nvfp4, experts

    monkeypatch.setattr(experts, "TWIN_TOKENS", 1)
    monkeypatch.setattr(dense_nvfp4, "TWIN_ROWS", 1)
    quantised = serving_view(random_model(preset("tiny"), jnp.float32, seed=2, backend=REFERENCE),
                             QuantConfig(precision, precision, fp8_twins=precision == "nvfp4"), fuse=False)
    want = nnx.jit(lambda m, t: m(t))(quantised, TOKENS)
    model = shard_model(quantised, make_mesh(spec))
    if precision == "fp8":
        assert model.layers[0].mlp.w_gate.values.get_value().sharding.spec[0] == "tensor"  # [width, hidden]
        assert model.head.values.get_value().sharding.spec[0] == "tensor"  # [vocab, hidden]
    else:
        assert isinstance(model.layers[0].attn, FusedAttention)
        assert model.layers[0].attn.wqkvr.nvfp4_codes.get_value().sharding.is_fully_replicated
        assert model.layers[0].attn.wqkvr.twin.values.get_value().sharding.is_fully_replicated
        twin = model.layers[1].mlp.experts.twin.w_gate_fp8  # the experts' twin
        assert twin.get_value().sharding.spec[0] == "expert"
    got = nnx.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_loading_with_quantised_dense_weights_equals_quantising_after(checkpoints, precision):
    from inkling_jax import load_pretrained

    path, _ = checkpoints("base")
    quant = QuantConfig(dense_precision=precision)
    direct = load_pretrained(path, progress=False, quant=quant)
    after = serving_view(load_pretrained(path, progress=False), quant, fuse=False)
    assert direct.head.values.get_value().dtype == jnp.float8_e4m3fn
    assert nnx.graphdef(direct) == nnx.graphdef(after)
    for a, b in zip(jax.tree.leaves(nnx.state(direct, nnx.Param)), jax.tree.leaves(nnx.state(after, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="dense_precision must be one of"):
        QuantConfig(dense_precision="int4")
