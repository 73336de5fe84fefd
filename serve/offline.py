"""Blocking generation on a started engine, without HTTP (tests, benchmarks, notebooks).

    results = generate(engine, [prompt_ids], SamplingParams(max_tokens=8, temperature=0))
    results[0].token_ids, results[0].finish_reason
    groups = generate_each(engine, [([prompt_ids], SamplingParams(seed=1), None), ...], n=8)  # one burst
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

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
    return generate_each(engine, [(prompts, params, media)], n=n, timeout=timeout, recorder=recorder,
                         adapter=adapter)[0]


def generate_each(engine: Engine, requests: list[tuple], *, n: int = 1, timeout: float = 600.0,
                  recorder: type[TokenRecorder] = TokenRecorder, adapter: str | None = None) -> list[list[Generated]]:
    """Several requests, each (prompts, params, media) with n choices per prompt, submitted back to back from this
    thread, so that they reach the engine as one burst (requests submitted from several threads reach it over
    several steps, and the first ones decode alone meanwhile); then each one's choices as `generate` returns them,
    once all have finished. If one cannot be submitted, or time runs out, the others are aborted."""
    deadline = time.monotonic() + timeout
    pending: list[_Pending] = []
    try:
        for prompts, params, media in requests:
            pending.append(_Pending(engine, prompts, params, n, recorder, media, adapter))
        for p in pending:
            if not p.done.wait(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"generation did not finish within {timeout}s")
    except BaseException:
        for p in pending:
            engine.abort(p.request.request_id)
        raise
    return [p.results() for p in pending]


class _Pending:
    """A submitted request whose choices are counted down as they finish."""

    def __init__(self, engine: Engine, prompts, params, n, recorder, media, adapter):
        self.left = len(prompts) * n
        self.last: dict[int, Output] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.request = engine.submit(f"offline-{next(_ids)}", prompts, params, n, recorder, self._sink, media=media,
                                     adapter=adapter)

    def _sink(self, output: Output) -> None:
        if output.finish_reason is not None:
            with self.lock:
                self.last[output.index] = output
                self.left -= 1
                if not self.left:
                    self.done.set()

    def results(self) -> list[Generated]:
        request, last = self.request, self.last
        results = [request.parsers[seq.seq_id].result for seq in request.seqs]
        for seq, result in zip(request.seqs, results):
            result.finish_reason = last[seq.index].finish_reason
            result.prompt_logprobs = last[seq.index].prompt_logprobs
            result.routed_experts = last[seq.index].routed_experts
            result.speculative_rounds = list(seq.accepted)
        return results
