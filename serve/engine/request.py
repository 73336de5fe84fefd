"""A request as the engine tracks it (its sequences, their text parsers, where its outputs go), the events it
emits, and the two ways `Engine.submit` refuses one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from serve.engine.sequence import Sequence
from serve.http.text_stream import Delta


class QueueFull(RuntimeError):
    """More sequences are waiting than the engine accepts (the API answers 429)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests (the API answers 503)."""


@dataclasses.dataclass
class Output:
    """One event of a request: new text of choice `index`, and its finish reason once it is done."""

    index: int
    deltas: list[Delta]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    num_output: int


class Request:
    def __init__(self, request_id: str, seqs: list[Sequence], parsers: list, sink: Callable[[Output], None]):
        self.request_id = request_id
        self.seqs = seqs
        self.parsers = {seq.seq_id: parser for seq, parser in zip(seqs, parsers)}
        self.sink = sink
        self.remaining = len(seqs)
        self.arrival = time.monotonic()
        self.last_token: dict[int, float] = {}
