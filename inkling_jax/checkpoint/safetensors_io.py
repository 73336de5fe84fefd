"""A small, strict reader and writer of the safetensors format, without torch.

Tensors are memory-mapped numpy views (bf16 and fp8 through ml_dtypes), so a multi-terabyte checkpoint is read
one tensor at a time. Every header is checked against the file size, so a truncated shard is an error naming
the file and the tensor, not garbage weights.
"""

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or index that cannot be read as it claims to be."""


class SafetensorsFile:
    """The tensors of one .safetensors file: `names`, `shape(name)`, `dtype(name)`, `read(name)`."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                raw = fh.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
                (header_len,) = struct.unpack("<Q", raw)
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: truncated (header of {header_len} bytes, file {size})")
                header = json.loads(fh.read(header_len))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + header_len
        self._entries = header
        for name, entry in header.items():
            if entry.get("dtype") not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {entry.get('dtype')}")
            begin, end = entry["data_offsets"]
            expected = int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(DTYPES[entry["dtype"]]).itemsize
            if end - begin != expected:
                raise CheckpointError(f"{self.path}: tensor {name} spans {end - begin} bytes, its shape needs "
                                      f"{expected}")
            if self.data_start + end > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {name} ends at byte {self.data_start + end}"
                                      f" but the file has {size} bytes")

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self._entries[name]["dtype"]])

    def nbytes(self, name: str) -> int:
        begin, end = self.data_range(name)
        return end - begin

    def data_range(self, name: str) -> tuple[int, int]:
        """Absolute byte range [begin, end) of a tensor's data in the file."""
        begin, end = self._entries[name]["data_offsets"]
        return self.data_start + begin, self.data_start + end

    def read(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor."""
        entry = self._entries[name]
        begin, _ = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, DTYPES[entry["dtype"]])
        return np.memmap(self.path, dtype=DTYPES[entry["dtype"]], mode="r", offset=self.data_start + begin,
                         shape=shape)


def header_bytes(tensors: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict | None) -> bytes:
    """A safetensors header (length prefix included), tensors in the given order, padded to 8 bytes so
    tensor data stays aligned."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        if np.dtype(dtype) not in NAMES:
            raise CheckpointError(f"{name}: dtype {np.dtype(dtype)} cannot be stored in safetensors")
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def group_into_shards(items: list, nbytes, max_bytes: int) -> list[list]:
    """Consecutive items, as many per shard as fit in max_bytes (at least one)."""
    shards, current, size = [], [], 0
    for item in items:
        if current and size + nbytes(item) > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes(item)
    return shards + [current]


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def index_text(weight_map: dict[str, str], total_size: int) -> str:
    """The text of `model.safetensors.index.json`."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (name -> array) to `path`, atomically (a temporary file renamed into place)."""
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    header = header_bytes([(name, a.dtype, a.shape) for name, a in arrays.items()], metadata)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(header)
        for array in arrays.values():
            fh.write(memoryview(array.reshape(-1).view(np.uint8)))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class HubCheckpoint:
    """All tensors of a model directory: one `model.safetensors`, or shards listed by
    `model.safetensors.index.json`. Maps each tensor name to the file holding it."""

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        index = os.path.join(self.directory, INDEX)
        self.files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}
        if os.path.exists(index):
            try:
                with open(index) as fh:
                    weight_map = json.load(fh)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            for file in sorted(set(weight_map.values())):
                self.files[file] = SafetensorsFile(os.path.join(self.directory, file))
            for name, file in weight_map.items():
                if name not in self.files[file].names:
                    raise CheckpointError(f"{index}: names tensor {name} in {file}, which does not hold it")
                self.location[name] = file
            for file, st in self.files.items():
                for name in st.names:
                    if self.location.get(name) != file:
                        raise CheckpointError(f"{os.path.join(self.directory, file)}: holds tensor {name}, "
                                              f"which the index does not list there")
        else:
            files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no *.safetensors files and no index")
            if len(files) > 1:
                raise CheckpointError(f"{self.directory}: {len(files)} safetensors files but no {INDEX} to say "
                                      f"which is which")
            self.files[files[0]] = SafetensorsFile(os.path.join(self.directory, files[0]))
            self.location = {name: files[0] for name in self.files[files[0]].names}

    @property
    def names(self) -> list[str]:
        return list(self.location)

    def file_of(self, name: str) -> SafetensorsFile:
        return self.files[self.location[name]]

    def shape(self, name: str):
        return self.file_of(name).shape(name)

    def read(self, name: str) -> np.ndarray:
        return self.file_of(name).read(name)

    def path_of(self, name: str) -> str:
        return self.file_of(name).path
