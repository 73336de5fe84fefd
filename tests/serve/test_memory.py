"""The KV pool shrinks where it does not fit: where the allocator cannot place it, and where the largest compiled
step program's buffers do not fit beside it (told here by fake memory statistics and allocation failures; CPUs
have neither). The smaller pool serves the same tokens."""

import jax
import jax.numpy as jnp
import pytest

from inkling_jax import preset
from serve.engine import memory_plan
from serve.engine.config import EngineConfig
from serve.engine.engine import Engine
from serve.engine.request import EngineStopped
from serve.engine.sampling_params import SamplingParams
from serve.offline import generate
from serve.random_weights import random_model
from serve.runner.placement import Placement
from tests.backends import REFERENCE

CONFIG = preset("tiny").replace(num_layers=2, local_layer_ids=(0,), dense_layer_ids=(0,))
ENGINE = dict(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=48, page_size=8, chunk_buckets=(1, 16),
              row_buckets=(3,))
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]


def _engine():
    model = random_model(CONFIG, seed=0, backend=REFERENCE)
    return Engine(model, EngineConfig(**ENGINE), eos_token_id=CONFIG.eos_token_id)


def _serve(monkeypatch=None, pages_short=0):
    """Greedy tokens of PROMPTS and the engine's pool size, with the programs `pages_short` pages beyond what
    fits beside the first pool (which holds every slot at full length: 8 pages)."""
    engine = _engine()
    runner = engine.runner
    if monkeypatch is not None:
        page = runner.page_bytes_per_device()
        need = 20 * page  # the largest program's bytes, as the fake analysis reports them
        first = runner.num_pages
        monkeypatch.setattr(memory_plan, "program_bytes", lambda compiled: need)
        # free memory falls by a page per page of pool; at the first pool, 21 pages (need + 5%) less the short
        monkeypatch.setattr(memory_plan, "free_bytes", lambda devices: (
            21 - pages_short + first - runner.num_pages) * page)
    engine.start()
    try:
        out = generate(engine, PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        engine.shutdown(drain_seconds=0)
    pages = engine.runner.cache.layers[1].k.shape[0]
    return [o.token_ids for o in out], pages


@pytest.fixture(scope="module")
def plain():
    """_serve() with nothing faked: the tokens and pool size that the faked runs are compared with."""
    return _serve()


def test_pool_shrinks_to_leave_room_for_the_programs(plain, monkeypatch):
    want, pages = plain
    assert pages == 8  # 2 slots x 4 pages of 8 tokens (CPU: no memory statistics)
    got, fewer = _serve(monkeypatch, pages_short=3)
    assert fewer == 5
    assert got == want


class _Device:
    def __init__(self, **stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_free_memory_counts_as_far_as_one_block_holds_it():
    """Two H200s without preallocation (2026-11-30): 82 GiB free, but 9 GiB in the largest free block and 73 GiB
    of room for a new region; with preallocation the allocator's one region is its whole limit."""
    gib = 2**30
    growing = _Device(bytes_limit=105 * gib, bytes_in_use=22 * gib, pool_bytes=32 * gib,
                      largest_free_block_bytes=9 * gib)
    preallocated = _Device(bytes_limit=105 * gib, bytes_in_use=22 * gib, pool_bytes=105 * gib,
                           largest_free_block_bytes=80 * gib)
    assert memory_plan.free_bytes([growing]) == 83 * gib
    assert memory_plan.largest_allocation([growing]) == 73 * gib
    assert memory_plan.largest_allocation([preallocated, growing]) == 73 * gib
    assert memory_plan.grows_on_demand([growing]) and not memory_plan.grows_on_demand([preallocated])
    assert memory_plan.largest_allocation([_Device()]) is None and not memory_plan.grows_on_demand([_Device()])


def test_an_allocator_that_grows_takes_the_cache_as_one_block_first(plain, monkeypatch):
    """Where the allocator grows region by region, the runner has it take the whole cache (pool, ring and conv
    states, snapshots) as one block before making it; the engine then serves as before."""
    want, _ = plain
    reserved = []
    reserve = Placement.reserve
    monkeypatch.setattr(memory_plan, "grows_on_demand", lambda devices: True)
    monkeypatch.setattr(Placement, "reserve", lambda self, nbytes: reserved.append(nbytes) or reserve(self, nbytes))
    got, pages = _serve()
    assert got == want
    page = memory_plan.page_bytes(CONFIG.text, EngineConfig(**ENGINE), jnp.float32)
    assert len(reserved) == 1 and reserved[0] > pages * page  # the pool and the rest of the cache


def test_a_pool_that_cannot_be_allocated_stops_with_the_numbers(monkeypatch):
    """No smaller pool is tried (on the H200 the arrays of a failed allocation stayed allocated): the error says
    which pool failed and what to change."""
    create = Placement.create

    def out_of_memory_for_pools(self, fn, shardings=None):
        if hasattr(jax.eval_shape(fn), "layers"):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
        return create(self, fn, shardings)

    monkeypatch.setattr(Placement, "create", out_of_memory_for_pools)
    with pytest.raises(MemoryError, match="KV pool of 8 pages .* --num-pages"):
        _engine()
    from serve.app import main  # the server stops with that line, no traceback
    with pytest.raises(SystemExit, match="KV pool of 4 pages .* could not be allocated"):
        main(["--num-pages", "4", "--max-model-len", "32"])


def test_a_failed_step_fails_its_requests_and_a_failed_restart_stops_the_engine(monkeypatch):
    """A step that fails ends its requests with finish_reason "error" and the engine starts clean, serving the
    same tokens after; where it cannot start clean (its reset runs out of memory) it stops taking requests,
    instead of queueing them for an engine thread that is gone."""
    engine = _engine()
    engine.start()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runner, dispatch = engine.runner, engine.runner.dispatch
    try:
        want = [o.token_ids for o in generate(engine, PROMPTS, params)]

        def fail(*args, **kwargs):
            raise RuntimeError("a step that fails")

        monkeypatch.setattr(runner, "dispatch", fail)
        assert [o.finish_reason for o in generate(engine, PROMPTS, params)] == ["error", "error"]
        monkeypatch.setattr(runner, "dispatch", dispatch)
        assert [o.token_ids for o in generate(engine, PROMPTS, params)] == want
        monkeypatch.setattr(runner, "dispatch", fail)
        monkeypatch.setattr(runner, "reset", lambda: (_ for _ in ()).throw(MemoryError("no room")))
        assert [o.finish_reason for o in generate(engine, PROMPTS, params)] == ["error", "error"]
        engine._thread.join(timeout=10)
        assert not engine.alive
        with pytest.raises(EngineStopped, match="stopped after a failed step"):
            generate(engine, PROMPTS, params, timeout=10)
    finally:
        engine.shutdown(drain_seconds=0)
