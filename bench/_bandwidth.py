"""Streaming-read bandwidth: the physical limit decode benchmarks are compared against.

One numba kernel shared by every benchmark script: ``stream_sum`` sums a uint64 array with
``nt`` threads, each reading a contiguous range (16 independent accumulators per thread, so
the loop is bound by memory, not by the add latency).
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from olv_runtime.kernels import config  # noqa: F401  (same threading layer as the runtime)


@njit(parallel=True, cache=True)
def stream_sum(a, nt):
    """Sum of ``a`` (uint64 ``[rows, 16]``) read by ``nt`` threads in contiguous ranges."""
    n = a.shape[0]
    out = np.zeros((nt, 16), np.uint64)
    for t in prange(nt):
        lo = t * n // nt
        hi = (t + 1) * n // nt
        for i in range(lo, hi):
            for j in range(16):
                out[t, j] += a[i, j]
    s = np.uint64(0)
    for t in range(nt):
        for j in range(16):
            s += out[t, j]
    return s


def stream_bandwidth(nbytes: int = 1 << 30, reps: int = 7, threads: int | None = None):
    """(best, median) GB/s of summing ``nbytes`` with ``threads`` numba threads."""
    import numba

    nt = threads or numba.get_num_threads()
    a = np.ones(nbytes, np.uint8).view(np.uint64).reshape(-1, 16)
    stream_sum(a, nt)
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        stream_sum(a, nt)
        rates.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    return max(rates), float(np.median(rates))
