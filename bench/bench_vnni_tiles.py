"""Benchmark: the VNNI tile GEMM of the engine's rows step (``packed_i8_gemm.groups_tiles``)
against the structure before session 14, which is rebuilt here from the same intrinsics.

    python bench/bench_vnni_tiles.py [--rounds 7] [--ms 4,8,16]

Old: one non-inlined call per 16 x 8 tile (masked stores), the rows left over (``M % 8``, and
every row when M < 8) by ``packed_i8.group_r4 / r2 / r1`` per 8-row group. New: one call per
group pair covering all the pair's tiles (full pairs stored by plain vector stores), the rest by
16 x 4 / 2 / 1 tiles of the same pair. Alternating in one process, one thread
(``time.thread_time``), best round; outputs asserted bitwise equal. GMAC/s = M N K / time.
Shapes: Qwen2.5-0.5B's q/o (896 x 896), k/v (128 x 896), gate/up (4864 x 896), down
(896 x 4864) and lm_head (151936 x 896: 68 MB of codes, streamed from DRAM each call);
``--copies C`` runs each timed call over C copies of the weight (e.g. 32: the smaller weights
from DRAM too, as in a decode step). Needs a CPU with AVX-512 VNNI. Not run by the test command.
"""
from __future__ import annotations

import argparse
import functools

import numpy as np
from numba import njit

from bench_gemm_calls import _best  # bench/: the same best-of-rounds timer

from olv_runtime.kernels import packed_i8 as pi
from olv_runtime.kernels import packed_i8_gemm as pg
from olv_runtime.kernels.config import JIT
from olv_runtime.kernels.packed_i8 import BLOCK, GROUP_BLOCK_BYTES, GROUP_ROWS, quantize_rows_i8


@njit(**JIT)
def _old_pair_tile(codes, scale, g, xq, xd, xs8, i0, n, out):
    kb = codes.shape[1]
    kx = xq.shape[1]
    kbx = xd.shape[1]
    acc = pg._tile_zero(8)
    base = g * kb
    for b in range(kb):
        acc = pg._tile_block(acc, codes, (base + b) * GROUP_BLOCK_BYTES, kb * GROUP_BLOCK_BYTES,
                             scale, (base + b) * GROUP_ROWS, kb * GROUP_ROWS, xq,
                             i0 * kx + b * BLOCK, kx, xd, xs8, i0 * kbx + b, kbx)
    r0 = g * GROUP_ROWS
    pg._tile_store(out, i0 * n + r0, n, min(2 * GROUP_ROWS, n - r0), acc)


@njit(**JIT)
def _old_groups_tiles(codes, scale, g0, g1, xq, xd, xs8, m, n, out, facc):
    mt = m // 8 * 8
    g = g0
    while g + 1 < g1:
        i = np.int64(0)
        while i < mt:
            _old_pair_tile(codes, scale, g, xq, xd, xs8, i, n, out)
            i += 8
        if mt < m:
            pg._rows_tail(codes, scale, g, xq, xd, xs8, mt, m, n, out, facc, True)
            pg._rows_tail(codes, scale, g + 1, xq, xd, xs8, mt, m, n, out, facc, True)
        g += 2
    if g < g1:
        pg._rows_tail(codes, scale, g, xq, xd, xs8, np.int64(0), m, n, out, facc, True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ms", default="4,8,16")
    ap.add_argument("--copies", type=int, default=1)
    ap.add_argument("--shapes", default="896x896,128x896,4864x896,896x4864,151936x896")
    args = ap.parse_args(argv)
    if not pi.HOST_VNNI:
        raise SystemExit("no AVX-512 VNNI on this CPU")
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.ms.split(",")]
    print("| N x K | M | old GMAC/s | new GMAC/s | new/old |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        ps = [pi.prepack_int4_i8(rng.integers(0, 256, n * k // 2, dtype=np.uint8),
                                 (rng.random((n, k // 32)) * 0.01).astype(np.float16), None, n,
                                 k, 32) for _ in range(args.copies)]
        for m in ms:
            x = rng.standard_normal((m, k), dtype=np.float32)
            kb = k // 32
            xq = pi.aligned_empty((m, k), np.int8)
            xd = np.zeros((m, kb), np.float32)
            xs8 = np.zeros((m, kb), np.int32)
            quantize_rows_i8(x, m, k, kb, xq, xd, xs8)
            o1, o2 = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
            facc = np.zeros((1, 8), np.float32)

            def run(new, out):
                for p in ps:
                    a = (p.codes, p.scale, np.int64(0), np.int64(p.n_groups), xq, xd, xs8, m, n,
                         out, facc)
                    if new:
                        pg.groups_tiles(*a, True)
                    else:
                        _old_groups_tiles(*a)
            t = _best([functools.partial(run, False, o1), functools.partial(run, True, o2)],
                      args.rounds)
            assert np.array_equal(o1, o2)
            g = [m * n * k * len(ps) / s / 1e9 for s in t]
            print(f"| {n} x {k} | {m} | {g[0]:.1f} | {g[1]:.1f} | {g[1] / g[0]:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
