"""The chunk files of a converted parameter, and their checksums.

A parameter is an uncompressed zarr array: one file per chunk, holding the chunk's bytes in C order (edge chunks
padded). The converter writes whole chunk files itself (`write_region`) and records the crc32 of each file's
bytes in the manifest, in chunk-grid order. Reading back checks those: `check_chunks` (before a converted
directory is restored, for the chunks this process's devices hold, and in `--verify`) and `read_region` (which
`--to hf` reads through), so a damaged, missing or cut chunk file is an error naming the file and the parameter.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import itertools
import math
import mmap
import os
import threading
import zlib

import numpy as np

from inkling_jax.checkpoint.safetensors_io import CheckpointError

ALIGN = 4096  # O_DIRECT writes whole pages from page-aligned memory
CHECK_THREADS = max(4, min(16, os.cpu_count() or 1))  # reads and crc32 release the GIL


@dataclasses.dataclass(frozen=True)
class ParamArray:
    """A parameter's zarr array; `crc32` (one 8-digit hex string per chunk, in `grid` order) once written."""

    path: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    crc32: tuple[str, ...] = ()

    @classmethod
    def stored(cls, params_dir: str, key: str, entry: dict) -> "ParamArray":
        """The array of parameter `key` as its (checked) manifest entry describes it."""
        return cls(os.path.join(params_dir, key), tuple(entry["shape"]), tuple(entry["chunks"]),
                   np.dtype(entry["dtype"]), tuple(entry["chunk_crc32"]))

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    def grid(self) -> list[tuple[int, ...]]:
        """Every chunk's position, in C order (the order of `crc32`)."""
        return list(itertools.product(*(range(-(-s // c)) for s, c in zip(self.shape, self.chunks))))

    def chunk_path(self, where: tuple[int, ...]) -> str:
        return os.path.join(self.path, ".".join(map(str, where)) or "0")

    def recorded_crc(self, where: tuple[int, ...]) -> str:
        flat = 0
        for i, s, c in zip(where, self.shape, self.chunks):
            flat = flat * -(-s // c) + i
        return self.crc32[flat]


def _pieces(array: ParamArray, index: tuple):
    """(chunk position, slices of the region, slices of the chunk) of every chunk that `index` (slices of the
    array) touches."""
    bounds = [(s.start or 0, array.shape[a] if s.stop is None else min(s.stop, array.shape[a]))
              for a, s in enumerate(index)]
    grid = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(bounds, array.chunks)]
    for where in itertools.product(*grid):
        spans = [(max(lo, i * c), min((i + 1) * c, hi), i * c, lo)
                 for i, c, (lo, hi) in zip(where, array.chunks, bounds)]
        yield (where, tuple(slice(a - lo, b - lo) for a, b, _, lo in spans),
               tuple(slice(a - base, b - base) for a, b, base, _ in spans))


def write_region(array: ParamArray, index: tuple, data: np.ndarray) -> dict[tuple[int, ...], str]:
    """Write `data` to `index` (slices that start on chunk boundaries and stop on one or at the array's end) as
    whole chunk files; returns the crc32 of each file written. Files are written with O_DIRECT where the file
    system takes it (buffered writes of the converter's output cost much CPU in copies and page reclaim). This
    is the one place parameter data is written (tests replace it to simulate a full disk)."""
    crcs = {}
    for where, region, _ in _pieces(array, index):
        crcs[where] = _write_chunk(array.chunk_path(where), np.asarray(data[region]), array.chunks, array.dtype)
    return crcs


def _write_chunk(path: str, part: np.ndarray, chunks: tuple[int, ...], dtype: np.dtype) -> str:
    nbytes = math.prod(chunks) * dtype.itemsize
    padded = -(-nbytes // ALIGN) * ALIGN
    if part.shape == chunks and part.flags.c_contiguous and part.ctypes.data % ALIGN == 0 and padded == nbytes:
        buffer = part.reshape(-1).view(np.uint8)  # already the chunk's bytes, aligned: no copy
    else:
        buffer = _scratch(padded)
        chunk = buffer[:nbytes].view(dtype).reshape(chunks)
        if part.shape != chunks:
            buffer[:nbytes] = 0
        chunk[tuple(slice(0, n) for n in part.shape)] = part
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o666)
        try:
            _write_all(fd, buffer)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: the file system does not take O_DIRECT
            raise
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _write_all(fd, buffer[:nbytes])
        finally:
            os.close(fd)
    if padded != nbytes:
        os.truncate(path, nbytes)
    return f"{zlib.crc32(buffer[:nbytes]):08x}"


def _write_all(fd: int, buffer: np.ndarray) -> None:
    view, done = memoryview(buffer), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of this thread's, reused from chunk to chunk."""
    if getattr(_local, "buffer", None) is None or _local.buffer.nbytes < nbytes:
        _local.buffer = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    return _local.buffer[:nbytes]


def _read_chunk(array: ParamArray, where: tuple[int, ...]) -> np.ndarray:
    """The bytes of one chunk file, checked against the recorded crc32: a view of this thread's scratch buffer,
    valid until the thread reads or writes its next chunk."""
    path, nbytes = array.chunk_path(where), array.chunk_bytes
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: chunk file of parameter {array.name} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read chunk of parameter {array.name} ({e.strerror})") from None
    buffer = _scratch(nbytes)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise CheckpointError(f"{path}: {size} bytes, but a chunk of parameter {array.name} has {nbytes}")
        view, done = memoryview(buffer), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], done)
            if got == 0:
                raise CheckpointError(f"{path}: cut short while reading a chunk of parameter {array.name}")
            done += got
    finally:
        os.close(fd)
    found, recorded = f"{zlib.crc32(buffer):08x}", array.recorded_crc(where)
    if found != recorded:
        raise CheckpointError(f"{path}: chunk of parameter {array.name} has checksum {found}, {recorded} was "
                              f"written: the file is damaged")
    return buffer


def read_region(array: ParamArray, index: tuple) -> np.ndarray:
    """The values at `index` (slices), read from the chunk files with their checksums checked."""
    shape = [len(range(*s.indices(n))) for s, n in zip(index, array.shape)]
    out = np.empty(shape, array.dtype)
    for where, region, part in _pieces(array, index):
        out[region] = _read_chunk(array, where).view(array.dtype).reshape(array.chunks)[part]
    return out


def held_chunks(array: ParamArray, sharding) -> set[tuple[int, ...]]:
    """The chunks that the shards of `sharding` on this process's devices overlap."""
    out = set()
    for index in sharding.addressable_devices_indices_map(array.shape).values():
        region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, array.shape))
        out.update(where for where, _, _ in _pieces(array, region))
    return out


def check_chunks(arrays: list[ParamArray], held: dict[str, set] | None = None) -> None:
    """Check the chunk files of `arrays` against their recorded checksums, all of them or those `held`
    ({parameter: chunk positions}) lists; raises the first failure."""
    work = [(a, w) for a in arrays for w in (a.grid() if held is None else sorted(held[a.name]))]
    with cf.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="check") as pool:
        futures = [pool.submit(_read_chunk, array, where) for array, where in work]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
