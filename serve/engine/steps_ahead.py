"""Steps queued before the step in flight is read, so that the device does not wait for the host's reading, stop
checks and scheduling between them. Two kinds:

- A decode run that can go on (no waiting sequence could be admitted, every row has tokens left) is continued
  (`Scheduler.decode_plan`): its rows feed their last samples on the device.
- A step that samples at most one token a row (prompt chunks, mixed steps) is applied as it is dispatched, as far
  as its results cannot change that: its tokens count as cached, its prompt chunks' pages and snapshots are
  published, and each token it samples stands as `sequence.PENDING`. From that state the next step is scheduled
  and queued, and only then is the first read. The device feeds a pending token from the row's last sample
  (`steps.RowState.last_token`); the read fills it in, and a sequence that it ends (EOS, a stop id) had one more
  row in the step behind, whose results are dropped. Speculative rounds, chunks that compute prompt logprobs and
  steps whose routing is recorded are applied once read.

A mixin of `Engine`, whose state it works on.
"""

from __future__ import annotations

from serve.engine.outputs import Sample
from serve.engine.scheduler import Chunk
from serve.engine.sequence import PENDING, Sequence


class StepsAhead:
    def _apply_ahead(self, chunks: list[Chunk]) -> bool:
        """Apply a dispatched step ahead where it can be (module docstring): its prompt chunks' snapshots are
        queued now, behind it. False where the step is applied once read."""
        cfg = self.config
        if cfg.speculative is not None or cfg.record_experts or any(c.steps > 1 or c.ahead or c.scores
                                                                     for c in chunks):
            return False
        saves = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.finished:  # a stop string or an abort ended it while the step was dispatched
                continue
            if chunk.prefill:
                self._advance(seq, chunk.num_tokens, saves)
            else:  # its input may be pending still: its page is published once filled in (`_fill`)
                seq.num_cached += 1
            if chunk.ends:
                seq.append(PENDING)
                seq.num_pending += 1
        if saves:
            self.runner.save_snapshots(saves)
        return True

    def _queue_next(self, chunks: list[Chunk], dispatched: list, applied_ahead: bool) -> None:
        """Dispatch the step after `chunks` (dispatched, not read) where it can be (module docstring); it becomes
        the one in flight (`_inflight`)."""
        if applied_ahead:
            following = self._next_step(ahead=True)
            if following:
                self._inflight = (following, self.runner.dispatch(following, on_queued=self._report),
                                  self._apply_ahead(following))
            return
        ahead = [c.steps for c in chunks]
        plan = self._decode_plan(chunks, ahead)
        if plan is not None:
            following = [Chunk(c.seq, 1, steps=n, ahead=a) for c, a, n in zip(chunks, ahead, plan)]
            self._inflight = following, self.runner.dispatch(
                following, on_queued=self._report, previous=self.runner.last_tokens(dispatched)), False

    def _decode_plan(self, chunks: list[Chunk], ahead: list[int]) -> list[int] | None:
        """`Scheduler.decode_plan` at the decode steps set now; a request that arrived meanwhile counts as waiting."""
        with self._lock:
            mail = bool(self._inbox)
        return self.scheduler.decode_plan(chunks, ahead, self.decode_steps, mail)

    def _fill(self, chunks: list[Chunk], samples: dict[int, list[Sample]]) -> list[tuple[Sequence, Sample]]:
        """The read samples of a step applied ahead: each fills its sequence's oldest pending token, and ends it
        where it is EOS, a stop id or reaches a length limit. Returns the samples with their sequences, for
        `_report`."""
        applied = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.finished or not chunk.ends:
                continue
            sample = samples[seq.seq_id][0]
            seq.fill_pending(sample.token_id)
            sample.finish_reason = seq.end_reason(sample.token_id, self.eos_token_id, self.config.max_model_len)
            applied.append((seq, sample))
            if sample.finish_reason:
                self._release(seq)
            elif self.config.prefix_caching:
                self.blocks.register(seq)
        return applied
