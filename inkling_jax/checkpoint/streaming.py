"""Bounded parallel streaming: producers read slabs, a worker pool converts and writes them, and the bytes held
at any time stay under a budget. The first error stops everything and is raised in the caller's thread."""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import mmap
import threading
from typing import Callable, Iterable

import numpy as np

try:
    from tqdm.auto import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

POOL_GRAIN = 8 << 20  # buffer sizes are rounded up to this, so slabs of one tensor share buffers


class BufferPool:
    """Byte buffers that slabs reuse. Fresh memory costs a page fault and zeroing per page, which on a VM took
    as much CPU per GB as copying the data twice; a reused buffer costs neither. Free buffers beyond
    `keep_bytes` are released (the smallest first), so the pool holds at most the stream's peak plus that."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._free: list[tuple[int, int, np.ndarray]] = []  # (size, id, buffer), sorted
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least `nbytes` (its first `nbytes` are the caller's to fill)."""
        with self._lock:
            at = bisect.bisect_left(self._free, (nbytes,))
            if at < len(self._free):
                return self._free.pop(at)[2]
        memory = mmap.mmap(-1, -(-max(nbytes, 1) // POOL_GRAIN) * POOL_GRAIN)  # page-aligned, for O_DIRECT
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(memory, np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            bisect.insort(self._free, (buffer.nbytes, id(buffer), buffer))
            while sum(size for size, _, _ in self._free) > self.keep_bytes:
                self._free.pop(0)

    def array(self, buffer: np.ndarray, shape, dtype) -> np.ndarray:
        """The start of `buffer` as a C-contiguous array."""
        return buffer[:int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


class Cancelled(Exception):
    """Raised in producers and workers once another task has failed."""


class Stream:
    """`stream.run(producers, each)`: each producer gets this stream and calls `stream.submit(nbytes, task)`.

    `submit` blocks while `budget` bytes are held by queued or running tasks (one task alone may exceed it),
    so host memory stays near `budget` however large the checkpoint. `peak` is the most ever held.
    """

    def __init__(self, *, workers: int, budget: int, total: int, desc: str, progress: bool):
        self.workers, self.budget = workers, budget
        self.held = self.peak = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="convert")
        self._futures: list[cf.Future] = []
        self.bar = None
        if progress and tqdm is not None:
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, smoothing=0.1,
                            dynamic_ncols=True)

    def check(self) -> None:
        if self._error is not None:
            raise Cancelled()

    def submit(self, nbytes: int, task: Callable[[], None]) -> None:
        with self._cond:
            while self.held and self.held + nbytes > self.budget and self._error is None:
                self._cond.wait()
            self.check()
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        self._futures.append(self._pool.submit(self._run, nbytes, task))

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def _run(self, nbytes: int, task: Callable[[], None]) -> None:
        try:
            if self._error is None:
                task()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
            self._fail(e)
        finally:
            with self._cond:
                self.held -= nbytes
                self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None and not isinstance(error, Cancelled):
                self._error = error
            self._cond.notify_all()

    def run(self, producers: Iterable[Callable[["Stream"], None]], parallel: int) -> None:
        """Run the producers, `parallel` at a time, then wait for every task; raise the first error. An
        interrupt (Ctrl-C) stops producers and workers, and returns only once no thread writes any more."""
        readers = cf.ThreadPoolExecutor(parallel, thread_name_prefix="read")
        try:
            cf.wait([readers.submit(self._produce, p) for p in producers])
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            readers.shutdown(wait=True)
            cf.wait(self._futures)
            self._pool.shutdown()
            if self.bar is not None:
                self.bar.close()
        if self._error is not None:
            raise self._error

    def _produce(self, producer: Callable[["Stream"], None]) -> None:
        try:
            if self._error is None:
                producer(self)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
