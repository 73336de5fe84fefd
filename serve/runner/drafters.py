"""The host's side of speculative decoding: which drafted tokens each row verifies in the next round.

With the MTP head, a row's drafts come back with its samples (`serve.runner.speculative`) and are kept on the
sequence until its next round. `OracleDrafter` proposes a known continuation instead, with wrong tokens where
asked: the upper bound of acceptance (benchmarks), and rounds with chosen rejections (tests). Its plan for the
whole run rides in the round's ids after the K + 1 verified ones (`plan_columns`), so that the later rounds of a
run draft from it on the device, as the MTP head's do.
"""

from __future__ import annotations

import numpy as np

from serve.engine.config import EngineConfig
from serve.engine.scheduler import Chunk
from serve.engine.sequence import Sequence
from serve.runner.steps import StepInputs, step_inputs


class OracleDrafter:
    """Proposes, for a sequence whose prompt is a key of `continuations`, the next tokens of that continuation
    (say the target's own greedy output), each replaced by a wrong token where its output index is in
    `wrong_at`; nothing for other prompts."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_at: frozenset[int] = frozenset(),
                 vocab: int = 2):
        self.continuations = continuations
        self.wrong_at = wrong_at
        self.vocab = vocab

    def propose(self, seq: Sequence, count: int) -> list[int]:
        planned = self.continuations.get(tuple(seq.token_ids[:seq.num_prompt]), [])
        start = seq.num_output  # the first draft follows the last output token, which the round feeds
        return [(planned[i] + 1) % self.vocab if i in self.wrong_at else planned[i]
                for i in range(start, min(start + count, len(planned)))]


def plan_columns(cfg: EngineConfig, oracle: OracleDrafter | None) -> int:
    """Columns of an oracle's plan after a round's K + 1 ids: output indices num_output .. of the row, as many as
    a run of `decode_steps` rounds after one still in flight can emit and draft after (0 without an oracle)."""
    return 0 if oracle is None else (2 * cfg.decode_steps + 1) * (cfg.speculative.num_draft_tokens + 1)


def proposals(seq: Sequence, oracle: OracleDrafter | None, count: int) -> list[int]:
    """The drafts a row verifies next: the oracle's, else those its last step drafted (`Sequence.drafts`)."""
    return (oracle.propose(seq, count) if oracle is not None else seq.drafts)[:count]


def round_inputs(cfg: EngineConfig, group: list[Chunk], index: list[int], rows: int, oracle: OracleDrafter | None,
                 start: dict[int, int] | None = None) -> StepInputs:
    """A run of rounds' inputs for the decode chunks `group` in rows `index` (`SpeculativePrograms.round`): chunk
    width K + 1 + `plan_columns`, from the applied state even where a chunk continues a run in flight: each row's
    last token, then its drafts, as many as it may still emit after the round's first token, an oracle's plan after
    those; as its `steps` the tokens it may emit past the applied state by the end of the run (in its
    `chunk.steps` rounds and the `chunk.ahead` rounds of the run it continues); as `applied` the tokens applied
    since its output count was `start[seq_id]`, where the carry of the run it continues starts (None: 0)."""
    k = cfg.speculative.num_draft_tokens
    width = k + 1 + plan_columns(cfg, oracle)
    inputs = step_inputs(cfg, group, index, rows, width)
    ids, n_new, steps, applied = (x.copy() for x in (inputs.ids, inputs.n_new, inputs.steps, inputs.applied))
    for chunk, row in zip(group, index):
        seq = chunk.seq
        left = min(seq.params.max_tokens - seq.num_output, cfg.max_model_len - len(seq))
        drafts = proposals(seq, oracle, max(0, min(k, left - 1)))
        ids[row, 1:1 + len(drafts)] = np.asarray(drafts, np.int32)
        if oracle is not None:
            plan = oracle.propose(seq, ids.shape[1] - k - 1)
            ids[row, k + 1:k + 1 + len(plan)] = np.asarray(plan, np.int32)
        n_new[row] = 1 + len(drafts)
        steps[row] = min(left, (chunk.ahead + chunk.steps) * (k + 1))
        if start is not None:
            applied[row] = seq.num_output - start[seq.seq_id]
    return inputs.replace(ids=ids, n_new=n_new, steps=steps, applied=applied)


def read_rounds(seq: Sequence, row: int, kept, verified, width: int, on_round) -> list[int]:
    """Where a row's emitted tokens are in a run's read-out (rounds of `width` = K + 1 positions, each round's
    first `kept[round][row]` ones); records each of its rounds on the sequence and with on_round(verified,
    accepted)."""
    index = []
    for r, (emitted, checked) in enumerate(zip(kept, verified)):
        count = int(emitted[row])
        if count:
            index += range(r * width, r * width + count)
            seq.accepted.append((int(checked[row]), count - 1))
            on_round(int(checked[row]), count - 1)
    return index
