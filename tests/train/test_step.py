"""The jitted training step: its loss is the packed next-token cross-entropy of the model, and on 8 simulated CPU
devices its loss and gradients equal the single-device ones.

The sharded runs also accumulate over 2 microbatches and rematerialise every layer, while the reference takes
the whole batch at once without remat: all three must leave the loss and the gradients unchanged.
"""

import jax
import numpy as np
import pytest

from inkling_jax import preset
from inkling_jax.parallel.mesh import MeshError, make_mesh
from train.run import first_layers
from train.state import ModelParts, seeded_params
from train.step import StepConfig, Trainer

# 3 layers cover every kind: sliding + dense MLP, sliding + MoE, full attention + MoE.
CONFIG = first_layers(preset("tiny"), 3)
QUICK = {"xla_backend_optimization_level": 0}  # CPU compile time; numerics are the same functions


def packed_batch(rows=8, length=24, seed=0):
    """Random tokens in 2-3 packed segments per row, a trailing pad, and a loss mask with holes."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CONFIG.text.unpadded_vocab_size, (rows, length)).astype(np.int32)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = sorted(rng.choice(np.arange(3, length - 3), size=rng.integers(1, 3), replace=False).tolist())
        end = length - rng.integers(0, 3)
        for s, (a, b) in enumerate(zip([0] + cuts, cuts + [end])):
            seg[r, a:b] = s + 1
            pos[r, a:b] = np.arange(b - a)
    mask = (rng.random((rows, length)) > 0.2).astype(np.int32)
    return {"input_ids": ids, "segment_ids": seg, "positions": pos, "loss_mask": mask}


def as_microbatches(batch, accum):
    return {k: v.reshape(accum, v.shape[0] // accum, *v.shape[1:]) for k, v in batch.items()}


@pytest.fixture(scope="module")
def reference():
    params = seeded_params(CONFIG, 0, compiler_options=QUICK)
    batch = packed_batch()
    trainer = Trainer(CONFIG, make_mesh("data=1", devices=jax.devices()[:1]), StepConfig(compute_dtype="float32"),
                      compiler_options=QUICK)
    state, frozen = trainer.init(params)
    loss, grads = trainer.loss_and_grads(state, frozen, trainer.place_batch(as_microbatches(batch, 1)))
    return params, batch, float(loss), jax.device_get(grads)


def test_loss_is_the_packed_next_token_cross_entropy(reference):
    params, batch, loss, _ = reference
    forward = jax.jit(lambda p, b: ModelParts(CONFIG, "float32").merge(p)(
        b["input_ids"], segment_ids=b["segment_ids"], positions=b["positions"]), compiler_options=QUICK)
    logits = np.asarray(forward(params, batch), np.float64)
    total, count = 0.0, 0
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1] - 1):
            seg = batch["segment_ids"][r]
            if seg[t] > 0 and seg[t + 1] == seg[t] and batch["loss_mask"][r, t + 1]:
                row = logits[r, t]
                total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[batch["input_ids"][r, t + 1]]
                count += 1
    assert count > 50
    np.testing.assert_allclose(loss, total / count, rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("spec", ["data=2,tensor=2,expert=2", "fsdp=4,tensor=2"])
def test_sharded_loss_and_grads_equal_single_device(reference, spec):
    params, batch, ref_loss, ref_grads = reference
    mesh = make_mesh(spec)
    trainer = Trainer(CONFIG, mesh, StepConfig(compute_dtype="float32", remat="full"), compiler_options=QUICK)
    state, frozen = trainer.init(params)
    experts = state.params["layers.1.mlp.w_gate"]
    assert len(experts.sharding.device_set) == 8 and not experts.sharding.is_fully_replicated
    placed = trainer.place_batch(as_microbatches(batch, 2))
    # The model in the step splits its own work over the mesh (kernels, MoE, embedding: each a shard_map).
    first = {k: v[0] for k, v in placed.items()}
    assert "shard_map" in str(jax.make_jaxpr(trainer._loss_sum)(state.params, state.bias, frozen, first))
    loss, grads = trainer.loss_and_grads(state, frozen, placed)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-6)
    assert sorted(grads) == sorted(ref_grads)
    scale = max(float(np.abs(g).max()) for g in ref_grads.values())
    for name, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), ref_grads[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert any(float(np.abs(g).max()) > 0 for n, g in ref_grads.items() if "mlp.w_down" in n)


@pytest.mark.skipif(jax.device_count() < 3, reason="needs 3 (simulated) devices")
def test_a_mesh_that_cannot_split_the_experts_is_refused_before_any_weight():
    with pytest.raises(MeshError, match="8 routed experts do not split over expert=3"):
        Trainer(CONFIG, make_mesh("expert=3", jax.devices()[:3]))
