"""fp8 routed experts (`QuantConfig(expert_precision="fp8")`: a `ServingMoE` holding `Fp8RoutedExperts`): the view
holds them in place of the bf16 ones, routing is unchanged, the outputs stay within fp8's error of the original
model, and the Pallas kernels (portable, interpret mode on CPU) agree with the jnp formula. The layer and logits
tests cover NVFP4 experts too (tests/quant/test_nvfp4_experts.py has the rest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import Backend, preset, with_backend
from inkling_jax.nn.moe import MoE
from inkling_jax.quant import QuantConfig, serving_view
from inkling_jax.quant.experts import Fp8RoutedExperts
from inkling_jax.quant.moe import ServingMoE
from inkling_jax.quant.view import moe_view
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from tests.greedy import greedy_tokens

RAGGED, PALLAS = Backend(moe="ragged"), Backend(moe="pallas")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def moe_pair(precision="fp8"):
    """The tiny preset's MoE layer as built (the ragged backend: quantised experts by their jnp formula), and its
    view with the routed experts quantised, which keeps that backend."""
    bf16 = MoE(preset("tiny").text, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), backend=RAGGED)
    return bf16, moe_view(bf16, QuantConfig(expert_precision=precision))


# the relative error that each format's weights give the routed part on random weights (NVFP4: ~0.17)
WITHIN = {"fp8": 0.1, "nvfp4": 0.25}


def test_quantised_layer_holds_fp8_experts_in_place_of_its_bf16_ones():
    _, fp8 = moe_pair()
    assert isinstance(fp8, ServingMoE) and isinstance(fp8.experts, Fp8RoutedExperts) and not hasattr(fp8, "w_gate")
    experts = fp8.routed_experts()
    assert experts.gate.dtype == jnp.float8_e4m3fn and experts.gate_scale.dtype == jnp.float32
    assert experts.gate.shape == (8, 128, 64)  # [experts, width padded to 128, hidden]: K-minor
    assert fp8.shared.shared_gate.dtype == jnp.bfloat16  # the shared experts are not quantised


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
@pytest.mark.parametrize("tokens", [6, 80])  # decode slabs; row blocks (NVFP4: slabs of several sizes)
def test_quantised_layer_stays_close_and_routes_the_same(tokens, precision):
    bf16, quantised = moe_pair(precision)
    x = jax.random.normal(jax.random.key(tokens), (tokens, 64), jnp.bfloat16)
    call = nnx.jit(lambda m, x: m(x))
    want, want_ids = call(bf16, x)
    formula, ids = call(quantised, x)
    np.testing.assert_array_equal(ids, want_ids)
    assert _rel(formula, want) < WITHIN[precision]
    kernel, kernel_ids = call(with_backend(quantised, PALLAS), x)
    np.testing.assert_array_equal(kernel_ids, want_ids)
    assert _rel(kernel, formula) < 1e-2


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantised_model_logits_stay_close(precision):
    config = preset("tiny")
    model = random_model(config, jnp.bfloat16, backend=RAGGED)
    view = serving_view(model, QuantConfig(expert_precision=precision), fuse=False)
    tokens = jnp.asarray([[5, 17, 3, 99, 42, 7, 7, 1]])
    forward = nnx.jit(lambda model, tokens: model(tokens))
    want, got = forward(model, tokens), forward(view, tokens)
    served = [layer.mlp for layer in view.layers if isinstance(layer.mlp, ServingMoE)]
    assert len(served) == sum(not config.text.is_dense(i) for i in range(config.text.num_layers)) > 0
    assert all(moe.backend == RAGGED for moe in served)
    assert 1e-4 < _rel(got, want) < WITHIN[precision]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("spec,tokens,backend,precision", [
    ("tensor=2", 14, "ragged", "fp8"),
    ("tensor=2", 80, "pallas", "fp8"),
    ("expert=4", 80, "ragged", "fp8"),
    ("tensor=2,expert=4", 14, "pallas", "fp8"),
    ("fsdp=4,tensor=2", 80, "pallas", "fp8"),
    # the W4 kernels run in Mosaic GPU's interpreter on CPU, which hung under 8 simulated devices: their jnp
    # formula checks the NVFP4 layouts' split
    ("tensor=2", 14, "ragged", "nvfp4"),
    ("tensor=2,expert=4", 80, "ragged", "nvfp4"),
])
def test_quantised_layer_on_a_mesh_equals_one_device(spec, tokens, backend, precision):
    """Expert parallel and width-split quantised experts give the single-device layer's output: fp8's h is
    quantised with its whole row's scale on every width shard; NVFP4's width splits in groups of 64 columns."""
    from inkling_jax.parallel.mesh import make_mesh
    from inkling_jax.parallel.placement import shard_model

    quantised = moe_view(MoE(preset("tiny").text, dtype=jnp.float32, rngs=nnx.Rngs(3), backend=Backend(moe=backend)),
                         QuantConfig(expert_precision=precision))
    x = jax.random.normal(jax.random.key(tokens), (tokens, 64), jnp.float32)
    want, want_ids = nnx.jit(lambda m, x: m(x))(quantised, x)
    moe = shard_model(quantised, make_mesh(spec))
    first = moe.experts.w_gate_fp8 if precision == "fp8" else moe.experts.w13_nvfp4
    placed = first.get_value().sharding.spec  # [experts, width, hidden]
    assert tuple(placed[:2]) == ("expert" if "expert" in spec else None, "tensor" if "tensor" in spec else None)
    got, ids = nnx.jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_array_equal(ids, want_ids)
    # NVFP4 rounds h to f16: a last-bit difference of another summation order can move one h by an f16 ulp
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 if precision == "fp8" else 1e-4)


def test_loading_with_fp8_experts_quantises_each_layer_as_it_arrives(checkpoints):
    """load_pretrained(quant=QuantConfig(expert_precision="fp8")) from a hub directory gives the same fp8 experts
    and logits as loading in full precision and quantising after."""
    from inkling_jax import load_pretrained

    path, _ = checkpoints("base")
    fp8 = QuantConfig(expert_precision="fp8")
    direct = load_pretrained(path, progress=False, quant=fp8, backend=RAGGED)
    after = serving_view(load_pretrained(path, progress=False, backend=RAGGED), fp8, fuse=False)
    moes = [layer.mlp for layer in direct.layers if isinstance(layer.mlp, MoE)]
    assert moes and all(isinstance(m.experts, Fp8RoutedExperts) for m in moes)
    assert nnx.graphdef(direct) == nnx.graphdef(after)
    for a, b in zip(jax.tree.leaves(nnx.state(direct, nnx.Param)), jax.tree.leaves(nnx.state(after, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    tokens = jnp.asarray([[1, 5, 9, 2, 7]])
    forward = nnx.jit(lambda model, tokens: model(tokens))  # one compiled program for both
    np.testing.assert_array_equal(forward(direct, tokens), forward(after, tokens))
    with pytest.raises(ValueError, match="expert_precision"):
        QuantConfig(expert_precision="int4")


def test_an_nvfp4_checkpoint_loads_into_fp8_experts(checkpoints, tmp_path):
    """The NVFP4 repo's packed experts are dequantised as they are read, then quantised to fp8 like any others."""
    from inkling_jax import load_pretrained
    from inkling_jax.checkpoint import nvfp4

    source = tmp_path / "nvfp4"
    assert nvfp4.quantize_checkpoint(checkpoints("base")[0], str(source))
    fp8 = QuantConfig(expert_precision="fp8")
    direct = load_pretrained(source, progress=False, quant=fp8)
    after = serving_view(load_pretrained(source, progress=False), fp8, fuse=False)
    for a, b in zip(jax.tree.leaves(nnx.state(direct, nnx.Param)), jax.tree.leaves(nnx.state(after, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_server_loads_a_checkpoint_onto_its_mesh_with_fp8_experts(checkpoints, tmp_path):
    """`python -m serve.app --model DIR --mesh tensor=2,expert=4 --expert-precision fp8`, short of HTTP: the
    weights load straight into their shards, the routed experts are fp8 and sharded, the tokenizer.json of the
    directory is used, and the engine serves the one-device fp8 model's greedy tokens."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    from inkling_jax import load_pretrained
    from serve.app import build_service, parse_args

    source, _ = checkpoints("base")
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    words = ["a", "b", "c", "d", "e", "f", "g", "h"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))

    service = build_service(parse_args([
        "--model", str(directory), "--mesh", "tensor=2,expert=4", "--expert-precision", "fp8", "--max-num-seqs",
        "2", "--max-model-len", "32", "--max-num-batched-tokens", "48", "--backend", "moe=ragged"]))
    try:
        moe = next(layer.mlp for layer in service.engine.runner.model.layers if isinstance(layer.mlp, MoE))
        assert moe.backend == RAGGED
        assert moe.experts.w_gate_fp8.get_value().sharding.spec[:2] == ("expert", "tensor")
        prompt = service.tokenizer.encode("b c d e")
        assert prompt == [1, 2, 3, 4]
        got = generate(service.engine, [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4))[0]
    finally:
        service.engine.shutdown(drain_seconds=0)
    model = load_pretrained(directory, progress=False, quant=QuantConfig(expert_precision="fp8"), backend=RAGGED)
    want = greedy_tokens(model, prompt, 4)
    assert got.token_ids == want


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_training_refuses_a_model_with_quantised_experts(precision):
    from train.state import model_params

    config = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
    model = serving_view(random_model(config, jnp.float32), QuantConfig(expert_precision=precision), fuse=False)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp: a ServingMoE, a serving form .* does not train"):
        model_params(model)


def test_a_converted_checkpoint_restores_into_fp8_experts_layer_by_layer(checkpoints, tmp_path):
    """An orbax checkpoint from the converter restores the rest first, then one MoE layer's experts at a time,
    each quantised before the next is read: the same fp8 model as loading the hub directory."""
    from inkling_jax import load_pretrained
    from inkling_jax.checkpoint import orbax_io
    from inkling_jax.checkpoint.convert import main as convert

    source, _ = checkpoints("base")
    assert convert(["--src", source, "--dst", str(tmp_path / "orbax"), "--quiet"]) == 0
    restores = []
    original = orbax_io.restore_params

    def counting(directory, specs, shardings, partial=False):
        restores.append(sorted(str(p[-1]) for p in specs) if partial and len(specs) <= 3 else "rest")
        return original(directory, specs, shardings, partial)

    orbax_io.restore_params = counting
    try:
        restored = load_pretrained(tmp_path / "orbax", progress=False, quant=QuantConfig(expert_precision="fp8"))
    finally:
        orbax_io.restore_params = original
    moe_layers = sum(isinstance(layer.mlp, MoE) for layer in restored.layers)
    assert restores == ["rest"] + [["w_down", "w_gate", "w_up"]] * moe_layers
    hub = load_pretrained(source, progress=False, quant=QuantConfig(expert_precision="fp8"))
    for a, b in zip(jax.tree.leaves(nnx.state(restored, nnx.Param)), jax.tree.leaves(nnx.state(hub, nnx.Param))):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
