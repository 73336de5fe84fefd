"""The converter's building blocks: the transposing copy, the buffer pool, and reads that hash as they go."""

import dataclasses
import hashlib
import os

import ml_dtypes
import numpy as np
import pytest

from inkling_jax.checkpoint import chunks, orbax_io
from inkling_jax.checkpoint.hub_source import direct_span, open_for_reading, read_bytes
from inkling_jax.checkpoint.safetensors_io import CheckpointError
from inkling_jax.checkpoint.slabs import contiguous, transpose_into
from inkling_jax.checkpoint.streaming import POOL_GRAIN, BufferPool

DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32, np.float64, np.uint8]


def random_array(rng, shape, dtype):
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                                       np.ascontiguousarray(b).view(np.uint8))


# Shapes with 3+ tiles and bands on the tiled axes, lengths that are no multiple of them, rows of fewer bytes
# than a 16-byte word, and a leading expert axis.
@pytest.mark.parametrize("shape", [(37, 53), (600, 1032), (3, 40, 24), (2, 7, 5), (520, 264)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_views_copy_bit_exactly(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x = random_array(rng, shape, dtype)
    for view in (np.swapaxes(x, -1, -2), np.swapaxes(x[..., 0::2, :], -1, -2), np.swapaxes(x[..., 1::2, :], -1, -2)):
        out = contiguous(view, dtype)
        assert out.flags.c_contiguous and same_bits(out, view)
        into = np.empty(view.shape, dtype)
        assert transpose_into(np.swapaxes(view, -1, -2), into) is into and same_bits(into, view)


def test_contiguous_casts_and_fills_the_given_buffer():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((70, 40)).astype(ml_dtypes.bfloat16)
    out = np.empty((40, 70), np.float32)
    assert contiguous(x.T, np.float32, out) is out
    np.testing.assert_array_equal(out, x.T.astype(np.float32))
    assert contiguous(x, x.dtype) is x  # nothing to do: no copy


def test_buffer_pool_reuses_and_bounds_what_it_keeps():
    pool = BufferPool(keep_bytes=2 * POOL_GRAIN)
    first = pool.take(100)
    assert first.nbytes == POOL_GRAIN
    pool.give(first)
    assert pool.take(POOL_GRAIN) is first  # reused, not allocated again
    big = pool.take(POOL_GRAIN + 1)
    assert big.nbytes == 2 * POOL_GRAIN
    pool.give(first)
    pool.give(big)  # 3 grains free, 2 kept: the smallest goes
    assert pool.take(1) is big
    array = pool.array(big, (3, 5), np.float32)
    assert array.shape == (3, 5) and array.dtype == np.float32 and np.shares_memory(array, big)


def test_read_bytes_hashes_every_piece(tmp_path, monkeypatch):
    monkeypatch.setattr("inkling_jax.checkpoint.hub_source.READ_PIECE", 1000)  # several pieces
    data = np.random.default_rng(2).integers(0, 256, 5555, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    digest, buffer = hashlib.sha256(), np.zeros(8000, np.uint8)
    with open(path, "rb") as fh:
        got = read_bytes(fh.fileno(), 17, 5000, str(path), None, out=buffer, digest=digest)
    assert got.tobytes() == data[17:5017] and np.shares_memory(got, buffer)
    assert digest.hexdigest() == hashlib.sha256(data[17:5017]).hexdigest()


def test_direct_reads_return_the_requested_bytes(tmp_path, monkeypatch):
    """Unaligned ranges, the file's last page, several pieces; O_DIRECT where tmp_path's file system takes it."""
    monkeypatch.setattr("inkling_jax.checkpoint.hub_source.READ_PIECE", 8192)
    data = np.random.default_rng(3).integers(0, 256, 50_001, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd, direct = open_for_reading(str(path))
    pool = BufferPool(keep_bytes=POOL_GRAIN)
    try:
        for offset, size in [(0, 50_001), (5, 20_000), (4095, 2), (40_000, 10_001)]:
            digest, held = hashlib.sha256(), pool.take(direct_span(offset, size))
            got = read_bytes(fd, offset, size, str(path), None, out=held, digest=digest, direct=direct)
            assert got.tobytes() == data[offset:offset + size]
            assert digest.hexdigest() == hashlib.sha256(data[offset:offset + size]).hexdigest()
            pool.give(held)
    finally:
        os.close(fd)
    with open(path, "r+b") as fh:
        fh.truncate(30_000)
    fd, direct = open_for_reading(str(path))
    try:
        with pytest.raises(CheckpointError, match="truncated"):
            read_bytes(fd, 20_000, 20_000, str(path), "t", out=pool.take(direct_span(20_000, 20_000)), direct=direct)
    finally:
        os.close(fd)


@pytest.mark.parametrize("shape, chunk_shape, axis, step", [((5, 7), (2, 4), 0, 2), ((9, 2048), (9, 512), 1, 1024),
                                                       ((8, 2048), (2, 2048), 0, 4),
                                                       ((3, 6, 10), (1, 3, 10), 0, 1), ((), (), 0, 0)])
def test_write_region_writes_chunks_tensorstore_reads(tmp_path, shape, chunk_shape, axis, step):
    """Chunk files written directly (edge chunks padded, some aligned chunks written with no copy) read back
    through tensorstore as the array written, region by region along the streamed axis; read back by
    `chunks.read_region` with the crc32s `write_region` returned, they give the same array."""
    dtype = np.dtype(ml_dtypes.bfloat16)
    x = random_array(np.random.default_rng(4), shape, dtype)
    array = orbax_io.create_array(str(tmp_path), "p", shape, dtype, chunk_shape, orbax_io.context())
    regions = [()] if not shape else [tuple(slice(a, a + step) if d == axis else slice(None) for d in range(len(shape)))
                                      for a in range(0, shape[axis], step)]
    crcs = {}
    for index in regions:
        part = x[index]
        if part.ndim and part.nbytes % 4096 == 0:  # page-aligned, as the converter's transposed slabs are
            pool = BufferPool(keep_bytes=0)
            aligned = pool.array(pool.take(part.nbytes), part.shape, dtype)
            np.copyto(aligned, part)
            part = aligned
        crcs.update(chunks.write_region(array, index, part))
    back = orbax_io.open_array(str(tmp_path), "p", orbax_io.context())[()].read().result()
    assert same_bits(np.asarray(back), x)
    assert sorted(crcs) == array.grid()
    stored = dataclasses.replace(array, crc32=tuple(crcs[w] for w in array.grid()))
    assert same_bits(chunks.read_region(stored, tuple(slice(None) for _ in shape)), x)
