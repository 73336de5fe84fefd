"""The runner's mixed steps: a step that holds decodes and prompt chunks runs as one program
(`StepPrograms.mixed`) rather than a decode program and a prefill program, each of which reads every weight; the
chunks then ride along with the memory-bound decodes. A mixin of `ModelRunner`, whose state it dispatches with.

Mixed programs are compiled (`warm_up`) for every decode row bucket with the prompt chunks of each of
`EngineConfig.mixed_prefills` rows at the largest chunk size: by default one row, the steady state of a busy
server, where one new prompt is prefilled chunk by chunk while the other rows decode, and the most rows the token
budget holds, a burst of new prompts beside the decodes. A step's chunks are padded
to the fewest rows that hold them and to that size. Any other step (more chunks than the most rows, prompt
logprobs, a multi-token decode run, speculative rounds) runs the two programs."""

from __future__ import annotations

from typing import Callable

from serve.engine.scheduler import Chunk
from serve.runner.steps import pack


class MixedSteps:
    mixed_runs = 0  # mixed steps dispatched so far

    def runs_mixed(self, groups: list[list[Chunk]]) -> bool:
        """Whether a step of these groups (`_groups`: decodes, then prefill chunks) runs as a mixed program: one
        token per decode row and prompt chunks that score no prompt, as many as a mixed program holds."""
        if not self.config.mixed_buckets or len(groups) != 2:
            return False
        decode, prefill = groups
        return (self.config.mixed_prefill_bucket(len(prefill)) is not None and not any(c.scores for c in prefill)
                and all(c.steps == 1 for c in decode))

    def dispatch_mixed(self, decode: list[Chunk], prefill: list[Chunk], on_queued: Callable[[], None]) -> list:
        """Dispatches a mixed step and calls `on_queued`; returns its two groups' entries as `dispatch` does, each
        group's samples read as its own program's would be (`collect`)."""
        rows, chunk_rows = self.config.row_bucket(len(decode)), self.config.mixed_prefill_bucket(len(prefill))
        self._assign_adapters(decode + prefill)
        inputs = self.placement.put((pack(self._inputs(decode, rows, 1)),
                                     pack(self._inputs(prefill, chunk_rows, self.config.max_chunk))))
        program = self._mixed[rows, chunk_rows, self._full(decode + prefill, 1)]
        self.cache, self.row_state, decode_out, prefill_out = program(self.params, self.cache, self.row_state,
                                                                      *inputs)
        on_queued()
        self.mixed_runs += 1
        return [(decode, [decode_out], None, None, None), (prefill, [prefill_out], None, None, None)]
