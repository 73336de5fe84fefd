"""Sharded execution on 8 simulated CPU devices equals the single-device model."""

import jax
import numpy as np
import pytest
from flax import nnx

from inkling_jax import InklingModel, preset
from inkling_jax.generate import StepFunctions
from inkling_jax.sharding import batch_sharding, logical_axes, make_mesh, parse_mesh_spec, shard_model


def test_mesh_spec_parsing():
    assert parse_mesh_spec("fsdp=4,tensor=2") == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    with pytest.raises(ValueError, match="bad mesh axis"):
        parse_mesh_spec("pipeline=2")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh("data=2,fsdp=8")


def test_logical_axes_table():
    assert logical_axes(("layers", 1, "mlp", "w_gate"), 3) == ("experts", "embed", "expert_mlp")
    assert logical_axes(("layers", 0, "mlp", "w_gate"), 2) == ("embed", "mlp")
    assert logical_axes(("layers", 0, "attn", "wo", "kernel"), 2) == ("q_heads", "embed")
    assert logical_axes(("norm", "weight"), 1) == (None,)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("spec", ["data=2,tensor=2,expert=2", "fsdp=4,tensor=2"])
def test_sharded_logits_equal_unsharded(spec):
    config = preset("tiny")
    ids = np.random.default_rng(0).integers(0, 256, (4, 24)).astype(np.int32)
    reference = np.asarray(StepFunctions(InklingModel(config, rngs=nnx.Rngs(0))).forward(ids))
    mesh = make_mesh(spec)
    model = shard_model(InklingModel(config, rngs=nnx.Rngs(0)), mesh)
    experts = model.layers[1].mlp.w_gate[...]
    assert len(experts.sharding.device_set) == 8 and not experts.sharding.is_fully_replicated
    sharded_ids = jax.device_put(ids, batch_sharding(mesh, ids.shape))
    out = np.asarray(StepFunctions(model).forward(sharded_ids))
    np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)
