"""The serving model's fused projections (`serving_view(..., fuse=True)`): one q|k|v|r kernel per attention, one
gate|up matrix per dense MLP (bf16 or fp8), the shared experts of each MoE as one widened MLP. The fused view holds
the fused matrices and none of the originals, and gives the unfused model's logits (prefill, decode steps, decode
steps through the Pallas prologue; the MoE by each backend; on expert-parallel meshes); the server fuses by
default, unless told not to or on a tensor-parallel mesh (the serving tests then run the fused model), and leaves
the model it is given as it was."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from inkling_jax import Backend, preset, with_backend
from inkling_jax.generate import StepFunctions
from inkling_jax.nn.attention import Attention
from inkling_jax.nn.mlp import DenseMLP
from inkling_jax.nn.moe import MoE
from inkling_jax.parallel.rules import logical_axes
from inkling_jax.quant import serving_view
from inkling_jax.quant.attention import PROJECTIONS, FusedAttention
from inkling_jax.quant.mlp import FusedMLP
from inkling_jax.quant.moe import ServingMoE, WidenedSharedExperts
from inkling_jax.quant.view import dense_mlp_view, moe_view
from serve.engine.config import EngineConfig
from serve.random_weights import random_model
from serve.runner.model_runner import ModelRunner
from serve.runner.placement import Placement
from tests.backends import REFERENCE
from tests.hf_oracle import relative_error

CONFIG = preset("tiny")  # sliding and full layers (2 and 1 KV heads), MTP blocks
# One sliding and one full layer; a window of 16, the smallest the GPU kernels take (this file also runs there).
SMALL = CONFIG.replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), sliding_window=16, rel_extent=24)
PROMPT = 18  # past the window: the decode steps read a wrapped ring
TOL = 1e-5  # fp32 at full matmul precision: a wrong column order would be off by O(1)


def nodes_of(model, kind) -> list:
    """The model's modules of `kind`."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, kind)]


def attentions(model) -> list[Attention]:
    return nodes_of(model, Attention)


def fused_model(config, seed, backend=REFERENCE):
    return serving_view(random_model(config, seed=seed, backend=backend), fuse=True)


def test_fused_kernel_is_the_four_concatenated_and_replaces_them():
    plain, fused = random_model(CONFIG, seed=0), fused_model(CONFIG, seed=0)
    assert len(attentions(fused)) == CONFIG.text.num_layers + CONFIG.mtp.num_layers
    for a, b in zip(attentions(plain), attentions(fused)):
        expected = np.concatenate([np.asarray(getattr(a, name).kernel[...]) for name in PROJECTIONS], axis=1)
        assert isinstance(b, FusedAttention)
        np.testing.assert_array_equal(np.asarray(b.wqkvr.kernel[...]), expected)
    paths = [path for path, node in nnx.iter_graph(fused) if isinstance(node, nnx.Param)]
    assert not [p for p in paths if set(PROJECTIONS) & set(map(str, p))]
    fused_paths = [p for p in paths if p[-2:] == ("wqkvr", "kernel")]
    assert len(fused_paths) == len(attentions(fused))
    assert all(logical_axes(p, 2) == ("embed", None) for p in fused_paths)


def test_fused_mlps_hold_gate_then_up_and_widened_shared_experts_replace_the_stacks():
    plain, fused = random_model(CONFIG, seed=0), fused_model(CONFIG, seed=0)
    dense_pairs = list(zip(nodes_of(plain, DenseMLP), nodes_of(fused, DenseMLP)))
    assert len(dense_pairs) == len(CONFIG.text.dense_layer_ids) + CONFIG.mtp.num_layers
    for a, b in dense_pairs:
        expected = np.concatenate([np.asarray(a.w_gate[...]), np.asarray(a.w_up[...])], axis=1)
        assert isinstance(b, FusedMLP)
        np.testing.assert_array_equal(np.asarray(b.w_gate_up.kernel[...]), expected)
    moes = list(zip(nodes_of(plain, MoE), nodes_of(fused, MoE)))
    assert moes
    for a, b in moes:
        assert isinstance(b, ServingMoE) and isinstance(b.shared, WidenedSharedExperts)
        s, h, i = a.shared_gate.shape
        gate_up = np.asarray(b.shared.w_gate_up.kernel[...])
        for k in range(s):  # unit k of the width is shared expert k
            np.testing.assert_array_equal(gate_up[:, k * i:(k + 1) * i], np.asarray(a.shared_gate[...][k]))
            np.testing.assert_array_equal(gate_up[:, (s + k) * i:(s + k + 1) * i], np.asarray(a.shared_up[...][k]))
        np.testing.assert_array_equal(np.asarray(b.shared.w_down.kernel[...]),
                                      np.asarray(a.shared_down[...]).reshape(s * i, h))
    paths = [path for path, node in nnx.iter_graph(fused)
             if isinstance(node, nnx.Param) and path[-2:] == ("w_gate_up", "kernel")]
    assert len(paths) == len(dense_pairs) + len(moes) and all(logical_axes(p, 2) == ("embed", None) for p in paths)


@pytest.mark.parametrize("moe", ["dense", "ragged", "pallas"])
def test_widened_shared_experts_give_the_stacked_ones_output(moe):
    model = random_model(CONFIG, seed=2, backend=Backend.parse(f"reference,moe={moe}"))
    plain = nodes_of(model, MoE)[0]
    x = jax.random.normal(jax.random.key(3), (2, 5, CONFIG.text.hidden_size))
    want, want_ids = plain(x)
    widened = moe_view(plain, fuse=True)
    assert widened.backend == plain.backend
    got, got_ids = widened(x)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    assert relative_error(got, want) < TOL


def test_fused_fp8_dense_mlp_gives_the_unfused_one_output():
    split = dense_mlp_view(nodes_of(random_model(CONFIG, seed=4), DenseMLP)[0], fp8=True)
    x = jax.random.normal(jax.random.key(5), (3, CONFIG.text.hidden_size))
    want, _ = split(x)
    fused = dense_mlp_view(split, fp8=True, fuse=True)
    assert isinstance(fused, FusedMLP)
    assert fused.w_gate_up.values[...].shape == (2 * CONFIG.text.dense_intermediate_size, CONFIG.text.hidden_size)
    got, _ = fused(x)
    assert relative_error(got, want) < TOL  # the same fp8 values and scales, one product instead of two


@pytest.mark.parametrize("spec", ["expert=2", "fsdp=2,expert=2"])
def test_fused_model_on_an_expert_parallel_mesh_equals_one_device(spec):
    """The widened shared experts run beside the expert-parallel dispatch (which then carries no shared stacks)."""
    from inkling_jax.parallel.mesh import make_mesh
    from inkling_jax.parallel.placement import shard_model

    if jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    ids = np.random.default_rng(6).integers(0, 380, (2, 8)).astype(np.int32)
    ragged = Backend.parse("reference")
    want = nnx.jit(lambda m, t: m(t))(fused_model(SMALL, seed=3, backend=ragged), ids)
    sharded = shard_model(fused_model(SMALL, seed=3, backend=ragged), make_mesh(spec, jax.devices()[:4]))
    got = nnx.jit(lambda m, t: m(t))(sharded, ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def cached_logits(model, prefill: StepFunctions, decode: StepFunctions, ids):
    """Logits of a prefill of PROMPT tokens, then of one decode step per further token."""
    logits, cache = prefill.extend(ids[:, :PROMPT], model.init_cache(ids.shape[0], ids.shape[1]))
    chunks = [logits]
    for t in range(PROMPT, ids.shape[1]):
        logits, cache = decode.extend(ids[:, t:t + 1], cache)
        chunks.append(logits)
    return np.concatenate(chunks, axis=1)


def test_fused_model_gives_the_unfused_logits():
    ids = np.random.default_rng(1).integers(0, 380, (2, PROMPT + 4)).astype(np.int32)
    plain, fused = random_model(SMALL, seed=0, backend=REFERENCE), fused_model(SMALL, seed=0)
    plain_steps, fused_steps = StepFunctions(plain), StepFunctions(fused)
    expected = cached_logits(plain, plain_steps, plain_steps, ids)
    assert relative_error(cached_logits(fused, fused_steps, fused_steps, ids), expected) < TOL
    # decode steps through the fused prologue kernel (interpreted on CPU)
    pallas_steps = StepFunctions(with_backend(fused, Backend.parse("pallas,moe=dense")))
    assert relative_error(cached_logits(fused, fused_steps, pallas_steps, ids), expected) < TOL


@pytest.mark.parametrize("flag, mesh, fused", [(True, None, True), (False, None, False),
                                               (True, "fsdp=2,expert=2", True), (True, "tensor=2", False)])
def test_server_fuses_unless_off_or_tensor_parallel(flag, mesh, fused):
    if mesh and jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    config = EngineConfig(max_num_seqs=2, max_model_len=32, page_size=8, fuse_projections=flag)
    model = random_model(SMALL, seed=0)
    graph = nnx.graphdef(model)
    runner = ModelRunner(model, config, Placement.from_spec(mesh))
    assert nnx.graphdef(model) == graph  # the model given is left as it was (tests/quant/test_serving_view.py)
    assert all(isinstance(attention, FusedAttention) == fused for attention in attentions(runner.model))
    dense = [isinstance(mlp, FusedMLP) for mlp in nodes_of(runner.model, DenseMLP)]
    assert dense and all(f == fused for f in dense)
    assert [isinstance(moe, ServingMoE) for moe in nodes_of(runner.model, MoE)] == [fused]
    if fused and mesh:  # rows over fsdp, columns whole on every device
        spec = runner.model.layers[0].attn.wqkvr.kernel[...].sharding.spec
        assert tuple(spec) == tuple(PartitionSpec("fsdp", None))

