"""Huge-page memory for prepacked weights (olv_runtime.kernels.arena) and the 2 MiB-piece writer
of compiled payload files (olv_runtime.models.compile._HugePageWriter)."""
from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from olv_runtime.kernels import arena
from olv_runtime.kernels.packed_i8 import prepack_int4_i8


@pytest.fixture
def fresh_arena(monkeypatch):
    monkeypatch.setitem(arena._state, "chunk", None)
    monkeypatch.setitem(arena._state, "used", 0)
    monkeypatch.delenv("OLV_WEIGHT_ARENA", raising=False)


def _chunk_of(a):
    b = a
    while b.base is not None and isinstance(b.base, np.ndarray):
        b = b.base
    return b


@pytest.mark.parametrize("shape,dtype", [((3, 5, 128), np.uint8), ((1000, 64), np.float32),
                                         ((7, 9, 8), np.uint16), ((33,), np.uint8)])
def test_weight_empty_shape_dtype_alignment(fresh_arena, shape, dtype):
    a = arena.weight_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % 64 == 0
    a[...] = 1  # every byte is ours
    assert int(a.reshape(-1)[-1]) == 1


def test_large_arrays_share_a_2mib_aligned_chunk(fresh_arena):
    a = arena.weight_empty((1 << 20,), np.uint8)  # >= MIN_BYTES: from a chunk
    b = arena.weight_empty((300_001,), np.uint8)
    c = arena.weight_empty((100, 1000), np.float32)
    assert _chunk_of(a) is _chunk_of(b) is _chunk_of(c)
    chunk = _chunk_of(a)
    start = arena._state["chunk"].ctypes.data
    assert start % arena.HUGE_PAGE == 0
    assert a.ctypes.data == start
    assert b.ctypes.data == start + (1 << 20)                     # packed, 64-byte aligned
    assert c.ctypes.data == start + (1 << 20) + 300_032
    a[:] = 7
    b[:] = 9
    c[:] = 3.0  # no overlap: writing one never changes another
    assert (a == 7).all() and (b == 9).all() and (c == 3.0).all()
    del chunk


def test_request_larger_than_a_chunk_gets_its_own_and_keeps_the_current(fresh_arena):
    small = arena.weight_empty((1 << 17,), np.uint8)
    current = arena._state["chunk"]
    big = arena.weight_empty((arena.CHUNK_BYTES + 5,), np.uint8)
    assert big.ctypes.data % arena.HUGE_PAGE == 0
    assert arena._state["chunk"] is current  # later small arrays continue the current chunk
    nxt = arena.weight_empty((1 << 17,), np.uint8)
    assert nxt.ctypes.data == small.ctypes.data + (1 << 17)


def test_small_arrays_and_disabled_arena_are_ordinary_allocations(fresh_arena, monkeypatch):
    a = arena.weight_empty((100,), np.uint8)
    assert arena._state["chunk"] is None and a.ctypes.data % 64 == 0
    monkeypatch.setenv("OLV_WEIGHT_ARENA", "0")
    b = arena.weight_empty((1 << 20,), np.uint8)
    assert arena._state["chunk"] is None and b.ctypes.data % 64 == 0


def test_prepack_results_do_not_depend_on_the_arena(fresh_arena, monkeypatch):
    rng = np.random.default_rng(0)
    n, k = 4104, 1024  # scale 262 KB: both arrays from the arena
    payload = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
    scale = rng.random((n, k // 32), dtype=np.float32).astype(np.float16)
    on = prepack_int4_i8(payload, scale, None, n, k, 32)
    assert _chunk_of(on.codes) is _chunk_of(on.scale)  # both from the arena's chunk
    monkeypatch.setenv("OLV_WEIGHT_ARENA", "0")
    off = prepack_int4_i8(payload, scale, None, n, k, 32)
    assert _chunk_of(off.codes) is not _chunk_of(on.codes)
    np.testing.assert_array_equal(on.codes, off.codes)
    np.testing.assert_array_equal(on.scale, off.scale)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_advise_huge_pages_on_linux(fresh_arena):
    a = np.empty(8 << 20, np.uint8)
    assert arena.advise_huge_pages(a) is True
    assert arena.advise_huge_pages(a[:10]) is False  # no whole page inside


class _Recorder(io.RawIOBase):
    def __init__(self):
        self.sizes, self.data = [], bytearray()

    def writable(self):
        return True

    def write(self, b):
        b = bytes(b)
        self.sizes.append(len(b))
        self.data += b
        return len(b)


def test_huge_page_writer_writes_whole_aligned_pieces():
    from olv_runtime.models.compile import _HugePageWriter

    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 256, s, dtype=np.uint8) for s in (10, 3 << 20, 64, 5 << 20, 7)]
    rec = _Recorder()
    with _HugePageWriter(rec) as w:
        for p in pieces:
            assert w.write(memoryview(p)) == p.size
        w.write(b"tail")
    want = b"".join(p.tobytes() for p in pieces) + b"tail"
    assert bytes(rec.data) == want
    assert all(s % arena.HUGE_PAGE == 0 for s in rec.sizes[:-1])  # all but the tail
    assert rec.sizes[-1] == len(want) % arena.HUGE_PAGE
