"""Work handed from another thread to the engine thread, which runs it once no sequence runs: new parameters
swapped in (RL weight sync), the device state freed while another program needs the memory.

The sender waits for the work to be done; work that fails (arrays the compiled steps cannot take, say) is raised
in the sender's thread, and the engine thread goes on with what it had.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class _Delivery:
    def __init__(self, work: Callable[[], None], what: str):
        self.work, self.what = work, what
        self.done = threading.Event()
        self.error: BaseException | None = None


class IdleMailbox:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: _Delivery | None = None

    def send(self, work: Callable[[], None], what: str, wake: Callable[[], None], timeout: float) -> None:
        """Leave `work` (`what` it does, for errors: "swap in the new parameters") for the engine thread, wake it
        and wait until it is done."""
        delivery = _Delivery(work, what)
        with self._lock:
            if self._pending is not None:
                raise RuntimeError(f"the engine has work waiting already ({self._pending.what}); not: {what}")
            self._pending = delivery
        wake()
        if not delivery.done.wait(timeout):
            with self._lock:
                if self._pending is delivery:  # not taken: withdraw it, so that it is never done late
                    self._pending = None
                    raise TimeoutError(f"the engine did not become idle within {timeout}s to {what}")
            delivery.done.wait()  # taken just now: under way
        if delivery.error is not None:
            raise RuntimeError(f"the engine could not {what}: {delivery.error}") from delivery.error

    def deliver(self) -> bool:
        """On the engine thread: do the waiting work, if any. Returns whether work was done and succeeded."""
        with self._lock:
            delivery, self._pending = self._pending, None
        if delivery is None:
            return False
        try:
            delivery.work()
        except Exception as error:  # the sender hears of it; the engine keeps what it had
            log.exception("the engine could not %s; it keeps what it had", delivery.what)
            delivery.error = error
        finally:
            delivery.done.set()
        return delivery.error is None
