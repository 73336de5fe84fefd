"""Which tokens of which sequences go into the next step.

Every step has a token budget. Running sequences come first, oldest first: a decoding sequence costs one token,
one still in prefill gets the next chunk of its prompt. Waiting requests are then admitted in arrival order
(preempted ones at the head) as long as a slot, budget and pages remain, each starting with the prefix the cache
already holds. So prefill is never deferred behind decodes, and decodes keep running while long prompts are
prefilled chunk by chunk (continuous batching).

Chunks start on page boundaries, and each but a prompt's last ends on one: there the prefix cache takes a
snapshot. The last is not cut short at the prompt's last page boundary to snapshot that too: every prompt would
pay a step for its last few tokens, to save a later identical prompt part of one chunk.
When the pages run out, the most recently admitted sequence is preempted: its pages are returned and it goes
back to the head of the queue, to be recomputed (its prefix may well still be cached).

A sequence that asks for prompt logprobs is prefilled from its first token (no prefix hit: the cache holds no
logits), and a step's prefill rows then run in the program that computes them, which takes fewer rows.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from serve.engine.block_manager import BlockManager
from serve.engine.config import EngineConfig
from serve.engine.sequence import Sequence, Status
from serve.lora.slots import AdapterSlots, AdapterUnavailable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    num_tokens: int
    restore: int | None = None  # snapshot to load into the sequence's slot first (a prefix-cache hit)
    admitted: bool = False  # the sequence (re)entered a slot in this step
    steps: int = 1  # tokens to sample if the chunk ends the known tokens (decodes may run several on device)
    ahead: int = 0  # rounds of a run of speculative rounds in flight that this chunk continues
    scores: bool = False  # it computes its positions' prompt logprobs (`Sequence.scores_prompt` when scheduled)
    ends: bool = dataclasses.field(init=False)  # it ends its sequence's known tokens (as scheduled)

    def __post_init__(self):
        self.ends = self.seq.num_cached + self.num_tokens == len(self.seq)

    @property
    def prefill(self) -> bool:
        """It runs in the step's prefill program (a decode is one token that computes no prompt logprobs)."""
        return self.num_tokens > 1 or self.scores

    @property
    def fed(self) -> int:
        """Tokens this chunk feeds: its own and, in a decode run, each sample but the last."""
        return self.num_tokens + max(self.samples - 1, 0)

    @property
    def samples(self) -> int:
        """Tokens this chunk samples: `steps` if it ends its sequence's known tokens, else 0."""
        return self.steps if self.ends else 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora: AdapterSlots | None = None):
        """lora: the engine's LoRA adapters, where it serves some."""
        self.config = config
        self.blocks = block_manager
        self.lora = lora
        self.unservable: list[Sequence] = []  # out of the queue: their adapter cannot be read (`take_unservable`)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, ahead: bool = False) -> list[Chunk]:
        """The next step's chunks. `ahead`: the sequences stand as the step in flight leaves them, its samples not
        yet read (`Sequence.num_pending`): a sequence whose pending token reaches its length limit gets no chunk,
        and nothing is preempted: where pages run short, no step (the engine reads the one in flight first)."""
        budget = self.config.max_num_batched_tokens
        chunks = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted while making room for an older one
                continue
            if seq.num_pending and seq.reached_length(self.config.max_model_len):
                continue
            n = self._chunk_size(seq, budget)
            end = seq.num_cached + n + self.config.lookahead  # speculative steps write past their tokens
            if n == 0 or not self._fits(chunks, seq, n):
                continue
            if ahead and not self.blocks.can_grow(seq, end):
                return []
            if not self._make_room(seq, end):
                continue
            self.blocks.grow(seq, end)
            chunks.append(Chunk(seq, n, scores=seq.scores_prompt))
            budget -= n
        while self.waiting and self.free_slots and budget > 0:
            try:
                chunk = self._admit(self.waiting[0], budget, chunks)
            except AdapterUnavailable as exc:
                log.error("request %s fails: %s", self.waiting[0].request_id, exc)
                self.unservable.append(self.waiting.popleft())
                continue
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def decode_plan(self, chunks: list[Chunk], ahead: list[int], decode_steps: int, mail: bool) -> list[int] | None:
        """Tokens each decode chunk may sample on device (after the `ahead` rounds of a run of speculative rounds in
        flight that it continues): up to `decode_steps` (at most the compiled `config.decode_steps`), its max_tokens
        and the context length, with the pages for them reserved; with speculative decoding, rounds (each 1 to K + 1
        tokens: the pages cover the most, the plan counts the fewest). None where a multi-token run is not wanted (a
        prefill chunk, an ended sequence, a row with nothing left, a waiting sequence, or new `mail`, that could be
        admitted meanwhile) or the free pages do not cover it."""
        cfg, blocks = self.config, self.blocks
        steps = min(decode_steps, cfg.decode_steps)
        admissible = (self.waiting or mail) and self.free_slots
        if not chunks or admissible or any(c.prefill or c.seq.finished for c in chunks):
            return None
        plan = [min(steps, c.seq.params.max_tokens - c.seq.num_output - a, cfg.max_model_len - len(c.seq) - a)
                for c, a in zip(chunks, ahead)]
        per_step = 1 if cfg.speculative is None else cfg.speculative.num_draft_tokens + 1  # a round's most tokens
        ends = [min(c.seq.num_cached + (a + n) * per_step, cfg.max_model_len) + cfg.lookahead
                for c, a, n in zip(chunks, ahead, plan)]
        needed = sum(max(0, blocks.blocks_for(end) - len(c.seq.block_ids)) for c, end in zip(chunks, ends))
        if min(plan) < 1 or needed > blocks.num_free:
            return None
        for chunk, end in zip(chunks, ends):
            blocks.grow(chunk.seq, end)
        return plan

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (done or aborted), returning its slot and pages."""
        if seq.status is Status.RUNNING:
            self._evict(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    # ------------------------------------------------------------------------------------------------------

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncached
        n = min(remaining, budget, self.config.max_chunk)
        page = self.config.page_size
        if n < remaining:
            n -= n % page  # a partial chunk ends on a page boundary
        return n

    def _fits(self, chunks: list[Chunk], seq: Sequence, n: int) -> bool:
        """Whether a chunk of n tokens of `seq` can join the step's prefill rows within a compiled program: a
        bucket, or where any of them computes prompt logprobs, the rows of the program that does. A decode token
        joins the decode rows, which always fit."""
        if n == 1 and not seq.scores_prompt:
            return True
        prefill = [c for c in chunks if c.prefill]
        if seq.scores_prompt or any(c.scores for c in prefill):
            return len(prefill) + 1 <= self.config.prompt_logprobs_rows
        return self.config.fits(len(prefill) + 1, max([c.num_tokens for c in prefill] + [n]))

    def _admit(self, seq: Sequence, budget: int, chunks: list[Chunk]) -> Chunk | None:
        if not self._adapter_fits(seq):
            return None
        cached, snapshot = self.blocks.match_prefix(seq) if self.config.prefix_caching and not seq.scores_prompt \
            else ([], None)
        hit = len(cached) * self.config.page_size
        seq.num_cached = hit  # provisional, for the chunk size; `admit` sets it for good
        n = self._chunk_size(seq, budget)
        reclaimed = sum(1 for b in cached if self.blocks.blocks[b].ref_count == 0)
        needed = self.blocks.blocks_for(hit + n + self.config.lookahead) - len(cached)
        if n == 0 or not self._fits(chunks, seq, n) or needed > self.blocks.num_free - reclaimed:
            seq.num_cached = 0
            return None
        self.blocks.admit(seq, cached)
        self.blocks.grow(seq, hit + n + self.config.lookahead)
        seq.slot = self.free_slots.pop()
        seq.status = Status.RUNNING
        seq.prefix_hit = hit
        self.running.append(seq)
        return Chunk(seq, n, restore=snapshot, admitted=True, scores=seq.scores_prompt)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s LoRA adapter can join those of the running sequences: no more distinct adapters than
        device slots (`LoRAConfig.max_loras`), so every step's fit (`serve.lora.slots`); else it waits. Its weights
        are then made ready to go into a slot (read again from disk if they left host memory:
        AdapterUnavailable where they cannot be)."""
        running = {s.adapter for s in self.running if s.adapter is not None}
        if seq.adapter is None:
            return True
        if seq.adapter not in running and len(running) >= self.config.lora.max_loras:
            return False
        self.lora.fetch(seq.adapter)
        return True

    def take_unservable(self) -> list[Sequence]:
        """The sequences `schedule` took out of the queue because their adapter cannot be read, for the engine
        to fail."""
        unservable, self.unservable = self.unservable, []
        return unservable

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the newest sequences until `seq` can hold `num_tokens`; False if `seq` itself had to go."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._evict(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _evict(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self.free_slots.append(seq.slot)
        seq.slot = None
