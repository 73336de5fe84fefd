"""A request as the engine tracks it (its sequences, their output parsers, where its outputs go), what a parser
is, and the two ways `Engine.submit` refuses one.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Protocol

from serve.engine.outputs import Output, Sample
from serve.engine.sampling_params import SamplingParams
from serve.engine.sequence import Sequence


class QueueFull(RuntimeError):
    """More sequences are waiting than the engine accepts (the API answers 429)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests (the API answers 503)."""


class OutputParser(Protocol):
    """Turns one sequence's tokens into what its `Output`s carry (text for the API: `serve.http.text_stream`)."""

    stopped: bool  # a stop string ended the sequence

    def feed(self, token_id: int, sample: Sample | None = None) -> list:
        """One more token (`sample`: its Sample, where the request wants logprobs); what it releases."""

    def finish(self, stop: Sample | None = None) -> list:
        """The sequence ended: what is still held back. `stop`: the Sample of the EOS or stop id that ended it, where
        the request wants logprobs (it has no text)."""


class Request:
    def __init__(self, request_id: str, seqs: list[Sequence], parsers: list[OutputParser],
                 sink: Callable[[Output], None]):
        self.request_id = request_id
        self.seqs = seqs
        self.parsers = {seq.seq_id: parser for seq, parser in zip(seqs, parsers)}
        self.sink = sink
        self.remaining = len(seqs)
        self.arrival = time.monotonic()
        self.last_token: dict[int, float] = {}

    @classmethod
    def of_prompts(cls, request_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
                   make_parser: Callable[[], OutputParser], sink: Callable[[Output], None], media=None,
                   adapter=None) -> Request:
        """n choices of each prompt, choice i * n + j being prompt i's j-th, each with its own seed
        (`SamplingParams.for_choice`: one drawn here where `params` has none). media, adapter: `Engine.submit`'s."""
        seed = random.getrandbits(32)
        extra = {} if media is None else {"media": (media.positions, media.embeddings), "hash_seed": media.digest}
        seqs = [Sequence(prompt, params.for_choice(j, seed), request_id=request_id, index=i * n + j, adapter=adapter,
                         **extra) for i, prompt in enumerate(prompts) for j in range(n)]
        return cls(request_id, seqs, [make_parser() for _ in seqs], sink)

    def parse(self, seq: Sequence, sample: Sample) -> tuple[list, str | None]:
        """What its parser releases for one applied sample of `seq`, and the reason that sample ends the sequence
        (None: it runs on). An EOS or stop id is no part of the text, but of the logprobs."""
        parser = self.parsers[seq.seq_id]
        wanted = sample if seq.params.logprobs is not None else None
        if sample.finish_reason == "stop":
            return parser.finish(wanted), "stop"
        deltas = parser.feed(sample.token_id, wanted)
        if parser.stopped:
            return deltas, "stop"
        if sample.finish_reason == "length":
            return deltas + parser.finish(), "length"
        return deltas, None
