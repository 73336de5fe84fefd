"""The KV pool's size: from free device memory, and what the compiled programs leave room for."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import pytest

from inkling_jax import preset
from serve.engine import memory_plan
from serve.engine.config import EngineConfig, SpeculativeConfig
from serve.runner.speculative import drafter_layers


class FakeDevice:
    """A device whose memory statistics say `free` bytes are free."""

    def __init__(self, free, largest_block=None):
        self.free, self.largest_block = free, largest_block

    def memory_stats(self):
        stats = {"bytes_limit": self.free + 1000, "bytes_in_use": 1000}
        if self.largest_block is not None:  # a preallocated pool: its limit is one region
            stats.update(pool_bytes=self.free + 1000, largest_free_block_bytes=self.largest_block)
        return stats


def test_kv_pool_size_follows_free_device_memory(monkeypatch):
    text = preset("tiny").text
    config = EngineConfig(max_num_seqs=4, max_model_len=64, page_size=8, chunk_buckets=(1, 16), row_buckets=(5,),
                          memory_fraction=0.5)
    full_layers = text.num_layers - len(text.local_layer_ids)
    page = memory_plan.page_bytes(text, config, jnp.float32)
    assert page == 2 * full_layers * 8 * text.num_kv_heads * text.head_dim * 4  # K and V of 8 tokens, fp32
    # No memory statistics (CPU): every slot at full length.
    assert memory_plan.pages_for_memory(text, config, jnp.float32) == 4 * config.pages_per_row

    def pages(free, kv_shards=1):
        monkeypatch.setattr(jax, "devices", lambda: [FakeDevice(free)])
        return memory_plan.pages_for_memory(text, config, jnp.float32, kv_shards)

    base = pages(1 << 30)
    # Only memory_fraction of the free memory is used, after a fixed share for slots, snapshots and step buffers.
    assert 0 < base < 0.5 * (1 << 30) / page
    # Each further page's worth of usable memory is exactly one more page.
    assert pages((1 << 30) + 7 * 2 * page) == base + 7
    assert pages(4096) < config.pages_per_row  # too little memory: the runner refuses to start on this
    # KV heads split over two devices: each holds half of every page, so the same memory holds twice the pages.
    assert pages((1 << 30) + 7 * 2 * page, kv_shards=2) - pages(1 << 30, kv_shards=2) == 14
    # The device with the least memory sizes the pool, not the first of jax.devices(); free memory counts as far
    # as one block holds it.
    monkeypatch.setattr(jax, "devices", lambda: [FakeDevice(1 << 31)])
    two = [FakeDevice((1 << 30) + 7 * 2 * page), FakeDevice(1 << 30)]
    assert memory_plan.pages_for_memory(text, config, jnp.float32, 1, two) == base
    split = [FakeDevice((1 << 30) + 7 * 2 * page, largest_block=1 << 30)]
    assert memory_plan.pages_for_memory(text, config, jnp.float32, 1, split) == base


class FakeProgram:
    """A compiled program whose memory analysis reports the given bytes."""

    def __init__(self, temp, output=0, alias=0):
        self.analysis = types.SimpleNamespace(temp_size_in_bytes=temp, output_size_in_bytes=output,
                                              alias_size_in_bytes=alias)

    def memory_analysis(self):
        return self.analysis


def test_kv_pool_leaves_room_for_the_compiled_programs():
    page = 1000
    programs = {"decode": FakeProgram(4000), "prefill": FakeProgram(18_000, output=5000, alias=3000)}
    need = 20_000 + 1000  # the prefill's temporaries and new outputs, and 5% to spare
    fit = functools.partial(memory_plan.pages_that_fit, programs, 50, page, fixed_pages=False)
    assert fit(free=need) == 50 and fit(free=None) == 50
    assert fit(free=need - 1) == 49 and fit(free=need - 7500) == 42  # whole pages, rounded up
    # after a cut, the check again without the spare (the cut took it): only a real shortfall cuts more
    assert fit(free=20_000, spare=0.0) == 50 and fit(free=19_999, spare=0.0) == 49
    with pytest.raises(ValueError, match="--num-pages 50 is too many, at most 42"):
        memory_plan.pages_that_fit(programs, 50, page, need - 7500, fixed_pages=True)


def test_a_draft_models_layers_are_counted_with_their_own_shapes():
    text = preset("tiny").text
    draft = dataclasses.replace(text, num_layers=2, local_layer_ids=(0,), num_kv_heads=1)
    config = EngineConfig(max_num_seqs=4, max_model_len=64, page_size=8, chunk_buckets=(1, 16), row_buckets=(5,))
    page = memory_plan.page_bytes(text, config, jnp.float32)
    with_draft = memory_plan.page_bytes(text, config, jnp.float32, drafter=draft)
    assert with_draft - page == 2 * 1 * 8 * 1 * draft.head_dim * 4  # one full layer, one KV head, fp32
    beside = memory_plan.beside_pool_bytes(text, config, jnp.float32)["slot states"]
    assert memory_plan.beside_pool_bytes(text, config, jnp.float32, draft)["slot states"] > beside


@pytest.mark.parametrize("k, depths, local", [(1, 1, (0,)), (3, 3, (0, 2)), (8, 8, (0, 2, 4, 5, 6, 7))])
def test_the_mtp_drafter_keeps_the_depths_a_chain_of_k_reads(k, depths, local):
    """The released head has 8 depths; K drafts read depths 0 .. K - 1 only, so the cache (and the page size the
    pool is planned with) holds those alone."""
    config = preset("inkling")
    drafter = drafter_layers(config, SpeculativeConfig("mtp", k))
    assert (drafter.num_layers, drafter.local_layer_ids, drafter.dense_layer_ids) == (depths, local, ())
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, page_size=8, chunk_buckets=(1, 16), row_buckets=(5,))
    page = functools.partial(memory_plan.page_bytes, config.text, engine, jnp.bfloat16)
    full_depths = 2 * 8 * config.text.num_kv_heads * config.text.head_dim * 2  # K and V of one full layer's page
    assert page(drafter=drafter) - page() == (depths - len(local)) * full_depths
