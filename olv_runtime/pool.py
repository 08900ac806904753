"""Activation buffer pool: intermediate arrays are reused across steps and calls.

While a session runs a plan on a thread, operators and fused steps get their output arrays from
:func:`empty` (a drop-in for ``numpy.empty``), which takes them from that thread's
:class:`BufferPool`. The executor reference-counts every pool buffer held by a live value (views
included) and returns a buffer to the free list when the last value referring to it is released
(its last use in the plan). Graph outputs leave the pool (they belong to the caller); a caller
that is done with one may hand it back with :meth:`BufferPool.recycle` (``generate`` does this
with the logits), so a steady decode loop allocates nothing.

Outside a run, :func:`empty` is ``numpy.empty``.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

_local = threading.local()


#: ``dtype.str`` of the dtypes the kernels allocate, by the objects they pass (``np.float32``,
#: ``np.dtype(np.float32)``, ...): a pool lookup without making a dtype.
_DTYPE_STR = {t: np.dtype(t).str for t in (np.float32, np.float64, np.int64, np.int32, np.int8,
                                           np.uint8, np.uint16, np.float16, np.bool_)}
_DTYPE_STR.update({np.dtype(t): s for t, s in list(_DTYPE_STR.items())})


def owner(arr: np.ndarray) -> np.ndarray:
    base = arr.base
    while isinstance(base, np.ndarray):
        arr, base = base, base.base
    return arr


class BufferPool:
    """Free lists of arrays keyed by (shape, dtype), with per-buffer reference counts.

    Parameters
    ----------
    counters : Counters, optional
        Receives ``arrays_allocated`` / ``bytes_allocated`` for every new buffer.
    """

    def __init__(self, counters=None):
        self.counters = counters
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._held: dict[int, list] = {}  # id(buffer) -> [buffer, refcount]
        self._escaped: dict[int, weakref.ref] = {}
        self.total_bytes = 0  # bytes of every buffer this pool holds (free or handed out)

    # -- allocation -----------------------------------------------------------------------------
    def take(self, shape, dtype) -> np.ndarray:
        """A buffer of ``shape``/``dtype`` (contents undefined), reused when one is free."""
        dts = _DTYPE_STR.get(dtype)  # float32 / int64 ... given as numpy types: no np.dtype()
        if dts is None:
            dts = np.dtype(dtype).str
        if type(shape) is not tuple:
            shape = tuple(int(s) for s in shape)
        free = self._free.get((shape, dts))  # numpy ints hash and compare as ints
        if free:
            buf = free.pop()
        else:
            shape = tuple(int(s) for s in shape)
            buf = np.empty(shape, np.dtype(dtype))
            self.total_bytes += buf.nbytes
            if self.counters is not None and buf.nbytes:
                self.counters.add("arrays_allocated", 1)
                self.counters.add("bytes_allocated", buf.nbytes)
                self.counters.set_max("workspace_peak", self.total_bytes)
        self._held[id(buf)] = [buf, 0]
        return buf

    def owns(self, arr: np.ndarray) -> bool:
        """True if ``arr`` (or the array owning its memory) is a buffer handed out by this pool."""
        return id(owner(arr)) in self._held

    # -- reference counting by the executor -----------------------------------------------------
    def ref(self, value) -> None:
        if type(value) is np.ndarray:
            entry = self._held.get(id(value if value.base is None else owner(value)))
            if entry is not None:
                entry[1] += 1

    def unref(self, value) -> None:
        if type(value) is np.ndarray:
            key = id(value if value.base is None else owner(value))
            entry = self._held.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._held[key]
                    buf = entry[0]
                    self._free.setdefault((buf.shape, buf.dtype.str), []).append(buf)

    def escape(self, values) -> None:
        """Forget the buffers behind ``values`` (graph outputs handed to the caller)."""
        for v in values:
            if type(v) is np.ndarray:
                own = owner(v)
                if self._held.pop(id(own), None) is not None:
                    self._escaped[id(own)] = weakref.ref(own)
                    self.total_bytes -= own.nbytes

    def escape_one(self, arr: np.ndarray) -> None:
        """:meth:`escape` of one array that owns its memory (a buffer :meth:`take` made)."""
        key = id(arr)
        if arr.base is None and self._held.pop(key, None) is not None:
            self._escaped[key] = weakref.ref(arr)
            self.total_bytes -= arr.nbytes
        else:
            self.escape((arr,))

    def end_run(self) -> None:
        """Release every buffer still held (values that died unreleased, e.g. unused outputs)."""
        if not self._held:
            return
        for key in list(self._held):
            buf, _ = self._held.pop(key)
            self._free.setdefault((buf.shape, buf.dtype.str), []).append(buf)

    def abort_run(self) -> None:
        """After a failed run: forget held buffers (never reuse memory someone may still see)."""
        for buf, _ in self._held.values():
            self.total_bytes -= buf.nbytes
        self._held.clear()

    def recycle(self, arr: np.ndarray) -> bool:
        """Return a graph output the caller no longer uses to the free list.

        Only arrays that this pool handed out as outputs are taken back (others are ignored:
        returns False). The caller must not touch ``arr`` afterwards.
        """
        if type(arr) is not np.ndarray:
            return False
        own = owner(arr)
        ref = self._escaped.pop(id(own), None)
        if ref is None or ref() is not own:
            return False
        self._free.setdefault((own.shape, own.dtype.str), []).append(own)
        self.total_bytes += own.nbytes
        return True

    @property
    def free_bytes(self) -> int:
        """Bytes held in free lists."""
        return sum(b.nbytes for lst in self._free.values() for b in lst)


def activate(pool: BufferPool | None):
    """Make ``pool`` this thread's current pool; returns the previous one (for :func:`restore`)."""
    prev = getattr(_local, "pool", None)
    _local.pool = pool
    return prev


def restore(prev) -> None:
    _local.pool = prev


def current() -> BufferPool | None:
    """This thread's active pool, or None outside a run."""
    return getattr(_local, "pool", None)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """``numpy.empty`` from the current thread's pool (plain ``numpy.empty`` outside a run)."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        return np.empty(shape, dtype)
    return pool.take(shape, dtype)
