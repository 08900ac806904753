"""Streaming-read bandwidth: the physical limit decode benchmarks are compared against.

The bound must come from a read kernel that really streams at the machine's rate, so this module
measures several read kernels over the same buffer and keeps the fastest (DESIGN.md §4: a
vectorised float32 sum reaches 31-34 GB/s here; numpy's ``sum`` about 24 GB/s on one thread; a
uint64 loop LLVM does not vectorise only about 9 GB/s, which once made a bound 3.5x too low):

* ``f32``: float32 sum with ``fastmath`` (reassociation lets LLVM vectorise it into several
  ``vaddps`` chains), each of the ``nt`` threads summing one contiguous range;
* ``u32``: the same with wrapping uint32 adds (``vpaddd``; no floating point, so the bytes may be
  anything -- weight payloads with NaN/denormal bit patterns included);
* ``numpy``: ``numpy.sum`` of the float32 view (one thread), the independent cross-check.

Each parallel kernel calls a serial per-range function on a slice (the loop LLVM vectorises; the
same loop written inline in the ``prange`` body is not vectorised by numba 0.68 here).
:func:`stream_bandwidth` returns the best variant and every variant's figure;
:func:`stream_sum` is the fastest integer kernel, for scripts that stream their own buffers
(e.g. to evict caches). :func:`check_vectorised` inspects the assembly for vector adds.

On this machine kind the 2 vCPUs move over the host and the 2-thread streaming read swings
between ~33 and ~58 GB/s from one minute to the next, so a "% of stream" is only meaningful
against a stream figure of the same moment: :class:`StreamProbe` keeps one buffer and measures
the streaming read on demand, for benchmarks that interleave it with their own timed calls.
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from olv_runtime.kernels import config  # noqa: F401  (same threading layer as the runtime)

__all__ = ["stream_sum", "stream_bandwidth", "StreamProbe", "check_vectorised", "above_bound"]


@njit(fastmath=True, cache=True, nogil=True)
def _range_f32(a):
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i]
    return s


@njit(cache=True, nogil=True)
def _range_u32(a):
    s = np.uint32(0)
    for i in range(a.shape[0]):
        s += a[i]
    return s


@njit(parallel=True, fastmath=True, cache=True)
def _sum_f32(a, nt):
    n = a.shape[0]
    out = np.zeros(nt, np.float32)
    for t in prange(nt):
        out[t] = _range_f32(a[t * n // nt:(t + 1) * n // nt])
    s = np.float32(0.0)
    for t in range(nt):
        s += out[t]
    return s


@njit(parallel=True, cache=True)
def _sum_u32(a, nt):
    n = a.shape[0]
    out = np.zeros(nt, np.uint32)
    for t in prange(nt):
        out[t] = _range_u32(a[t * n // nt:(t + 1) * n // nt])
    s = np.uint32(0)
    for t in range(nt):
        s += out[t]
    return s


def _flat(a: np.ndarray, dtype) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError("stream_sum: expected a C-contiguous array")
    flat = a.reshape(-1).view(np.uint8)
    n = flat.size // np.dtype(dtype).itemsize * np.dtype(dtype).itemsize
    return flat[:n].view(dtype)


def stream_sum(a: np.ndarray, nt: int):
    """Read every byte of ``a`` (any dtype, C-contiguous) with ``nt`` threads: wrapping uint32 sum
    over contiguous per-thread ranges (vectorised ``vpaddd``). Returns the sum (to keep it live)."""
    return _sum_u32(_flat(a, np.uint32), int(nt))


def _time(fn, reps):
    fn()  # warm-up (compilation, first touch)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def stream_bandwidth(nbytes: int = 1 << 30, reps: int = 7, threads: int | None = None,
                     detail: bool = False):
    """Streaming-read bandwidth in GB/s (1e9 bytes/s) of the fastest read kernel.

    Parameters
    ----------
    nbytes : int
        Buffer size (default 1 GiB, far beyond the caches).
    reps : int
        Timed repetitions per variant (after one warm-up).
    threads : int, optional
        Threads of the parallel variants (default: numba's current count).
    detail : bool
        Also return ``{variant: (best, median)}``.

    Returns
    -------
    (best, median) or (best, median, variants)
        ``best``/``median`` of the fastest variant (by best time). ``numpy`` is single-threaded.
    """
    import numba

    nt = int(threads or numba.get_num_threads())
    raw = np.ones(nbytes, np.uint8)
    f32 = raw.view(np.float32)
    u32 = raw.view(np.uint32)
    variants = {}
    for name, fn in (("f32", lambda: _sum_f32(f32, nt)), ("u32", lambda: _sum_u32(u32, nt)),
                     ("numpy", lambda: f32.sum())):
        ts = _time(fn, reps)
        variants[name] = (nbytes / min(ts) / 1e9, nbytes / float(np.median(ts)) / 1e9)
    best_name = max(variants, key=lambda k: variants[k][0])
    best, med = variants[best_name]
    if detail:
        return best, med, variants
    return best, med


class StreamProbe:
    """The streaming read of :func:`stream_bandwidth` on demand, for interleaving with other
    timed work (a figure of the same minutes as the work it is compared with).

    Parameters
    ----------
    nbytes : int
        Buffer size (default 1 GiB: the full streaming read, far beyond the caches).
    threads : int, optional
        Threads of the read kernels (default: numba's current count).

    :meth:`rate` reads the whole buffer ``reps`` times with each multi-threaded variant
    (``f32``, ``u32``; ``numpy`` is single-threaded and never the fastest here) and returns the
    best rate in GB/s (1e9 bytes/s).
    """

    def __init__(self, nbytes: int = 1 << 30, threads: int | None = None):
        import numba

        self.nbytes = int(nbytes)
        self.nt = int(threads or numba.get_num_threads())
        self._raw = np.ones(self.nbytes, np.uint8)
        f32 = self._raw.view(np.float32)
        u32 = self._raw.view(np.uint32)
        nt = self.nt
        self._fns = (lambda: _sum_f32(f32, nt), lambda: _sum_u32(u32, nt))
        for fn in self._fns:
            fn()  # compile / load, first touch

    def rate(self, reps: int = 2) -> float:
        """Best streaming-read rate (GB/s) of ``reps`` reads per variant, measured now."""
        best = float("inf")
        for _ in range(int(reps)):
            for fn in self._fns:
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        return self.nbytes / best / 1e9


def check_vectorised() -> dict:
    """``{kernel: True/False}``: does the compiled per-range loop use 256/512-bit vector adds?"""
    out = {}
    for name, fn, sig_arr in (("f32", _range_f32, np.ones(64, np.float32)),
                              ("u32", _range_u32, np.ones(64, np.uint32))):
        fresh = njit(fastmath=(name == "f32"))(fn.py_func)  # cached code cannot be inspected
        fresh(sig_arr)
        asm = fresh.inspect_asm(fresh.signatures[0])
        op = "vaddps" if name == "f32" else "vpadd"
        out[name] = any(op in line and ("zmm" in line or "ymm" in line) for line in asm.splitlines())
    return out


def above_bound(rate: float, bound: float, tol: float = 0.02) -> bool:
    """True when ``rate`` exceeds ``bound`` by more than ``tol`` (the table must say so)."""
    return bool(np.isfinite(rate) and np.isfinite(bound) and rate > bound * (1.0 + tol))
