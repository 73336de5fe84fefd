"""Prefix-cache snapshots: the chunks of one step are saved by one program (`cache_rows.save_snapshots`), and a
later request that hits them generates what it generated when it missed."""

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax import preset
from inkling_jax.nn.cache import init_cache
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner import cache_rows
from tests.backends import REFERENCE

HIT_TOKENS = "inkling_prefix_cache_hit_tokens_total"
CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))  # sliding + full layer


def test_a_batch_saves_each_row_as_its_snapshot_in_order():
    cache = init_cache(CONFIG.text, 4, 32, jnp.float32)
    rows = cache_rows.row_state(CONFIG.text, cache)
    cache = cache_rows.with_row_state(cache, jax.tree.map(  # row r holds r + 1 everywhere
        lambda x: jnp.broadcast_to(jnp.arange(1, 5, dtype=x.dtype).reshape((4,) + (1,) * (x.ndim - 1)), x.shape),
        rows))
    snapshots = cache_rows.empty_snapshots(CONFIG.text, cache, 3)
    # Row 2 into snapshot 0, row 1 into 1, then row 3 into 0 again (the later wins); a padding pair.
    (pairs,) = cache_rows.snapshot_batches([(2, 0), (1, 1), (3, 0)], 4, 3)
    assert pairs.tolist() == [[2, 1, 3, 0], [0, 1, 0, 3]]
    saved = jax.jit(cache_rows.save_snapshots, static_argnums=0)(CONFIG.text, cache, snapshots, pairs)
    for leaf in jax.tree.leaves(saved):
        assert [float(np.unique(np.asarray(leaf[i]))[0]) for i in range(3)] == [4.0, 2.0, 0.0]


def test_saves_beyond_a_batch_go_in_another():
    batches = cache_rows.snapshot_batches([(5, 0), (6, 1), (7, 2)], 2, 9)
    assert [b.tolist() for b in batches] == [[[5, 6], [0, 1]], [[7, 0], [2, 9]]]
    assert cache_rows.snapshot_batches([], 2, 9) == []


def test_a_steps_snapshots_are_saved_at_once_and_hits_equal_misses():
    model = random_model(CONFIG, seed=2, backend=REFERENCE)
    model.unembed.set_value(model.unembed.get_value() * 100)  # a random model's logits are too flat to show the state
    engine = Engine(model, EngineConfig(
        max_num_seqs=4, max_model_len=64, max_num_batched_tokens=84, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(1, 2, 5), num_pages=40, num_snapshots=16), eos_token_id=CONFIG.eos_token_id)
    engine.start()
    calls = []
    save = engine.runner._save
    engine.runner._save = lambda cache, snapshots, pairs: (calls.append(int((np.asarray(pairs)[1] < 16).sum())),
                                                           save(cache, snapshots, pairs))[1]
    try:
        rng = np.random.default_rng(4)
        prompts = [rng.integers(0, 256, 41).tolist() for _ in range(3)]  # chunks of 16, 16 and 9: snapshots at 16, 32
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
        missed = generate(engine, prompts, params)  # the three prefilled side by side, three chunks a step
        assert calls == [3, 3]
        hits = engine.metrics.registry.get_sample_value(HIT_TOKENS)
        hit = generate(engine, prompts, params)
        assert engine.metrics.registry.get_sample_value(HIT_TOKENS) - hits == 3 * 32
        # The hit computes from 32 what the miss's third chunk computed from 32: the same, given the same state.
        assert [r.token_ids for r in hit] == [r.token_ids for r in missed]
        np.testing.assert_allclose([r.logprobs for r in hit], [r.logprobs for r in missed], rtol=0, atol=1e-6)
    finally:
        engine.shutdown(drain_seconds=0)
