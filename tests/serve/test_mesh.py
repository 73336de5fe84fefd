"""The engine sharded over 8 simulated CPU devices (tensor=2, expert=4) gives the greedy tokens and logprobs
of the one-device model, a prefix-cache hit included: K/V heads of the sliding layer split over `tensor`, the
full layer's single KV head replicated, experts spread over `expert`. The attention and ShortConv run once per
device through the same `shard_map`s as the Pallas kernels on GPUs (`inkling_jax.parallel.kernel_sharding`; the kernels
themselves are checked per device in tests/parallel/test_kernel_sharding.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from inkling_jax import preset
from inkling_jax.generate import StepFunctions
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner.placement import Placement
from tests.backends import REFERENCE
from tests.serve.kv_pool_gathers import kv_pool_gathers
from tests.serve.logprobs import model_logprobs

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
PROMPTS = [np.random.default_rng(seed).integers(0, 256, n).tolist() for seed, n in enumerate((7, 19))]
NEW = 9


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_engine_equals_one_device_model():
    engine = Engine(random_model(CONFIG, seed=1, backend=REFERENCE), EngineConfig(
        max_num_seqs=3, max_model_len=48, max_num_batched_tokens=64, page_size=8, chunk_buckets=(1, 16),
        row_buckets=(4,), decode_steps=4), eos_token_id=CONFIG.eos_token_id,
        placement=Placement.from_spec("tensor=2,expert=4"))
    engine.start()
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    try:
        got = generate(engine, PROMPTS, params)
        # The second prompt's first 16 tokens again: a prefix-cache hit restores sharded pages and states.
        reused = PROMPTS[1][:16] + [5, 6, 7]
        got += generate(engine, [reused], params)
        scored = generate(engine, [PROMPTS[1]], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    finally:
        engine.shutdown(drain_seconds=0)
    assert engine.metrics._hits >= 8
    cache = engine.runner.cache
    assert len(cache.layers[0].k.sharding.device_set) == 8 and not cache.layers[0].k.sharding.is_fully_replicated
    assert cache.layers[1].k.sharding.is_fully_replicated  # one KV head: not split over tensor=2
    assert not engine.runner.model.layers[1].mlp.w_gate[...].sharding.is_fully_replicated
    # The 4 rows would split over expert=4 but for `placement.ROWS`, and the pools be rewritten from gathered rows.
    assert cache.layers[1].k.shape[:2] == (engine.runner.num_pages, 8)  # the pool shapes the check looks for
    assert not kv_pool_gathers(engine.runner)
    # The full sampler (these requests ask for logprobs) filters whole logits (`StepPrograms.whole`): its programs
    # have no collective per pass of the cutoff searches (16 of them) beyond the plain sampler's programs.
    steps = engine.runner._steps
    reduces = {key: program.as_text().count(" all-reduce(") + program.as_text().count(" all-reduce-start(")
               for key, program in steps.items()}
    decodes = [rows for rows, chunk, full in steps if chunk == 1 and full]  # prefill runs the full sampler only
    assert decodes
    for rows in decodes:
        assert reduces[rows, 1, True] - reduces[rows, 1, False] < 8, (rows, reduces)
    # The one-device model over each prompt and its output: greedy picks and logprobs at every new position.
    reference = random_model(CONFIG, seed=1, backend=REFERENCE)
    steps = StepFunctions(reference)
    for prompt, out in zip(PROMPTS + [reused], got):
        assert len(out.token_ids) == NEW
        logits = np.asarray(steps.forward(np.array([prompt + out.token_ids[:-1]])))[0, len(prompt) - 1:]
        logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        assert out.token_ids == logits.argmax(-1).tolist()
        np.testing.assert_allclose(out.logprobs, logprobs[np.arange(NEW), out.token_ids], rtol=1e-4, atol=1e-4)
    # The prompt-logprobs prefill program, sharded: the one-device model's logprobs of the prompt's tokens.
    prompt = PROMPTS[1]
    expected = model_logprobs(reference, prompt)[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose([s.logprob for s in scored], expected, rtol=0, atol=1e-4)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")
def test_placement_builds_arrays_in_their_shards():
    """The KV pool is sized for each device's memory, so it must never exist whole on one device: `create`
    builds every shard where it lives (each device's program outputs only its own share)."""
    placement = Placement.from_spec("tensor=2")
    sharding = NamedSharding(placement.mesh, PartitionSpec(None, None, "tensor", None))
    build = lambda: jnp.arange(64 * 8 * 4 * 16, dtype=jnp.float32).reshape(64, 8, 4, 16)  # noqa: E731
    pool = placement.create(build, sharding)
    assert pool.sharding == sharding
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(build()))
    program = placement.jit(build, out_shardings=sharding).lower().compile()
    assert program.memory_analysis().output_size_in_bytes == pool.nbytes // 2
