"""Contiguous KV cache capacity buffers with in-place append (seed 000 PR05).

A present key/value tensor ``[B, KVH, T, D]`` produced by ``Attention`` is a read-only view
``cap[:, :, :T]`` of a capacity buffer ``cap`` of shape ``[B, KVH, CAP, D]``. The registry here
remembers, per capacity buffer, its *committed* length: the end of the longest prefix any view
handed out so far covers. Appending ``S`` tokens to a past view of length ``T`` is done in place
(writing only the slots ``[T, T+S)``) exactly when the past is a prefix view of a registered
buffer whose committed length is ``T`` and which has room for ``S`` more tokens. Then no other
view can see the slots written: earlier returned views (length <= T) stay valid, and a second
state holding the same length-``T`` view finds the committed length moved on and copies the prefix
into a new buffer instead of overwriting ("the first append that would alias copies").

Otherwise a new buffer is allocated with capacity ``max(T + S, initial_capacity,
ceil(CAP * growth))`` and the prefix is copied once (counted).

Bookkeeping lives here, in plain Python; kernels see only arrays.
"""
from __future__ import annotations

import itertools
import math
import operator
import threading
import weakref
from collections import deque as _consume

import numpy as np

from olv_runtime import kernels
from olv_runtime.counters import Counters

# re-entrant: a garbage collection while the lock is held (e.g. inside weakref.finalize in
# _register) may run _forget for a dead buffer on the same thread; a plain Lock deadlocked
_lock = threading.RLock()
_committed: dict[int, list] = {}  # id(buffer) -> [weakref(buffer), committed length]


def _forget(key: int) -> None:
    with _lock:
        _committed.pop(key, None)


def _register(buf: np.ndarray, length: int) -> None:
    key = id(buf)
    # [weakref(buffer), committed length, address of the first element]
    _committed[key] = [weakref.ref(buf), length, buf.__array_interface__["data"][0]]
    weakref.finalize(buf, _forget, key)


def committed_length(view: np.ndarray) -> int | None:
    """Committed length of the capacity buffer behind ``view`` (None if not a KV buffer)."""
    owner = view.base
    if owner is None:
        return None
    with _lock:
        entry = _committed.get(id(owner))
        if entry is None or entry[0]() is not owner:
            return None
        return entry[1]


def _prefix_owner(past: np.ndarray):
    """The registered capacity buffer of which ``past`` is the leading ``[:, :, :T]`` view."""
    owner = past.base
    if owner is None or owner.ndim != 4:
        return None, None
    entry = _committed.get(id(owner))
    if entry is None or entry[0]() is not owner:
        return None, None
    if (past.__array_interface__["data"][0] != entry[2] or past.strides != owner.strides or past.shape[:2] != owner.shape[:2]
            or past.shape[3] != owner.shape[3]):
        return None, None
    return owner, entry


def entry_of(buffer: np.ndarray) -> list:
    """The registry entry ``[weakref, committed length, address]`` of a capacity buffer made by
    :func:`reserve` (for :func:`claim_all`; KeyError for another array)."""
    with _lock:
        return _committed[id(buffer)]


def claim_all(entries: list, t: int, s: int) -> bool:
    """Claim slots ``[t, t + s)`` of several capacity buffers at once (the compiled decode step's
    per-token append): when every entry's committed length is ``t``, set each to ``t + s`` and
    return True; otherwise change nothing and return False (the caller then reserves buffer by
    buffer). The caller holds the buffers (alive) and checked their capacity."""
    n = len(entries)
    with _lock:  # (C-level loops: this runs once per decode token over every layer's buffers)
        if list(map(_LENGTH, entries)).count(t) != n:
            return False
        _consume(map(operator.setitem, entries, itertools.repeat(1, n),
                     itertools.repeat(t + s, n)), 0)
    return True


_LENGTH = operator.itemgetter(1)  # an entry's committed length


def reserve(past: np.ndarray, s: int, *, initial_capacity: int = 256, growth: float = 2.0,
            counters: Counters | None = None) -> tuple[np.ndarray, int]:
    """Find or make the capacity buffer that ``S`` new tokens after ``past`` are written into.

    Parameters
    ----------
    past : ndarray of float32, shape [B, KVH, T, D]
        The past cache (any strides).
    s : int
        New tokens.
    initial_capacity, growth, counters
        As :func:`append`.

    Returns
    -------
    buffer : ndarray of float32, shape [B, KVH, CAP, D], C-contiguous, ``CAP >= T + S``
        ``past``'s own buffer when it is an exclusive prefix view with room (in place), else a
        new buffer holding a copy of the ``T`` past tokens. Slots ``[T, T+S)`` are claimed for
        the caller (the committed length is ``T + S``).
    t : int
        ``T``, the slot of the first new token.
    """
    b, kvh, t, d = past.shape
    with _lock:
        owner, entry = _prefix_owner(past)
        if owner is not None and entry[1] == t and owner.shape[2] >= t + s:
            entry[1] = t + s  # claim the slots before writing them
            return owner, t
    old_cap = owner.shape[2] if owner is not None else 0
    cap = max(t + s, int(initial_capacity), int(math.ceil(old_cap * growth)))
    buf = np.empty((b, kvh, cap, d), np.float32)
    if t:
        buf[:, :, :t] = past
    with _lock:
        _register(buf, t + s)
    if counters is not None:
        counters.add("arrays_allocated", 1)
        counters.add("bytes_allocated", buf.nbytes)
        counters.add("kv_reallocations", 1)
        counters.add("bytes_copied_kv_prefix", past.nbytes)
    return buf, t


def present(buffer: np.ndarray, length: int) -> np.ndarray:
    """The read-only ``[B, KVH, length, D]`` prefix view of a capacity buffer."""
    view = buffer[:, :, :length]
    view.flags.writeable = False
    return view


def append(past: np.ndarray, new: np.ndarray, *, initial_capacity: int = 256,
           growth: float = 2.0, counters: Counters | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Append ``S`` new tokens to a past K (or V) cache.

    Parameters
    ----------
    past : ndarray of float32, shape [B, KVH, T, D]
        The past cache (any strides; a view from a previous call appends in place).
    new : ndarray of float32, shape [B, S, KVH*D], C-contiguous
        New keys/values (ONNX 3-D layout).
    initial_capacity : int
        Minimum token capacity of a newly allocated buffer.
    growth : float
        Capacity multiplier when a buffer is outgrown (>= 1).
    counters : Counters, optional
        Receives ``bytes_copied_kv_append`` (new tokens), ``bytes_copied_kv_prefix`` and
        ``kv_reallocations`` (prefix copies into new buffers), ``arrays_allocated`` /
        ``bytes_allocated``.

    Returns
    -------
    present : ndarray, shape [B, KVH, T+S, D]
        Read-only view of the capacity buffer.
    buffer : ndarray, shape [B, KVH, CAP, D]
        The capacity buffer (contiguous), for kernels that read the cache.
    """
    buf, t = reserve(past, new.shape[1], initial_capacity=initial_capacity, growth=growth,
                     counters=counters)
    kernels.kv_write(buf, new, t)
    if counters is not None:
        counters.add("bytes_copied_kv_append", new.nbytes)
    return present(buf, t + new.shape[1]), buf
