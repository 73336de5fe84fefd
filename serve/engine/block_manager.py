"""Pages of the full-attention KV pool, prefix caching by chained block hashes, LRU eviction, and the saved
sliding-window + ShortConv states ("snapshots") that make a cached prefix usable.

A page holds `page_size` consecutive tokens of one sequence. Once a page is full and computed, it is registered
under the hash of (hash of the previous page, its tokens), so equal prefixes map to equal hash chains. A freed
page keeps its hash until it is handed out again; free pages are reused least recently freed first (a sequence
frees its tail first, so shared heads live longest).

Inkling's sliding layers and ShortConvs carry state that the pages do not hold, so a prefix is only reusable up
to a page boundary where that state was saved: a snapshot attached to the page ending there. A hit therefore
takes the longest matching chain that ends in a page with a snapshot. Snapshots live in a fixed pool, evicted
LRU; evicting a page drops its snapshot.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from serve.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "snapshot")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.snapshot: int | None = None


def chain_hash(previous: bytes, token_ids) -> bytes:
    return hashlib.blake2b(previous + np.asarray(token_ids, np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, page_size: int, num_snapshots: int = 0):
        self.page_size = page_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.free_snapshots = list(range(num_snapshots))
        self.snapshot_lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # snapshot -> block

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------------------------------------------
    # Prefix matching

    def block_hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """The first `count` chained hashes of the sequence's full blocks (memoised on the sequence)."""
        hashes = seq.block_hashes
        while len(hashes) < count:
            start = len(hashes) * self.page_size
            previous = hashes[-1] if hashes else seq.hash_seed
            hashes.append(chain_hash(previous, seq.token_ids[start:start + self.page_size]))
        return hashes[:count]

    def match_prefix(self, seq: Sequence) -> tuple[list[int], int | None]:
        """(cached blocks to reuse, the snapshot at their end) for the longest usable prefix; at least one token
        is always left to compute, since the next token's logits come from it."""
        usable = (len(seq) - 1) // self.page_size
        best: tuple[list[int], int | None] = ([], None)
        chain = []
        for i, h in enumerate(self.block_hashes(seq, usable)):
            block_id = self.hash_to_block.get(h)
            tokens = tuple(seq.token_ids[i * self.page_size:(i + 1) * self.page_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            chain.append(block_id)
            if self.blocks[block_id].snapshot is not None:
                best = (list(chain), self.blocks[block_id].snapshot)
        return best

    # ------------------------------------------------------------------------------------------------------
    # Allocation

    def admit(self, seq: Sequence, cached_blocks: list[int]) -> None:
        """Give a new (or preempted) sequence its cached prefix; the rest comes from `grow`."""
        for block_id in cached_blocks:
            self._take(block_id)
            snapshot = self.blocks[block_id].snapshot
            if snapshot is not None:
                self.snapshot_lru.move_to_end(snapshot)
        seq.block_ids = list(cached_blocks)
        seq.num_cached = len(cached_blocks) * self.page_size
        seq.num_registered = len(cached_blocks)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_ids) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Enough pages for the sequence's first `num_tokens` tokens (check `can_grow` first)."""
        while len(seq.block_ids) < self.blocks_for(num_tokens):
            block_id = next(iter(self.free))
            self._forget(self.blocks[block_id])
            self._take(block_id)
            seq.block_ids.append(block_id)

    def release(self, seq: Sequence) -> None:
        """Return a sequence's pages (tail first); hashed pages stay findable until reused."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_ids = []
        seq.num_cached = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
        if block.snapshot is not None:
            del self.snapshot_lru[block.snapshot]
            self.free_snapshots.append(block.snapshot)
            block.snapshot = None

    # ------------------------------------------------------------------------------------------------------
    # After a step: publish computed pages, and ask for a snapshot where one is worth keeping

    def register(self, seq: Sequence) -> None:
        """Hash every page of the sequence that is now full and computed (or queued to be) and holds no pending
        token."""
        full = min(seq.num_cached, len(seq) - seq.num_pending) // self.page_size
        hashes = self.block_hashes(seq, full)
        for i in range(seq.num_registered, full):
            block = self.blocks[seq.block_ids[i]]
            if block.hash is None and hashes[i] not in self.hash_to_block:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * self.page_size:(i + 1) * self.page_size])
                self.hash_to_block[block.hash] = block.block_id
        seq.num_registered = full

    def snapshot_slot(self, seq: Sequence) -> int | None:
        """A snapshot id to save the sequence's state into, if its cache ends at a registered page boundary
        that has none yet (the least recently used snapshot is evicted when the pool is full)."""
        if seq.num_cached == 0 or seq.num_cached % self.page_size or not (self.free_snapshots or self.snapshot_lru):
            return None
        block = self.blocks[seq.block_ids[seq.num_cached // self.page_size - 1]]
        if block.hash is None or self.hash_to_block.get(block.hash) != block.block_id or block.snapshot is not None:
            return None
        if not self.free_snapshots:
            evicted, owner = self.snapshot_lru.popitem(last=False)
            self.blocks[owner].snapshot = None
            self.free_snapshots.append(evicted)
        block.snapshot = self.free_snapshots.pop()
        self.snapshot_lru[block.snapshot] = block.block_id
        return block.snapshot
