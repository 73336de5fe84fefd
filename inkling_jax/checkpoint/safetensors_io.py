"""A small, strict reader and writer of the safetensors format, without torch.

Tensors are memory-mapped numpy views (bf16 and fp8 through ml_dtypes), so a multi-terabyte checkpoint is read
one tensor at a time. Every header is checked at least as strictly as the reference reader checks it (the
`safetensors` package): a JSON object of well-formed entries, and tensor data that covers the file exactly,
contiguous from the first byte to the last, each tensor's bytes its dtype and shape. A truncated or hostile shard
is an error naming the file and the tensor, not garbage weights.
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
MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit


class CheckpointError(ValueError):
    """A checkpoint file or index that cannot be read as it claims to be."""


def _is_sizes(value) -> bool:
    """A JSON list of non-negative integers (JSON's true and false are not integers here)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _check_entry(where: str, name: str, entry) -> None:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: tensor {name}: header entry {entry!r:.60} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{where}: tensor {name} has unsupported dtype {dtype!r:.40}")
    if not _is_sizes(shape):
        raise CheckpointError(f"{where}: tensor {name}: shape {shape!r:.60} is not a list of non-negative integers")
    if not (_is_sizes(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: tensor {name}: data_offsets {offsets!r:.60} is not [begin, end] with "
                              f"0 <= begin <= end")
    expected = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(f"{where}: tensor {name} spans {offsets[1] - offsets[0]} bytes, its shape needs "
                              f"{expected}")


def parse_header(raw: bytes, where: str, file_size: int | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """The tensor entries ({name: {"dtype", "shape", "data_offsets"}}) and the `__metadata__` of a safetensors
    header (`raw`: the JSON after the length prefix). Tensors must lie back to back from data byte 0, with no
    overlap and no gap, and, when `file_size` is given, end exactly where the file ends. `where` names the file
    in errors."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: corrupt safetensors header (not UTF-8)") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{where}: __metadata__ {metadata!r:.60} does not map names to strings")
    for name, entry in header.items():
        _check_entry(where, name, entry)
    data_start, end, previous = 8 + len(raw), 0, None
    for name in sorted(header, key=lambda n: header[n]["data_offsets"]):
        begin, stop = header[name]["data_offsets"]
        if begin != end:
            what = f"overlaps tensor {previous}" if begin < end else f"leaves bytes {end}..{begin} unused"
            raise CheckpointError(f"{where}: tensor {name} at data bytes {begin}..{stop} {what} (tensors must lie "
                                  f"back to back from byte 0)")
        if file_size is not None and data_start + stop > file_size:
            raise CheckpointError(f"{where}: truncated: tensor {name} ends at byte {data_start + stop} but the file "
                                  f"has {file_size} bytes")
        end, previous = stop, name
    if file_size is not None and data_start + end != file_size:
        raise CheckpointError(f"{where}: {file_size - data_start - end} bytes follow the last tensor's data (a "
                              f"safetensors file ends with its last tensor)")
    return header, metadata


class SafetensorsFile:
    """The tensors of one .safetensors file: `names`, `shape(name)`, `dtype(name)`, `read(name)`."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                raw = fh.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
                (header_len,) = struct.unpack("<Q", raw)
                if header_len > MAX_HEADER_BYTES:
                    raise CheckpointError(f"{self.path}: header length {header_len} is over the safetensors limit "
                                          f"of {MAX_HEADER_BYTES} bytes: not a safetensors file")
                if header_len > size - 8:
                    raise CheckpointError(f"{self.path}: truncated (header of {header_len} bytes, file {size})")
                raw = fh.read(header_len)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        except IsADirectoryError:
            raise CheckpointError(f"{self.path}: a directory, where a safetensors file was expected") from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        self._entries, self.metadata = parse_header(raw, self.path, size)
        self.data_start = 8 + header_len

    def _entry(self, name: str) -> dict:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name}") from None

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self._entry(name)["dtype"]])

    def nbytes(self, name: str) -> int:
        begin, end = self.data_range(name)
        return end - begin

    def data_range(self, name: str) -> tuple[int, int]:
        """Absolute byte range [begin, end) of a tensor's data in the file."""
        begin, end = self._entry(name)["data_offsets"]
        return self.data_start + begin, self.data_start + end

    def read(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of one tensor."""
        entry = self._entry(name)
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


def read_index(directory: str) -> dict[str, str] | None:
    """The weight map ({tensor: file}) of `model.safetensors.index.json` in `directory`, or None without one.
    Each file must be a plain name in `directory` (an index cannot send reads elsewhere)."""
    path = os.path.join(directory, INDEX)
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as fh:
            index = json.load(fh)
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise CheckpointError(f"{path}: not a safetensors index ({' '.join(str(e).split())})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: not a safetensors index (no weight_map object)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or os.path.basename(file) != file:
            raise CheckpointError(f"{path}: puts tensor {name} in {file!r:.80}, which is not a file name")
    return weight_map


class HubCheckpoint:
    """All tensors of a model directory: one `model.safetensors`, or shards listed by
    `model.safetensors.index.json`. Maps each tensor name to the file holding it."""

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory}: not a directory" + (
                " (a model directory is expected, not a file in it)" if os.path.exists(self.directory) else ""))
        weight_map = read_index(self.directory)
        self.files: dict[str, SafetensorsFile] = {}
        self.location: dict[str, str] = {}
        if weight_map is not None:
            index = os.path.join(self.directory, INDEX)
            by_file: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                by_file.setdefault(file, []).append(name)
            for file, names in sorted(by_file.items()):
                path = os.path.join(self.directory, file)
                if not os.path.lexists(path):
                    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                    raise CheckpointError(f"{path}: file not found; the index puts tensor {sorted(names)[0]}{more} "
                                          f"there")
                self.files[file] = SafetensorsFile(path)
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
        try:
            return self.files[self.location[name]]
        except KeyError:
            raise CheckpointError(f"{self.directory}: no tensor {name}") from None

    def shape(self, name: str):
        return self.file_of(name).shape(name)

    def dtype(self, name: str) -> np.dtype:
        return self.file_of(name).dtype(name)

    def read(self, name: str) -> np.ndarray:
        return self.file_of(name).read(name)

    def path_of(self, name: str) -> str:
        return self.file_of(name).path
