"""fp8 routed experts in the model (`InklingModel.quantize_routed_experts`): the bf16 weights are replaced and
freed, routing is unchanged, the outputs stay within fp8's error of the original model, and the Pallas kernels
(portable, interpret mode on CPU) agree with the jnp formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import kernels, preset
from inkling_jax.mlp import MoE
from serve.config import EngineConfig
from serve.engine import Engine
from serve.offline import generate
from serve.random_weights import random_model
from serve.sampling import SamplingParams


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _moe_pair():
    bf16 = MoE(preset("tiny").text, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    fp8 = MoE(preset("tiny").text, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    fp8.quantize_routed_experts()
    return bf16, fp8


def test_quantised_layer_drops_its_bf16_experts():
    _, fp8 = _moe_pair()
    assert fp8.fp8 and not hasattr(fp8, "w_gate")
    experts = fp8.routed_experts()
    assert experts.gate.dtype == jnp.float8_e4m3fn and experts.gate_scale.dtype == jnp.float32
    assert experts.gate.shape == (8, 128, 64)  # [experts, width padded to 128, hidden]: K-minor
    assert fp8.shared_gate.dtype == jnp.bfloat16  # the shared experts are not quantised


@pytest.mark.parametrize("tokens", [6, 80])  # decode slabs; row blocks
def test_quantised_layer_stays_close_and_routes_the_same(tokens):
    bf16, fp8 = _moe_pair()
    x = jax.random.normal(jax.random.key(tokens), (tokens, 64), jnp.bfloat16)
    with kernels.use(moe="ragged"):
        want, want_ids = bf16(x)
        formula, ids = fp8(x)
    np.testing.assert_array_equal(ids, want_ids)
    assert _rel(formula, want) < 0.1
    with kernels.use(moe="pallas"):
        kernel, kernel_ids = nnx.jit(lambda m, x: m(x))(fp8, x)
    np.testing.assert_array_equal(kernel_ids, want_ids)
    assert _rel(kernel, formula) < 1e-2


def test_quantised_model_logits_stay_close():
    config = preset("tiny")
    model = random_model(config, jnp.bfloat16)
    tokens = jnp.asarray([[5, 17, 3, 99, 42, 7, 7, 1]])
    with kernels.use(moe="ragged"):
        want = model(tokens)
        changed = model.quantize_routed_experts()
        got = model(tokens)
    assert changed == sum(not config.text.is_dense(i) for i in range(config.text.num_layers)) > 0
    assert model.quantize_routed_experts() == 0  # already done
    assert 1e-4 < _rel(got, want) < 0.1


def test_engine_with_quantised_experts_decodes_the_quantised_models_greedy_tokens():
    """The serving path (paged cache, prefill then decode steps) on fp8 experts gives the tokens that the model's
    own full-sequence forward picks greedily."""
    config = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
    model = random_model(config, jnp.float32, seed=1)
    assert model.quantize_routed_experts() == 1
    prompt = [3, 14, 15, 92, 65, 35]
    with kernels.use("jnp", moe="ragged"):
        want = list(prompt)
        for _ in range(6):
            want.append(int(jnp.argmax(model(jnp.asarray([want]))[0, -1])))
        engine = Engine(model, EngineConfig(max_num_seqs=1, max_model_len=32, max_num_batched_tokens=32, page_size=8,
                                            chunk_buckets=(1, 16), row_buckets=(2,), num_pages=8, decode_steps=2),
                        eos_token_id=config.eos_token_id)
        engine.start()
    try:
        got = generate(engine, [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6))[0]
    finally:
        engine.shutdown(drain_seconds=0)
    assert got.token_ids == want[len(prompt):]


def test_server_refuses_fp8_experts_on_a_mesh_before_loading():
    from serve.app import build_service, parse_args
    from serve.placement import MeshError

    with pytest.raises(MeshError, match="one device"):
        build_service(parse_args(["--mesh", "tensor=1", "--expert-precision", "fp8"]))
