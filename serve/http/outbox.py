"""The engine thread's outputs on their way to the event loop's request queues, one wake-up per batch.

Waking an event loop from another thread (`call_soon_threadsafe`) writes to its self-pipe and runs one callback
there; one per token made a step of 128 streaming rows cost 128 of each. An `Outbox` wakes its loop only for the
first output after a delivery: the rest of the step's outputs, handed over in the same few microseconds, join that
delivery, in order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

_outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_outboxes_lock = threading.Lock()


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, queue: asyncio.Queue, item) -> None:
        """Hand `item` to `queue` on the loop (from any thread). Raises RuntimeError once the loop is closed, as
        `call_soon_threadsafe` does: the engine then knows the listener is gone."""
        if self._loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._pending.append((queue, item))
            wake = len(self._pending) == 1
        if wake:
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)


def outbox_of(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The one Outbox of `loop` (made on first use)."""
    with _outboxes_lock:
        outbox = _outboxes.get(loop)
        if outbox is None:
            outbox = _outboxes[loop] = Outbox(loop)
        return outbox
