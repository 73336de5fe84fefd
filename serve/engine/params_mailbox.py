"""New parameters handed from another thread to the engine thread, which swaps them in once no sequence runs.

The sender waits for the swap; a swap that fails (arrays the compiled steps cannot take, say) is raised in the
sender's thread, and the engine thread goes on with the parameters it had.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class _Delivery:
    def __init__(self, leaves: list):
        self.leaves = leaves
        self.done = threading.Event()
        self.error: BaseException | None = None


class ParamsMailbox:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: _Delivery | None = None

    def send(self, leaves: list, wake: Callable[[], None], timeout: float) -> None:
        """Leave `leaves` for the engine thread, wake it and wait until it has swapped them in."""
        delivery = _Delivery(leaves)
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("new parameters are already waiting to be swapped in")
            self._pending = delivery
        wake()
        if not delivery.done.wait(timeout):
            with self._lock:
                if self._pending is delivery:  # not taken: withdraw it, so that it is never applied late
                    self._pending = None
                    raise TimeoutError(f"the engine did not become idle within {timeout}s to take new parameters")
            delivery.done.wait()  # taken just now: its swap is under way
        if delivery.error is not None:
            raise RuntimeError(f"the engine could not swap in the new parameters: {delivery.error}") \
                from delivery.error

    def deliver(self, swap: Callable[[list], None]) -> bool:
        """On the engine thread: swap in the waiting parameters, if any. Returns whether a swap succeeded."""
        with self._lock:
            delivery, self._pending = self._pending, None
        if delivery is None:
            return False
        try:
            swap(delivery.leaves)
        except Exception as error:  # the sender hears of it; the engine keeps its parameters
            log.exception("swapping in new parameters failed; the engine keeps the ones it had")
            delivery.error = error
        finally:
            delivery.done.set()
        return delivery.error is None
