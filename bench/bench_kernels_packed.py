"""Benchmark of the packed INT4 linear kernels (kernels.dispatch: 8-row groups), plain script.

    python bench/bench_kernels_packed.py [--threads 2] [--reps 30] [--quick]

Prints, for the Qwen2.5-0.5B shapes, weight GB/s (packed.nbytes / time) at M = 1 in both modes,
GFLOP/s (2*M*N*K / time) at M = 4, 32, 128, and beside them a measured streaming-read bandwidth
(numba parallel sum over a 1 GiB array, same threads). Timings are the best (min) and the median
of ``--reps`` calls after a warm-up; the machine may be shared, so the min is the cleaner figure.
Not run by the test command.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from _bandwidth import stream_sum
from numba import njit, prange

from olv_runtime.kernels import config  # noqa: F401  (threading layer selection)
from olv_runtime.kernels.linear import linear_int4
from olv_runtime.kernels.dispatch import LinearMode, WeightFormat, dispatch
from olv_runtime.kernels.packed_i8 import isa, prepack_int4_i8

SHAPES = {  # name: (N, K)
    "q": (896, 896), "k/v": (128, 896), "o": (896, 896),
    "gate/up": (4864, 896), "down": (896, 4864), "lm_head": (151936, 896),
}


_stream_sum = stream_sum  # bench/_bandwidth.py


def stream_bandwidth(nbytes=1 << 30, reps=7):
    a = np.ones(nbytes, np.uint8).view(np.uint64).reshape(-1, 16)
    nt = numba.get_num_threads()
    _stream_sum(a, nt)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _stream_sum(a, nt)
        ts.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9, nbytes / float(np.median(ts)) / 1e9


def timeit(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), float(np.median(ts))


def make_weight(n, k, rng, zp=False):
    kb = -(-k // 32)
    payload = rng.integers(0, 256, size=(n * k + 1) // 2, dtype=np.uint8)
    scale = (rng.random((n, kb), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
    z = rng.integers(-8, 8, size=(n, kb)).astype(np.int8) if zp else None
    return payload, scale, z


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="M=1 only, no baseline kernel")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bw_best, bw_med = stream_bandwidth()
    print(f"threads={args.threads} layer={config.threading_layer()} "
          f"streaming read: best {bw_best:.1f} GB/s, median {bw_med:.1f} GB/s")
    ms = [1] if args.quick else [1, 4, 32, 128]
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        payload, scale, _ = make_weight(n, k, rng)
        t0 = time.perf_counter()
        pk = prepack_int4_i8(payload, scale, None, n, k, 32)
        tprep = time.perf_counter() - t0
        reps = max(3, args.reps // 10) if n > 100000 else args.reps
        ncopy = max(1, int(np.ceil(256e6 / pk.nbytes)))
        pks = [pk] + [pk.copy() for _ in range(ncopy - 1)]
        print(f"\n{name} N={n} K={k} packed {pk.nbytes / 1e6:.2f} MB (prepack {tprep * 1e3:.0f} ms, "
              f"{ncopy} copies cycled)")
        for m in ms:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), np.float32)
            row = [f"  M={m:<4d}"]
            for qa in (False, True):
                entry = dispatch(isa(), LinearMode.INT8 if qa else LinearMode.EXACT,
                                 WeightFormat.INT4)
                ws = entry.make_workspace(m, k)
                it = iter(range(1 << 30))

                def call():  # cycle through copies so the weights stream from DRAM as in decode
                    p = pks[next(it) % len(pks)]
                    entry.fn(x, p, out, workspace=ws)
                best, med = timeit(call, reps)
                tag = "quant" if qa else "exact"
                if m == 1:
                    row.append(f"{tag}: {pk.nbytes / best / 1e9:5.1f} GB/s "
                               f"(med {pk.nbytes / med / 1e9:5.1f}, {best * 1e6:7.0f} us)")
                else:
                    row.append(f"{tag}: {2 * m * n * k / best / 1e9:6.1f} GFLOP/s "
                               f"(med {2 * m * n * k / med / 1e9:6.1f}, {best * 1e3:7.2f} ms)")
            if not args.quick and m in (1, 32):
                best, med = timeit(lambda: linear_int4(x, payload, scale, None, n, k, 32, out),
                                   max(3, reps // 3))
                row.append(f"row-major linear_int4: {(n * k // 2 + scale.nbytes) / best / 1e9:5.1f} GB/s")
            print("  ".join(row))
    bw_best, bw_med = stream_bandwidth()
    print(f"\nstreaming read again: best {bw_best:.1f} GB/s, median {bw_med:.1f} GB/s")


if __name__ == "__main__":
    main()
