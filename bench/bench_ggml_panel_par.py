"""Benchmark: ggml int8 prefill with 2 threads, ``linear_ggml_i8`` (the panel dispatch of
kernels/ggml_panel.py) against a copy of the parallel driver as it was before it (ggml_gemm's
4-row kernels), alternating in one process, best of 9 rounds of 2 calls, bitwise equal outputs
asserted. M = 128, Qwen2.5-0.5B shapes (Q4_K with K rounded to 1024). Not run by the tests.

    python bench/bench_ggml_panel_par.py
"""
from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from olv_runtime.kernels import config
from olv_runtime.kernels import ggml_gemm as gg
from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels.packed_i8 import quantize_rows_i8, store_group
from bench_ggml_gemm import random_blocks  # bench/: the same random valid blocks

CASES = (("Q5_0", 896, 896), ("Q5_0", 4864, 896), ("Q5_0", 896, 4864), ("Q6_K", 896, 4864),
         ("Q4_K", 4864, 1024))


@njit(**config.PJIT)
def _old_par(kind, data, x, m, k, n, out, ntasks, xq, xd, xs8, xs16, xsum, facc):
    quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, True)
    ng = data.shape[0]
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        mb = gg.block_rows(xq.shape[1])
        for ib in range(0, m, mb):
            ie = min(m, ib + mb)
            for g in range(g0, g1):
                i0 = ib
                while ie - i0 >= gg.ROWS:
                    accs = gg.rows_i8(kind, data, g, xq, xd, xs8, xs16, i0, False)
                    for r in range(gg.ROWS):
                        store_group(accs[r], facc[task], g, i0 + r, n, out)
                    i0 += gg.ROWS
                for i in range(i0, ie):
                    acc = gp._row_i8(kind, data, g, xq, xd, xs8, xs16, i, False)
                    store_group(acc, facc[task], g, i, n, out)


def measure(name, n, k, m, rounds, rng):
    """(ggml_gemm, panel) GMAC/s, best of ``rounds`` alternating rounds."""
    pk = gp.prepack_ggml(name, random_blocks(name, n, k, rng), n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = gp.make_workspace_ggml(m, k, 2)
    y0 = np.empty((m, n), np.float32)
    y1 = np.empty((m, n), np.float32)

    def old():
        _old_par(pk.kind, pk.data, x, m, k, n, y0, 2, ws.xq, ws.xd, ws.xs8, ws.xs16, ws.xsum,
                 ws.facc)

    def new():
        gp.linear_ggml_i8(x, pk, y1, ws)
    old()
    new()
    assert np.array_equal(y0.view(np.uint32), y1.view(np.uint32))
    best = [np.inf, np.inf]
    for _ in range(rounds):
        for v, f in enumerate((old, new)):
            t0 = time.perf_counter()
            f()
            f()
            best[v] = min(best[v], (time.perf_counter() - t0) / 2)
    return [m * n * k / b / 1e9 for b in best]


def main(m=128, rounds=9):
    numba.set_num_threads(2)
    rng = np.random.default_rng(0)
    for name, n, k in CASES:
        g = measure(name, n, k, m, rounds, rng)
        print(f"{name} {n}x{k} M={m} 2 threads GMAC/s ggml_gemm {g[0]:.1f} panel {g[1]:.1f} "
              f"ratio {g[1] / g[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
