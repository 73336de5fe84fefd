"""Steps queued before the step in flight is read, so that the device does not wait for the host's reading, stop
checks and scheduling between them.

A step (prompt chunks, decode runs, both in a mixed step) is applied as it is dispatched, as far as its results
cannot change that: its tokens count as cached, its prompt chunks' pages and snapshots are published, and each
token it samples stands as `sequence.PENDING`. From that state the next step is scheduled (new requests admitted)
and queued, and only then is the first read. The device feeds a pending token from the row's last sample
(`steps.RowState.last_token`); the read fills the pending tokens in, and a sequence that one of them ends (EOS, a
stop id) had its rows of the step behind computed for nothing: their results are dropped.

Steps with chunks that compute prompt logprobs and speculative rounds are applied once read. A run of rounds that
can go on (no waiting sequence could be admitted, every row has tokens left) is continued on the device from its
carry (`Scheduler.decode_plan`, `Chunk.ahead`).

A mixin of `Engine`, whose state it works on.
"""

from __future__ import annotations

from serve.engine.outputs import Sample
from serve.engine.scheduler import Chunk
from serve.engine.sequence import Sequence


class StepsAhead:
    def _apply_ahead(self, chunks: list[Chunk]) -> bool:
        """Apply a dispatched step ahead where it can be (module docstring): its prompt chunks' snapshots are
        queued now, behind it. False where the step is applied once read."""
        if self.config.speculative is not None or any(c.scores for c in chunks):
            return False
        saves = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.finished:  # a stop string or an abort ended it while the step was dispatched
                continue
            if chunk.prefill:
                self._advance(seq, chunk.fed, saves)
            else:  # its first token may be pending still: its page is published once filled in (`_fill`)
                seq.num_cached += chunk.fed
            seq.num_unread += chunk.fed
            seq.add_pending(chunk.samples)
        if saves:
            self.runner.save_snapshots(saves)
        return True

    def _queue_next(self, chunks: list[Chunk], dispatched: list, applied_ahead: bool) -> None:
        """Dispatch the step after `chunks` (dispatched, not read) where it can be (module docstring); it becomes
        the one in flight (`_inflight`)."""
        if applied_ahead:
            self._take_mail()  # requests that came meanwhile join this step
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
        where it is EOS, a stop id or reaches a length limit (the samples after it are dropped). Returns the
        samples kept with their sequences, for `_report`."""
        applied = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.finished:
                continue
            seq.num_unread -= chunk.fed
            for sample in samples.get(seq.seq_id, ()):
                seq.fill_pending(sample.token_id)
                sample.finish_reason = seq.end_reason(sample.token_id, self.eos_token_id, self.config.max_model_len)
                applied.append((seq, sample))
                if sample.finish_reason:
                    self._release(seq)
                    break
            if not seq.finished and self.config.prefix_caching:
                self.blocks.register(seq)
        return applied
