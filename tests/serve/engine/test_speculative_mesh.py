"""Speculative decoding sharded over 8 simulated CPU devices (tensor=2, expert=4): greedy outputs equal the
one-device model's, token for token, with the MTP head and with a draft model whose heads split differently from
the model's; every cache layer, the drafter's included, is split as its own attention kernels split their heads;
no step program gathers a KV pool. Prompts and outputs cross the sliding window (8) and the full layers'
relative extent (12)."""

import dataclasses

import jax
import numpy as np
import pytest

from inkling_jax import preset
from inkling_jax.generate import flat_params
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner.drafters import OracleDrafter
from serve.runner.placement import Placement
from tests.backends import REFERENCE
from tests.greedy import greedy_continuations
from tests.serve.kv_pool_gathers import kv_pool_gathers

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

# Sliding layer: 4 query / 2 KV heads, split over tensor=2; full layer: 4 / 1, whole. The `tiny` MTP head: depth
# 0 sliding, depth 1 full.
CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
# A smaller draft model (dense MLPs) of the same vocabulary whose layers split the other way: sliding 2 / 1
# (whole), full 4 / 2 (split, where the model's full layer is whole).
DRAFT = dataclasses.replace(CONFIG.replace(hidden_size=32, swa_num_heads=2, swa_num_kv_heads=1, num_kv_heads=2,
                                           head_dim=8, swa_head_dim=8, dense_layer_ids=(0, 1)), mtp=None)
PROMPTS = [np.random.default_rng(seed).integers(0, 256, n).tolist() for seed, n in enumerate((5, 13, 9))]
NEW = 12
ENGINE = dict(max_num_seqs=3, max_model_len=40, max_num_batched_tokens=64, page_size=8, chunk_buckets=(1, 16),
              row_buckets=(4,), prefix_caching=False)
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=1, backend=REFERENCE)


def run(model, method, k, oracle=None, draft_model=None):
    """The engine on the mesh, k drafts per round, over PROMPTS: (outputs, every sequence it ran by id, its
    runner)."""
    engine = Engine(model, EngineConfig(**ENGINE, speculative=SpeculativeConfig(method, k)),
                    eos_token_id=CONFIG.eos_token_id, placement=Placement.from_spec("tensor=2,expert=4"),
                    oracle=oracle, draft_model=draft_model)
    seqs, collect = {}, engine.runner.collect

    def recording(dispatched):  # the sequences, whose last drafts (`Sequence.drafts`) the test reads
        seqs.update({chunk.seq.seq_id: chunk.seq for group, *_ in dispatched for chunk in group})
        return collect(dispatched)

    engine.runner.collect = recording
    engine.start()
    try:
        return generate(engine, PROMPTS, GREEDY), seqs, engine.runner
    finally:
        engine.shutdown(drain_seconds=0)


def mtp_first_drafts(model, sequences) -> list[int]:
    """The one-device MTP head's first draft after each whole sequence: depth 0 at its last position but one
    (which reads the last token), teacher-forced over the sequence."""
    leaves, merge = flat_params(model)

    def depth0(leaves, ids):
        return merge(leaves).mtp_logits(ids)[0].argmax(-1)

    width = max(map(len, sequences))
    drafts = np.asarray(jax.jit(depth0)(leaves, np.array([s + [0] * (width - len(s)) for s in sequences])))
    return [int(drafts[row, len(s) - 2]) for row, s in enumerate(sequences)]


def assert_kv_split(runner, split_layers):
    """The cache's K/V and their ShortConv states split (over tensor) in the layers `split_layers`, whole in
    the others; and no step program gathers a KV pool."""
    for i, layer in enumerate(runner.cache.layers):
        for name in ("k", "v", "k_conv", "v_conv"):
            assert getattr(layer, name).sharding.is_fully_replicated == (i not in split_layers), (i, name)
    assert not kv_pool_gathers(runner)


@pytest.fixture(scope="module")
def greedy(model):
    return greedy_continuations(model, PROMPTS, NEW)


def test_mtp_head_on_a_mesh(model, greedy):
    """The head's state kept on the mesh (2 drafts a round) with drafts from an oracle, wrong at chosen outputs
    and short of the third prompt's continuation, so that rows accept every length from 0 to 2, different ones
    in one round; the head's own last drafts are the one-device head's."""
    table = {tuple(p): g[:7] if i == 2 else g for i, (p, g) in enumerate(zip(PROMPTS, greedy))}
    oracle = OracleDrafter(table, frozenset({3, 5, 6}), CONFIG.text.unpadded_vocab_size)
    outputs, seqs, runner = run(model, "mtp", 2, oracle=oracle)
    assert [o.token_ids for o in outputs] == greedy
    assert {a for o in outputs for _, a in o.speculative_rounds} == {0, 1, 2}
    assert outputs[2].speculative_rounds != outputs[0].speculative_rounds  # drafts past its 7th output: none
    ends = list(seqs.values())
    assert [seq.drafts[0] for seq in ends] == mtp_first_drafts(model, [seq.token_ids for seq in ends])
    assert_kv_split(runner, {0, 2})  # the model's sliding layer, MTP depth 0 (sliding)


def test_draft_model_on_a_mesh(model, greedy):
    """A random draft model (its drafts mostly rejected, so rounds roll back) beside the model on the mesh, each
    of its layers split by its own heads."""
    draft = random_model(DRAFT, seed=2, backend=REFERENCE)
    outputs, _, runner = run(model, "draft", 1, draft_model=draft)
    assert [o.token_ids for o in outputs] == greedy
    assert all((1, 0) in o.speculative_rounds for o in outputs)  # rounds verified the draft model's drafts
    assert_kv_split(runner, {0, 3})  # the model's sliding layer, the draft model's full layer
