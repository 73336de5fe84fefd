"""Blocking generation on a started engine, without HTTP (tests, benchmarks, notebooks).

    results = generate(engine, [prompt_ids], SamplingParams(max_tokens=8, temperature=0))
    results[0].token_ids, results[0].finish_reason
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np

from serve.engine.acceptance import Acceptance, summarize
from serve.engine.engine import Engine
from serve.engine.outputs import Output, Sample
from serve.engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclasses.dataclass
class Generated:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[Sample] | None = None  # where asked (`SamplingParams.prompt_logprobs`)
    speculative_rounds: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (verified, accepted)
    routed_experts: np.ndarray | None = None  # where the engine records routing (`Output.routed_experts`)

    @property
    def acceptance(self) -> Acceptance:
        """Speculative decoding's acceptance over this choice's rounds (none without speculation)."""
        return summarize(self.speculative_rounds)


class TokenRecorder:
    """An output parser that keeps token ids and their logprobs instead of text (stop strings do not apply)."""

    stopped = False

    def __init__(self):
        self.result = Generated()

    def feed(self, token_id: int, sample: Sample | None = None) -> list:
        self.result.token_ids.append(token_id)
        if sample is not None:
            self.result.logprobs.append(sample.logprob)
        return []

    def finish(self, stop: Sample | None = None) -> list:
        return []


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams, *, n: int = 1, media=None,
             timeout: float = 600.0, recorder: type[TokenRecorder] = TokenRecorder,
             adapter: str | None = None) -> list[Generated]:
    """Choice i * n + j of prompt i, once every choice has finished. `recorder`: the parser class that fills each
    `Generated` (RL's keeps the EOS token that ends a choice); `adapter`: the LoRA adapter to run with (None: the
    base)."""
    pending = [len(prompts) * n]
    last: dict[int, Output] = {}
    done = threading.Event()
    lock = threading.Lock()

    def sink(output: Output) -> None:
        if output.finish_reason is not None:
            with lock:
                last[output.index] = output
                pending[0] -= 1
                if not pending[0]:
                    done.set()

    request = engine.submit(f"offline-{next(_ids)}", prompts, params, n, recorder, sink, media=media, adapter=adapter)
    if not done.wait(timeout):
        engine.abort(request.request_id)
        raise TimeoutError(f"generation did not finish within {timeout}s")
    results = [request.parsers[seq.seq_id].result for seq in request.seqs]
    for seq, result in zip(request.seqs, results):
        result.finish_reason, result.prompt_logprobs = last[seq.index].finish_reason, last[seq.index].prompt_logprobs
        result.routed_experts = last[seq.index].routed_experts
        result.speculative_rounds = list(seq.accepted)
    return results
