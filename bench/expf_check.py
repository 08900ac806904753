"""The compiled kernels' float32 exp (:func:`olv_runtime.kernels.activations.expf`) against
libm's ``expf`` on every float32 bit pattern, and the SiLU loop's time with each.

1. For all 2^32 bit patterns ``u`` (``--chunks`` parallel chunks, numba threads): ``x =
   float32(u)``, ``expf(x)`` against ``np.exp(x)`` in a numba loop, which calls the process's
   libm ``expf`` (glibc here). Equal means equal bits (NaNs too: a signalling NaN comes back
   quiet). Prints the mismatch count and the first mismatches (expected: 0).
2. SiLU, ``act = g * (1 / (exp(-g) + 1)) * u`` over 24 x 4864 elements (one token of a
   Qwen2.5-0.5B-shaped MLP, one thread): microseconds per token with ``np.exp`` (libm, scalar)
   and with :func:`expf` (vector loop), same inputs, bitwise equal outputs checked -- as one flat
   loop, and in the compiled step's form (64-element chunks of a ``[1, 2 * 4864]`` gate|up row:
   the inlined loop over 2-d indices the steps had, against
   :func:`~olv_runtime.kernels.activations.silu_mul_chunk` on the chunk's slices).

    python bench/expf_check.py [--chunks 512] [--skip-exhaustive]

Timings only (bench/, never asserted); about a minute on 2 cores for step 1.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit, prange

from olv_runtime.kernels.activations import expf, silu_mul_chunk
from olv_runtime.kernels.config import JIT


@njit(inline="always")
def _f32(u):
    return np.array([np.uint32(u)]).view(np.float32)[0]


@njit(parallel=True)
def _mismatches(lo, hi, nch, first):
    bad = np.zeros(nch, np.int64)
    for c in prange(nch):
        a = lo + c * (hi - lo) // nch
        b = lo + (c + 1) * (hi - lo) // nch
        for u in range(a, b):
            x = _f32(u)
            ref = np.exp(x)
            got = expf(x)
            rb = np.array([ref]).view(np.uint32)[0]
            gb = np.array([got]).view(np.uint32)[0]
            if rb != gb:
                if bad[c] < first.shape[1]:
                    first[c, bad[c]] = u
                bad[c] += 1
    return bad


@njit(**JIT)  # the kernels' flags (error_model='numpy': no zero-division branch)
def _silu_libm(g, u, out, reps):
    one = np.float32(1.0)
    for _ in range(reps):
        for j in range(g.shape[0]):
            gv = g[j]
            out[j] = (gv * (one / (np.exp(-gv) + one))) * u[j]


@njit(**JIT)
def _silu_expf(g, u, out, reps):
    one = np.float32(1.0)
    for _ in range(reps):
        for j in range(g.shape[0]):
            gv = g[j]
            out[j] = (gv * (one / (expf(-gv) + one))) * u[j]


@njit(inline="always", **JIT)
def _step_libm(gu, act, inter, j0, j1):  # the steps' SiLU before (decoder_layers._silu_mul)
    one = np.float32(1.0)
    for j in range(j0, j1):
        gv = gu[0, j]
        act[0, j] = (gv * (one / (np.exp(-gv) + one))) * gu[0, inter + j]


@njit(inline="always", **JIT)
def _step_chunk(gu, act, inter, j0, j1):  # now
    silu_mul_chunk(gu[0, j0:j1], gu[0, inter + j0:inter + j1], act[0, j0:j1])


@njit(**JIT)
def _layers_libm(gu, act, inter, reps):
    for _ in range(reps):
        for _layer in range(24):
            for c in range(0, inter, 64):
                _step_libm(gu, act, inter, c, min(c + 64, inter))


@njit(**JIT)
def _layers_chunk(gu, act, inter, reps):
    for _ in range(reps):
        for _layer in range(24):
            for c in range(0, inter, 64):
                _step_chunk(gu, act, inter, c, min(c + 64, inter))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--skip-exhaustive", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_exhaustive:
        t = time.perf_counter()
        first = np.zeros((args.chunks, 4), np.int64)
        bad = _mismatches(0, 1 << 32, args.chunks, first)
        n = int(bad.sum())
        print(f"expf vs libm expf, all 2^32 float32 bit patterns: {n} mismatches "
              f"({time.perf_counter() - t:.1f} s)")
        for c in np.nonzero(bad)[0][:4]:
            for u in first[c, :min(4, bad[c])]:
                x = np.array([u], np.uint32).view(np.float32)[0]
                print(f"  x = {x!r} (0x{int(u):08x}): libm {np.exp(x)!r}, expf {expf(x)!r}")
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(24 * 4864) * 3).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    o1, o2 = np.empty_like(g), np.empty_like(g)
    res = {}
    for name, f, o in (("libm np.exp", _silu_libm, o1), ("expf", _silu_expf, o2)):
        f(g, u, o, 1)
        best = min(_time(f, g, u, o) for _ in range(5))
        res[name] = best
    same = np.array_equal(o1.view(np.uint32), o2.view(np.uint32))
    print(f"SiLU of 24 x 4864 (one token, one thread): libm {res['libm np.exp'] * 1e6:.0f} us, "
          f"expf {res['expf'] * 1e6:.0f} us ({res['libm np.exp'] / res['expf']:.1f}x); "
          f"outputs bitwise equal: {same}")
    gu = (rng.standard_normal((1, 2 * 4864)) * 3).astype(np.float32)
    a1, a2 = np.empty((1, 4864), np.float32), np.empty((1, 4864), np.float32)
    res = {}
    for name, f, a in (("libm", _layers_libm, a1), ("chunk", _layers_chunk, a2)):
        f(gu, a, 4864, 1)
        res[name] = min(_time_layers(f, gu, a) for _ in range(5))
    same = np.array_equal(a1.view(np.uint32), a2.view(np.uint32))
    print(f"SiLU in the step's form (64-element chunks, 24 layers): inlined 2-d loop with np.exp "
          f"{res['libm'] * 1e6:.0f} us, silu_mul_chunk {res['chunk'] * 1e6:.0f} us "
          f"({res['libm'] / res['chunk']:.1f}x); outputs bitwise equal: {same}")
    return 0


def _time_layers(f, gu, a, reps=50):
    t = time.perf_counter()
    f(gu, a, 4864, reps)
    return (time.perf_counter() - t) / reps


def _time(f, g, u, o, reps=50):
    t = time.perf_counter()
    f(g, u, o, reps)
    return (time.perf_counter() - t) / reps


if __name__ == "__main__":
    raise SystemExit(main())
