"""Writing the hub layout ourselves and reading it back; the MTP head's wiring and causality."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inkling_jax import InklingModel, load_pretrained, preset
from inkling_jax.checkpoint.loading import save_pretrained
from inkling_jax.checkpoint.safetensors_io import HubCheckpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = InklingModel(preset("tiny"), rngs=nnx.Rngs(3))
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_pretrained(model, path, max_shard_bytes=200_000)
    return model, path


def test_hub_round_trip_is_exact(tiny):
    model, path = tiny
    ckpt = HubCheckpoint(str(path))
    assert len(ckpt.files) > 1 and "model.mtp.layers.1.transformer_block.attn.wq_du.weight" in ckpt.names
    # gate/up rows are interleaved on disk
    w13 = ckpt.read("model.llm.layers.1.mlp.experts.w13_weight")
    np.testing.assert_array_equal(w13[:, 0::2, :].transpose(0, 2, 1), np.asarray(model.layers[1].mlp.w_gate[...]))
    loaded = load_pretrained(path, progress=False)
    a, b = nnx.state(model, nnx.Param), nnx.state(loaded, nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_existing_destination_is_refused(tiny):
    model, path = tiny
    with pytest.raises(FileExistsError):
        save_pretrained(model, path)


def test_mtp_drafts_are_causal(tiny):
    """Depth k at position p reads tokens 0 .. p + k + 1 and nothing later."""
    model, _ = tiny
    ids = np.random.default_rng(0).integers(0, 256, (1, 16)).astype(np.int32)
    mtp_logits = nnx.jit(lambda model, ids: model.mtp_logits(ids))  # one compile for both calls
    drafts = mtp_logits(model, jnp.asarray(ids))
    assert len(drafts) == 2 and drafts[0].shape == (1, 16, model.config.text.unpadded_vocab_size)
    cut = 9
    changed = ids.copy()
    changed[0, cut:] = (changed[0, cut:] + 1) % 256
    again = mtp_logits(model, jnp.asarray(changed))
    for depth in range(2):
        last_unaffected = cut - depth - 2
        np.testing.assert_allclose(np.asarray(again[depth][0, :last_unaffected + 1]),
                                   np.asarray(drafts[depth][0, :last_unaffected + 1]), rtol=1e-5, atol=1e-6)
        assert not np.allclose(np.asarray(again[depth][0, last_unaffected + 1]),
                               np.asarray(drafts[depth][0, last_unaffected + 1]))
