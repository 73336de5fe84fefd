"""The serving model's fused attention projections (one q|k|v|r kernel per attention): the fused model holds the
concatenated kernels and none of the four and gives the unfused model's logits (prefill, decode steps, decode
steps through the Pallas prologue); the server fuses by default, unless told not to or on a tensor-parallel
mesh (the serving tests then run the fused model)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from inkling_jax import kernels, preset
from inkling_jax.attention import Attention
from inkling_jax.generate import StepFunctions
from inkling_jax.sharding import logical_axes
from serve.config import EngineConfig
from serve.model_runner import ModelRunner
from serve.placement import Placement
from serve.random_weights import random_model
from tests.hf_oracle import relative_error

CONFIG = preset("tiny")  # sliding and full layers (2 and 1 KV heads), MTP blocks
# One sliding and one full layer; a window of 16, the smallest the GPU kernels take (this file also runs there).
SMALL = CONFIG.replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,), sliding_window=16, rel_extent=24)
PROMPT = 18  # past the window: the decode steps read a wrapped ring
PROJECTIONS = ("wq", "wk", "wv", "wr")
TOL = 1e-5  # fp32 at full matmul precision: a wrong column order would be off by O(1)


def attentions(model) -> list[Attention]:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, Attention)]


def fused_model(config, seed):
    model = random_model(config, seed=seed)
    model.fuse_projections()
    return model


def test_fused_kernel_is_the_four_concatenated_and_replaces_them():
    plain, fused = random_model(CONFIG, seed=0), fused_model(CONFIG, seed=0)
    assert len(attentions(fused)) == CONFIG.text.num_layers + CONFIG.mtp.num_layers
    for a, b in zip(attentions(plain), attentions(fused)):
        expected = np.concatenate([np.asarray(getattr(a, name).kernel[...]) for name in PROJECTIONS], axis=1)
        np.testing.assert_array_equal(np.asarray(b.wqkvr[...]), expected)
    paths = [path for path, node in nnx.iter_graph(fused) if isinstance(node, nnx.Param)]
    assert not [p for p in paths if set(PROJECTIONS) & set(map(str, p))]
    fused_paths = [p for p in paths if p[-1] == "wqkvr"]
    assert len(fused_paths) == len(attentions(fused))
    assert all(logical_axes(p, 2) == ("embed", None) for p in fused_paths)


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
    plain, fused = random_model(SMALL, seed=0), fused_model(SMALL, seed=0)
    with kernels.use("jnp", moe="dense"):
        plain_steps, fused_steps = StepFunctions(plain), StepFunctions(fused)
        expected = cached_logits(plain, plain_steps, plain_steps, ids)
        assert relative_error(cached_logits(fused, fused_steps, fused_steps, ids), expected) < TOL
        with kernels.use("pallas"):  # decode steps through the fused prologue kernel (interpreted on CPU)
            assert relative_error(cached_logits(fused, fused_steps, StepFunctions(fused), ids), expected) < TOL


@pytest.mark.parametrize("flag, mesh, fused", [(True, None, True), (False, None, False),
                                               (True, "fsdp=2,expert=2", True), (True, "tensor=2", False)])
def test_server_fuses_unless_off_or_tensor_parallel(flag, mesh, fused):
    if mesh and jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    config = EngineConfig(max_num_seqs=2, max_model_len=32, page_size=8, fuse_projections=flag)
    runner = ModelRunner(random_model(SMALL, seed=0), config, Placement.from_spec(mesh))
    for attention in attentions(runner.model):
        assert hasattr(attention, "wqkvr") == fused
        assert all(hasattr(attention, name) != fused for name in PROJECTIONS)
    if fused and mesh:  # rows over fsdp, columns whole on every device
        spec = runner.model.layers[0].attn.wqkvr[...].sharding.spec
        assert tuple(spec) == tuple(PartitionSpec("fsdp", None))

