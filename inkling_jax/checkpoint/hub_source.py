"""A hub checkpoint directory as the converter reads it: dense logical tensors, read in row slabs.

`HubSource` opens the index and every shard header strictly (through `HubCheckpoint`), and folds each NVFP4
group (packed weight plus `.scale`, `.scale2`, `.input_amax`, `.original_shape`) into one logical tensor of the
original shape, so the hub layout table and its checks apply unchanged. Reads go through `os.preadv` into fresh
buffers rather than memory maps, so pages read once do not stay in the process's resident set.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import ml_dtypes
import numpy as np

from inkling_jax.checkpoint import nvfp4
from inkling_jax.checkpoint.safetensors_io import CheckpointError, HubCheckpoint

READ_PIECE = 8 << 20  # bytes per read call: a piece is hashed while it is still in cache
ALIGN = 4096  # O_DIRECT reads whole pages into page-aligned memory


@dataclasses.dataclass(frozen=True)
class Segment:
    """A byte range of a source file, in file order: the header, a tensor, or bytes between tensors."""

    start: int
    end: int
    tensor: str | None = None


@dataclasses.dataclass(frozen=True)
class Nvfp4Group:
    packed: str
    shape: tuple[int, ...]  # the dequantised [E, rows, cols]
    scale2: np.ndarray


class HubSource:
    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        self.checkpoint = HubCheckpoint(self.directory)
        self.groups = self._nvfp4_groups()
        hidden = {f"{n}.{c}" for n in self.groups for c in nvfp4.COMPANIONS}
        self.names = [n for n in self.checkpoint.names if n not in hidden]
        if self.groups:
            quant = nvfp4.quant_config_of(self.directory) or {}
            if quant.get("quant_algo") != "NVFP4" or quant.get("group_size", nvfp4.BLOCK) != nvfp4.BLOCK:
                first = next(iter(self.groups))
                raise CheckpointError(f"{self.path_of(first)}: tensor {first} is packed FP4, but the quantisation "
                                      f"config says {quant or 'nothing'} (expected quant_algo NVFP4, group 16)")

    @property
    def quantization(self) -> str | None:
        return "NVFP4" if self.groups else None

    # The interface `loading.check_tensor_names` / `check_shapes` use.
    def shape(self, name: str) -> tuple[int, ...]:
        return self.groups[name].shape if name in self.groups else tuple(self.checkpoint.shape(name))

    def path_of(self, name: str) -> str:
        return self.checkpoint.path_of(name)

    def dtype(self, name: str) -> np.dtype:
        """The dtype of the dense values (NVFP4 dequantises to float32)."""
        return np.dtype(np.float32) if name in self.groups else self.checkpoint.dtype(name)

    def stored_nbytes(self, name: str) -> int:
        """Bytes the tensor (its packed form, for NVFP4) takes in its file."""
        return self.checkpoint.file_of(name).nbytes(name)

    def segments(self, file: str) -> list[Segment]:
        """Every byte of a file, in order: the header, then each tensor (the header check leaves no gaps)."""
        st = self.checkpoint.files[file]
        out = [Segment(0, st.data_start)]
        for name in sorted(st.names, key=st.data_range):
            begin, end = st.data_range(name)
            if end > begin:
                out.append(Segment(begin, end, name))
        return out

    def row_bytes(self, name: str) -> int:
        """Stored bytes per row along dim 0."""
        shape = self.checkpoint.shape(name)
        return self.stored_nbytes(name) // shape[0] if shape and shape[0] else self.stored_nbytes(name)

    def decode(self, name: str, start: int, stop: int, raw: np.ndarray) -> np.ndarray:
        """Rows [start, stop) of the dense tensor from the stored bytes of those rows (from `read_bytes`)."""
        st = self.checkpoint.file_of(name)
        if name not in self.groups:
            return raw.view(st.dtype(name)).reshape((stop - start,) + self.shape(name)[1:])
        packed = raw.reshape((stop - start,) + tuple(self.checkpoint.shape(name))[1:])
        return nvfp4.dequantize(packed, self._block_scales(name, start, stop), self.groups[name].scale2[start:stop])

    def read(self, name: str) -> np.ndarray:
        """The whole dense tensor (for models small enough to hold)."""
        rows = self.checkpoint.shape(name)[0]
        return self.decode(name, 0, rows, self.read_rows(name, 0, rows))

    def read_packed(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An NVFP4 tensor as stored: (packed uint8 [E, rows, cols / 2], e4m3 scale [E, rows, cols / 16], scale2
        fp32 [E])."""
        shape = tuple(self.checkpoint.shape(name))
        packed = self.read_rows(name, 0, shape[0]).reshape(shape)
        return packed, self._block_scales(name, 0, shape[0]), self.groups[name].scale2

    def _block_scales(self, name: str, start: int, stop: int) -> np.ndarray:
        """The e4m3 block scales of rows [start, stop) of an NVFP4 tensor."""
        scale = f"{name}.scale"
        rows = self.read_rows(scale, start, stop).view(ml_dtypes.float8_e4m3fn)
        return rows.reshape((stop - start,) + tuple(self.checkpoint.shape(scale))[1:])

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """The stored bytes of rows [start, stop) of a tensor, as uint8."""
        st = self.checkpoint.file_of(name)
        row = self.row_bytes(name)
        offset = st.data_range(name)[0] + start * row
        with open(st.path, "rb") as fh:
            return read_bytes(fh.fileno(), offset, (stop - start) * row, st.path, name)

    def _nvfp4_groups(self) -> dict[str, Nvfp4Group]:
        ckpt, groups = self.checkpoint, {}
        present = set(ckpt.names)
        for name in ckpt.names:
            if f"{name}.scale" not in present and ckpt.file_of(name).dtype(name) != np.uint8:
                continue
            where = ckpt.path_of(name)
            missing = [c for c in ("scale", "scale2", "original_shape") if f"{name}.{c}" not in present]
            if missing:
                raise CheckpointError(f"{where}: tensor {name} is {ckpt.file_of(name).dtype(name)} but its NVFP4 "
                                      f"companion {name}.{missing[0]} is missing")
            original = tuple(int(v) for v in np.asarray(self._small(f"{name}.original_shape")))
            experts, rows, cols = original if len(original) == 3 else (0, 0, 0)
            expected = {name: ([experts, rows, cols // 2], np.uint8),
                        f"{name}.scale": ([experts, rows, cols // nvfp4.BLOCK], ml_dtypes.float8_e4m3fn),
                        f"{name}.scale2": ([experts], np.float32)}
            for part, (shape, dtype) in expected.items():
                found = (list(ckpt.shape(part)), ckpt.file_of(part).dtype(part))
                if len(original) != 3 or cols % nvfp4.BLOCK or found != (shape, np.dtype(dtype)):
                    raise CheckpointError(f"{ckpt.path_of(part)}: tensor {part} is {found[1]} {found[0]}, but "
                                          f"{name}.original_shape {list(original)} needs {np.dtype(dtype)} {shape}")
            scale2 = np.asarray(self._small(f"{name}.scale2"), np.float32)
            if not np.all(np.isfinite(scale2)):
                raise CheckpointError(f"{ckpt.path_of(name + '.scale2')}: tensor {name}.scale2 is not finite")
            groups[name] = Nvfp4Group(name, original, scale2)
        return groups

    def _small(self, name: str) -> np.ndarray:
        st = self.checkpoint.file_of(name)
        return self.read_rows(name, 0, max(st.shape(name)[0], 1)).view(st.dtype(name)).reshape(st.shape(name))


def open_for_reading(path: str, direct: bool = True) -> tuple[int, bool]:
    """(fd, direct): the file opened with O_DIRECT if asked and the file system takes it (a read then costs no
    copy through the page cache, and no reclaim of other cached pages to make room), else buffered."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = None
        if fd is not None:
            try:
                os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)  # some file systems take the flag but not the read
                return fd, True
            except OSError:
                os.close(fd)
    return os.open(path, os.O_RDONLY), False


def direct_span(offset: int, size: int) -> int:
    """Bytes an O_DIRECT read of [offset, offset + size) moves: whole pages around the range."""
    return -(-(offset % ALIGN + size) // ALIGN) * ALIGN


def read_bytes(fd: int, offset: int, size: int, path: str, tensor: str | None, *, out: np.ndarray | None = None,
               digest=None, direct: bool = False) -> np.ndarray:
    """Exactly `size` bytes at `offset` of an open file (into the uint8 buffer `out` when given); a short read
    (a file cut meanwhile) is an error. `digest` (a hashlib object) is fed each piece right after it is read.
    direct: `fd` is open with O_DIRECT; the read covers whole pages, so `out` must be page-aligned and hold
    `direct_span(offset, size)` bytes; the result is the view of the requested bytes."""
    skip = offset % ALIGN if direct else 0
    out = np.empty(size, np.uint8) if out is None else out[:direct_span(offset, size) if direct else size]
    view, done = memoryview(out), 0
    while done < skip + size:
        got = os.preadv(fd, [view[done:done + READ_PIECE]], offset - skip + done)
        if got == 0:
            what = f"tensor {tensor}" if tensor else f"bytes {offset}..{offset + size}"
            raise CheckpointError(f"{path}: truncated while reading {what} (file ends at byte "
                                  f"{offset - skip + done})")
        if digest is not None:
            digest.update(view[max(done, skip):min(done + got, skip + size)])
        done += got
    return out[skip:skip + size]


__all__ = ["HubSource", "Segment", "direct_span", "open_for_reading", "read_bytes"]
