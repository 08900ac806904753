"""The pieces of one kv head's decode attention in the compiled steps (kernels/attention.py),
timed alone: scores (``q . k``, 16 keys at a time), the online softmax, ``o += p @ V``
(``_accum_rows``) and the whole ``_attend_rows`` -- for the GQA group of Qwen2.5-0.5B (7 query
heads per kv head, D 64) over ``--keys`` cached keys, one thread, hot in cache. Per kv head and
``x 2 kv heads x 24 layers`` per token.

    python bench/attention_parts.py [--keys 130] [--reps 20000]

Timings only (bench/, never asserted).
"""
from __future__ import annotations

import argparse
import importlib
import time

import numpy as np
from numba import njit

A = importlib.import_module("olv_runtime.kernels.attention")
NG, D = 7, 64


@njit
def _full(reps, t, qg, k, v, sc, p, mx, m, l, o):
    for _ in range(reps):
        A._state_init(m, l, o, NG)
        A._attend_rows(qg, NG, k, v, 0, t, np.float32(0.125), m, l, o, sc, p, mx)


@njit
def _scores(reps, t, qg, k, sc, mx):
    for _ in range(reps):
        for t0 in range(0, t, A.TILE):
            nt = min(A.TILE, t - t0)
            A._tile_max_init(mx, NG)
            A._scores_rows(qg, NG, k, t0, nt, np.float32(0.125), sc, 0, mx)


@njit
def _softmax(reps, t, sc, mx, m, l, o, p):
    for _ in range(reps):
        for t0 in range(0, t, A.TILE):
            A._softmax_tile(sc, NG, min(A.TILE, t - t0), mx, m, l, o, p)


@njit
def _accum(reps, t, p, v, o):
    for _ in range(reps):
        for t0 in range(0, t, A.TILE):
            A._accum_rows(p, 0, NG, v, t0, min(A.TILE, t - t0), o, np.float32(1.0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=130)
    ap.add_argument("--reps", type=int, default=20000)
    args = ap.parse_args(argv)
    t = args.keys
    rng = np.random.default_rng(0)
    qg = rng.standard_normal((NG, D)).astype(np.float32)
    k = rng.standard_normal((t, D)).astype(np.float32)
    v = rng.standard_normal((t, D)).astype(np.float32)
    sc = np.zeros((NG, A.TILE + A.SLACK), np.float32)
    p = rng.random(sc.shape).astype(np.float32)
    mx, m, l = (np.zeros(NG, np.float32) for _ in range(3))
    o = np.zeros((NG, D), np.float32)
    A._state_init(m, l, o, NG)
    cases = [("whole _attend_rows", _full, (t, qg, k, v, sc, p, mx, m, l, o)),
             ("scores", _scores, (t, qg, k, sc, mx)),
             ("online softmax", _softmax, (t, sc, mx, m, l, o, p)),
             ("o += p @ V", _accum, (t, p, v, o))]
    print(f"one kv head: {NG} query heads, D {D}, {t} keys, one thread")
    for name, f, a in cases:
        f(1, *a)
        t0 = time.perf_counter()
        f(args.reps, *a)
        dt = (time.perf_counter() - t0) / args.reps
        print(f"{name:>20}: {dt * 1e6:6.2f} us per kv head, {dt * 48e6:5.0f} us per token "
              f"(2 kv heads x 24 layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
