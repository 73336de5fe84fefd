"""Pages and the prefix cache: chained block hashes, snapshots, LRU reuse of freed pages and snapshots."""

from serve.engine.block_manager import BlockManager
from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import Sequence
from tests.serve.engine.sequences import seq_of


def computed(blocks, seq, upto):
    """Pretend the first `upto` tokens were computed, then publish them."""
    blocks.grow(seq, upto)
    seq.num_cached = upto
    blocks.register(seq)


def test_prefix_hit_needs_a_snapshot_and_leaves_a_token_to_compute():
    blocks = BlockManager(num_blocks=16, page_size=4, num_snapshots=2)
    first = seq_of(14)
    blocks.admit(first, [])
    computed(blocks, first, 12)
    assert blocks.match_prefix(Sequence(first.token_ids, SamplingParams())) == ([], None)  # no snapshot yet
    snapshot = blocks.snapshot_slot(first)
    assert snapshot is not None and blocks.snapshot_slot(first) is None  # one per page
    cached, found = blocks.match_prefix(Sequence(first.token_ids, SamplingParams()))
    assert found == snapshot and cached == first.block_ids[:3]
    # A prompt of exactly 12 tokens must compute its last one itself: no hit at 12.
    assert blocks.match_prefix(Sequence(first.token_ids[:12], SamplingParams())) == ([], None)
    # A different token inside the prefix breaks the chain.
    other = list(first.token_ids)
    other[5] = (other[5] + 1) % 250
    assert blocks.match_prefix(Sequence(other, SamplingParams())) == ([], None)


def test_freed_pages_stay_cached_until_reused_least_recent_first():
    blocks = BlockManager(num_blocks=6, page_size=4, num_snapshots=4)
    a = seq_of(9)
    blocks.admit(a, [])
    computed(blocks, a, 8)
    snap = blocks.snapshot_slot(a)
    blocks.release(a)
    assert blocks.num_free == 6
    again = Sequence(a.token_ids, SamplingParams())
    cached, found = blocks.match_prefix(again)
    assert found == snap and len(cached) == 2
    blocks.admit(again, cached)
    assert blocks.num_free == 4 and again.num_cached == 8
    blocks.release(again)
    # Fill the pool with another sequence: the cached pages go last, tail page first.
    b = seq_of(24)
    blocks.admit(b, [])
    blocks.grow(b, 16)
    assert blocks.match_prefix(Sequence(a.token_ids, SamplingParams()))[1] == snap
    blocks.grow(b, 24)
    assert blocks.match_prefix(Sequence(a.token_ids, SamplingParams())) == ([], None)
    assert sorted(blocks.free_snapshots) == [0, 1, 2, 3]  # evicting the page returned its snapshot


def test_snapshot_pool_evicts_least_recently_used():
    blocks = BlockManager(num_blocks=12, page_size=4, num_snapshots=1)
    a, b = seq_of(5), seq_of(5)
    for s in (a, b):
        blocks.admit(s, [])
        computed(blocks, s, 4)
    first = blocks.snapshot_slot(a)
    assert blocks.snapshot_slot(b) == first  # the only snapshot moved to b
    assert blocks.match_prefix(Sequence(a.token_ids, SamplingParams())) == ([], None)
    assert blocks.match_prefix(Sequence(b.token_ids, SamplingParams()))[1] == first
