"""Training data and bookkeeping without compiling a model: packing, resumable batches, next-token targets,
the FLOP count behind MFU, LoRA file round trips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inkling_jax import preset
from train import lora
from train.data import Batches, byte_tokenizer, pack, read_documents
from train.loss import expert_loads, next_token_targets
from train.metrics import active_matmul_params
from train.step import balance_biases


def test_packing_restarts_positions_and_splits_long_documents():
    rng = np.random.default_rng(0)
    lengths = [5, 9, 3, 14, 2]
    docs = [(rng.integers(1, 100, n).astype(np.int32), rng.integers(0, 2, n).astype(np.uint8)) for n in lengths]
    packed = pack(docs, seq_len=8)
    real = packed.segment_ids > 0
    # Every token lands exactly once, in order, with its own loss mask.
    np.testing.assert_array_equal(packed.input_ids[real], np.concatenate([d[0] for d in docs]))
    np.testing.assert_array_equal(packed.loss_mask[real], np.concatenate([d[1] for d in docs]))
    assert len(packed) == int(np.ceil(sum(lengths) / 8))
    for row_seg, row_pos in zip(packed.segment_ids, packed.positions):
        for seg in set(row_seg[row_seg > 0].tolist()):
            np.testing.assert_array_equal(row_pos[row_seg == seg], np.arange((row_seg == seg).sum()))
    # Padding only at the very end.
    assert real[:-1].all() and not real[-1].all()


def test_text_and_jsonl_documents(tmp_path):
    text = tmp_path / "c.txt"
    text.write_text("héllo\n\n\nworld\n")
    docs = read_documents(str(text), byte_tokenizer, eos_id=257, vocab_size=380)
    assert [d[0].tolist() for d in docs] == [list("héllo".encode()) + [257], list(b"world") + [257]]
    rows = tmp_path / "c.jsonl"
    rows.write_text(json.dumps({"input_ids": [3, 4, 5], "loss_mask": [0, 1, 1]}) + "\n"
                    + json.dumps({"tokens": [7, 8]}) + "\n")
    docs = read_documents(str(rows), byte_tokenizer, eos_id=257, vocab_size=380)
    assert [d[1].tolist() for d in docs] == [[0, 1, 1], [1, 1]]
    rows.write_text(json.dumps({"input_ids": [3, 999]}) + "\n")
    with pytest.raises(ValueError, match="token ids"):
        read_documents(str(rows), byte_tokenizer, eos_id=257, vocab_size=380)


def test_batches_are_a_function_of_the_step_and_cover_each_epoch():
    rng = np.random.default_rng(1)
    packed = pack([(rng.integers(1, 50, 6).astype(np.int32), np.ones(6, np.uint8)) for _ in range(12)], 6)
    first = Batches(packed, micro_batch=2, accum=2, seed=3)
    again = Batches(packed, micro_batch=2, accum=2, seed=3)
    for step in (5, 0, 9, 2):  # any order: no hidden iterator state
        a, b = first.batch(step), again.batch(step)
        assert a["input_ids"].shape == (2, 2, 6)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # 12 rows, 4 per step: steps 0-2 are epoch 0 and visit every row once, shuffled; epoch 1 is another order.
    epoch = [first.batch(s)["input_ids"].reshape(-1, 6) for s in range(6)]
    as_rows = lambda arrays: sorted(map(tuple, np.concatenate(arrays).tolist()))  # noqa: E731
    assert as_rows(epoch[:3]) == as_rows([packed.input_ids]) == as_rows(epoch[3:])
    assert not np.array_equal(np.concatenate(epoch[:3]), np.concatenate(epoch[3:]))


def test_next_token_targets_stay_inside_segments_and_follow_the_mask():
    ids = jnp.asarray([[10, 11, 12, 20, 21, 0]])
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0]])
    mask = jnp.asarray([[1, 1, 0, 1, 1, 0]])
    targets, weights = next_token_targets(ids, seg, mask)
    assert targets[0, :2].tolist() == [11, 12] and targets[0, 3] == 21
    # 10->11 counts; 11->12 masked (12 not trained); 12->20 crosses segments; 20->21 counts; 21->pad; pad.
    assert weights[0].tolist() == [1, 0, 0, 1, 0, 0]


def test_expert_loads_skip_padding():
    chosen = [jnp.asarray([[0, 1], [1, 2], [3, 0]])]
    loads = expert_loads(chosen, jnp.asarray([[1, 1, 0]]), num_experts=4)
    assert loads.tolist() == [[1, 2, 1, 0]]


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    bias = {"layers.1.mlp.router_bias": jnp.asarray([0.5, -0.5, 0.0, 0.25])}
    out = balance_biases(bias, ["layers.1.mlp.router_bias"], jnp.asarray([[3.0, 1.0, 2.0, 2.0]]), rate=0.01)
    np.testing.assert_allclose(out["layers.1.mlp.router_bias"], [0.49, -0.49, 0.0, 0.25])


@pytest.mark.parametrize("name, active", [("inkling", 41e9), ("inkling-small", 12e9)])
def test_active_parameters_match_the_published_counts(name, active):
    cfg = preset(name).text
    with_embedding = active_matmul_params(cfg) + cfg.hidden_size * cfg.unpadded_vocab_size
    assert abs(with_embedding / active - 1) < 0.03


def test_adapter_file_round_trip(tmp_path):
    shapes = {"layers.1.mlp.w_gate": (4, 8, 6), "layers.0.attn.wq.kernel": (8, 12), "layers.0.attn.q_norm.weight": (4,)}
    adapters = lora.init_adapters(shapes, rank=3, key=jax.random.PRNGKey(0))
    assert sorted(adapters) == sorted(n + s for n in ("layers.1.mlp.w_gate", "layers.0.attn.wq.kernel")
                                      for s in (lora.A, lora.B))
    adapters = {n: x + jax.random.normal(jax.random.PRNGKey(1), x.shape) for n, x in adapters.items()}
    lora.save_adapters(str(tmp_path / "a.safetensors"), adapters, alpha=6.0)
    loaded, alpha = lora.load_adapters(str(tmp_path / "a.safetensors"))
    assert alpha == 6.0 and sorted(loaded) == sorted(adapters)
    for n in adapters:
        np.testing.assert_array_equal(loaded[n], np.asarray(adapters[n]))
