"""Benchmark: what one call per tile costs in the int8 prefill / batched-decode GEMMs.

    python bench/bench_gemm_calls.py [--rounds 7]

Session 13 moved the loop over activation-row tiles inside the compiled functions (one call per
group pair / group and row block instead of one per tile, full groups stored with one vector
store instead of ``store_group`` calls): ``packed_i8_gemm._pair_tiles2`` (olv's INT4 layout,
AVX2 tile of 16 output rows x 4 activation rows) and ``ggml_gemm.chunks_i8`` (the 4-row kernels
of the GGUF block types). Here the previous structure is rebuilt from the same intrinsics (a
call per tile, eight / four ``store_group`` calls) and timed against the current one,
alternately in one process, one thread (``time.thread_time``), best round; the outputs are
asserted bitwise equal. GMAC/s = M N K / time. Shapes are Qwen2.5-0.5B's gate/up (4864 x 896),
down (896 x 4864), q/o (896 x 896) and an lm_head slice (18992 x 896). Not run by the test
command.
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import numpy as np
from numba import njit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_ggml_gemm import random_blocks  # bench/: the same random valid blocks

from olv_runtime.kernels import ggml_gemm as gg
from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels import packed_i8 as pi
from olv_runtime.kernels import packed_i8_gemm as pg
from olv_runtime.kernels.config import JIT
from olv_runtime.kernels.packed_i8 import (
    BLOCK,
    GROUP_BLOCK_BYTES,
    GROUP_ROWS,
    quantize_rows_i8,
    store_group,
)


@njit(**JIT)
def _old_pair_tile2(codes, scale, g, xq, xd, xs8, i0, n, out, facc):
    kb = codes.shape[1]
    kx = xq.shape[1]
    kbx = xd.shape[1]
    gstride = kb * GROUP_BLOCK_BYTES
    sstride = kb * GROUP_ROWS
    acc = pg._tile2_zero()
    base = g * kb
    for b in range(kb):
        acc = pg._tile2_block(acc, codes, (base + b) * GROUP_BLOCK_BYTES, gstride, scale,
                              (base + b) * GROUP_ROWS, sstride, xq, i0 * kx + b * BLOCK, kx, xd,
                              xs8, i0 * kbx + b, kbx)
    for r in range(4):
        store_group(acc[2 * r], facc, g, i0 + r, n, out)
        store_group(acc[2 * r + 1], facc, g + 1, i0 + r, n, out)


@njit(**JIT)
def _int4_old(codes, scale, xq, xd, xs8, m, n, out, facc):
    for g in range(0, codes.shape[0] - 1, 2):
        i0 = np.int64(0)
        while i0 < m:
            _old_pair_tile2(codes, scale, g, xq, xd, xs8, i0, n, out, facc)
            i0 += 4


@njit(**JIT)
def _int4_new(codes, scale, xq, xd, xs8, m, n, out, facc):
    for g in range(0, codes.shape[0] - 1, 2):
        pg._pair_tiles2(codes, scale, g, xq, xd, xs8, 0, m, n, out, facc)


@njit(**JIT)
def _ggml_old(kind, data, m, n, out, xq, xd, xs8, xs16, facc):
    mb = gg.block_rows(xq.shape[1])
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        for g in range(data.shape[0]):
            i0 = ib
            while ie - i0 >= gg.ROWS:
                accs = gg.rows_i8(kind, data, g, xq, xd, xs8, xs16, i0, False)
                for r in range(gg.ROWS):
                    store_group(accs[r], facc, g, i0 + r, n, out)
                i0 += gg.ROWS


@njit(**JIT)
def _ggml_new(kind, data, m, n, out, xq, xd, xs8, xs16, facc):
    mb = gg.block_rows(xq.shape[1])
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        for g in range(data.shape[0]):
            gg.chunks_i8(kind, data, g, xq, xd, xs8, xs16, ib, ie, n, out, facc, False)


def _best(fns, rounds):
    best = [1e9] * len(fns)
    for _ in range(rounds):
        for i, f in enumerate(fns):
            t = time.thread_time()
            f()
            best[i] = min(best[i], time.thread_time() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| kernel | N x K | M | per-tile calls GMAC/s | one call GMAC/s | ratio |")
    print("|---|---|---|---|---|---|")
    for n, k, m in ((4864, 896, 16), (4864, 896, 8), (896, 4864, 16), (18992, 896, 16)):
        p = pi.prepack_int4_i8(rng.integers(0, 256, n * k // 2, dtype=np.uint8),
                               rng.random((n, k // 32), dtype=np.float32) * 0.01, None, n, k, 32)
        x = rng.standard_normal((m, k), dtype=np.float32)
        kb = k // 32
        xq = pi.aligned_empty((m, k), np.int8)
        xd = np.zeros((m, kb), np.float32)
        xs8 = np.zeros((m, kb), np.int32)
        quantize_rows_i8(x, m, k, kb, xq, xd, xs8)
        o1, o2 = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
        facc = np.zeros((1, 8), np.float32)
        a = (p.codes, p.scale, xq, xd, xs8, m, n)
        t = _best([functools.partial(_int4_old, *a, o1, facc),
                   functools.partial(_int4_new, *a, o2, facc)], args.rounds)
        assert np.array_equal(o1, o2)
        g = [m * n * k / s / 1e9 for s in t]
        print(f"| INT4 AVX2 tile | {n} x {k} | {m} | {g[0]:.1f} | {g[1]:.1f} | {g[1] / g[0]:.2f} |")
    for n, k in ((4864, 896), (896, 4864), (896, 896)):
        m = 128
        p = gp.prepack_ggml("Q8_0", random_blocks("Q8_0", n, k, rng), n, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        ws = gp.make_workspace_ggml(m, k, 1)
        quantize_rows_i8(x, m, k, k // 32, ws.xq, ws.xd, ws.xs8)
        o1, o2 = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
        a = (gp.KINDS["Q8_0"], p.data, m, n)
        b = (ws.xq, ws.xd, ws.xs8, ws.xs16, ws.facc[0])
        t = _best([functools.partial(_ggml_old, *a, o1, *b),
                   functools.partial(_ggml_new, *a, o2, *b)], args.rounds)
        assert np.array_equal(o1, o2)
        g = [m * n * k / s / 1e9 for s in t]
        print(f"| ggml Q8_0 4-row | {n} x {k} | {m} | {g[0]:.1f} | {g[1]:.1f} | "
              f"{g[1] / g[0]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
