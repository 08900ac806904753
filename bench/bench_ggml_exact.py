"""Benchmark: exact-mode (float32 activations) prefill kernels, one thread, as % of the float32
FMA peak of the same thread (issue 25 item 3).

    python bench/bench_ggml_exact.py [--kinds Q4_0,Q5_0,Q8_0,Q4_K,Q6_K] [--ms 128,512]
                                     [--rounds 5] [--shapes gate/up,down]

The peak: :mod:`fma_peak`'s loop (10 independent ymm FMA chains in registers), called on this
thread and timed with ``time.thread_time`` (CPU time of the thread, so other load on the shared
machine costs less than wall time). Each kernel: the serial driver of the exact linear
(``ggml_packed._linear_ser`` with ``quant=False``; Q4_0: the INT4 layout's
``packed_f32._linear_big_ser``), best of ``--rounds`` rounds of thread time; GFLOP/s =
2 M N K / time. ``old``: the multi-row kernel before the float panel (``ggml_gemm.rows_f32``,
ROWS_F32 rows per decoded record, copied driver below), ``new``: the float panel
(``ggml_gemm.panel_f32``, records decoded once per L2 row block, 2 groups x ROWS_P2 rows per
tile) for every kind (the library takes it where ``ggml_gemm.use_fpanel``), ``zmm``: the same
with pairs of groups first in 16-lane tiles of ROWS_Z rows (``ggml_zpanel.panel_f32z``, the
library's path on an AVX-512 host; all three bitwise equal). Random
blocks with valid float16 scales; Qwen2.5-0.5B shapes. Not run by the test command.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np
from numba import njit

sys.path.insert(0, os.path.dirname(__file__))
import fma_peak
from bench_ggml_gemm import random_blocks

from olv_runtime.kernels import config
from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels import packed_f32 as pf
from olv_runtime.kernels.ggml_gemm import (
    ROWS_F32,
    ROWS_P,
    block_rows,
    panel_f32,
    panel_floats,
    rows_f32,
)
from olv_runtime.kernels.ggml_zpanel import ROWS_Z, panel_f32z
from olv_runtime.kernels.packed_i8 import prepack_int4_i8, store_group

SHAPES = {"gate/up": (4864, 896), "down": (896, 4864), "qkv": (1152, 896)}  # name: (N, K)


@njit(**config.JIT)
def _old_ser(kind, data, x, m, k, n, out, xsum, facc):
    """The exact driver as it was before the float panel: ROWS_F32 rows per decoded record."""
    gp._act_sums(kind, m, k, x[:1].astype(np.int8), xsum[:, :1].astype(np.int32), x, xsum,
                 False)
    mb = block_rows(4 * x.shape[1])
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        for g in range(data.shape[0]):
            i0 = ib
            while ie - i0 >= ROWS_F32:
                accs = rows_f32(kind, data, g, x, xsum, i0)
                for r in range(ROWS_F32):
                    store_group(accs[r], facc, g, i0 + r, n, out)
                i0 += ROWS_F32
            for i in range(i0, ie):
                store_group(gp._row_f32(kind, data, g, x, xsum, i), facc, g, i, n, out)


@njit(**config.JIT)
def _panel_ser(kind, data, x, m, k, n, out, xsum, facc, z):
    """The exact driver with the float panel for every kind (``ggml_packed._groups`` takes it
    only where :func:`~olv_runtime.kernels.ggml_gemm.use_fpanel`); ``z``: pairs of groups first
    through the 16-lane tiles (``ggml_zpanel.panel_f32z``, the library's path on an AVX-512
    host)."""
    gp._act_sums(kind, m, k, x[:1].astype(np.int8), xsum[:, :1].astype(np.int32), x, xsum,
                 False)
    mb = block_rows(4 * x.shape[1])
    panel = np.empty(2 * panel_floats(kind), np.float32)
    accb = np.empty(16 * mb, np.float32)
    g1 = data.shape[0]
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        for g in range(0, g1, 2):
            ng = min(2, g1 - g)
            i0 = ib
            if z and ng == 2 and ie - ib >= ROWS_Z:
                i0 = panel_f32z(kind, data, g, x, xsum, ib, ie, n, out, facc, panel, accb)
            if ie - i0 >= ROWS_P:
                i0 = panel_f32(kind, data, g, ng, x, xsum, i0, ie, n, out, facc, panel, accb)
            for gi in range(g, g + ng):
                for i in range(i0, ie):
                    store_group(gp._row_f32(kind, data, gi, x, xsum, i), facc, gi, i, n, out)


def _same(a, b):
    """Bitwise equal, NaN payloads aside (the random float16 minimums of Q4_1 / Q5_1 / Q5_K
    blocks can be NaN, and which operand's payload an instruction keeps is not the contract)."""
    nan = np.isnan(a)
    return (np.array_equal(nan, np.isnan(b))
            and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def best_thread_time(fn, rounds, reps=1):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - t) / reps)
    return best


def peak_gflops(rounds):
    fn, w, _engine, asm = fma_peak._compile()
    assert "vfmadd" in asm
    n = 1 << 24
    t = best_thread_time(lambda: fn(n), rounds)
    return 2.0 * fma_peak.ACC * w * n / t / 1e9


def kernels(name, n, k, m, rng):
    """{label: callable} computing y = x @ W.T on one thread, and the outputs to compare."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    outs = {}
    fns = {}
    if name == "Q4_0":
        payload = rng.integers(0, 256, size=n * k // 2, dtype=np.uint8)
        scale = rng.uniform(0.001, 0.01, size=(n, k // 32)).astype(np.float32)
        packed = prepack_int4_i8(payload, scale, None, n, k, 32)
        ws = pf.make_workspace_f32(m, k, 1)
        y = np.empty((m, n), np.float32)
        outs["new"] = y
        fns["new"] = lambda: pf._linear_big_ser(x, m, packed.codes, packed.scale, n, y, ws.facc)
        return fns, outs
    blocks = random_blocks(name, n, k, rng)
    packed = gp.prepack_ggml(name, blocks, n, k)
    ws = gp.make_workspace_ggml(m, k, 1)
    y_old = np.empty((m, n), np.float32)
    y_new = np.empty((m, n), np.float32)
    outs["old"], outs["new"] = y_old, y_new
    fns["old"] = lambda: _old_ser(packed.kind, packed.data, x, m, k, n, y_old, ws.xsum,
                                  ws.facc[0])
    fns["new"] = lambda: _panel_ser(packed.kind, packed.data, x, m, k, n, y_new, ws.xsum,
                                    ws.facc[0], False)
    y_z = np.empty((m, n), np.float32)
    outs["zmm"] = y_z
    fns["zmm"] = lambda: _panel_ser(packed.kind, packed.data, x, m, k, n, y_z, ws.xsum,
                                    ws.facc[0], True)
    return fns, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="Q4_0,Q5_0,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--ms", default="128,512")
    ap.add_argument("--shapes", default="gate/up,down")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    peak = peak_gflops(args.rounds)
    print(f"float32 FMA peak, this thread (thread_time): {peak:.1f} GFLOP/s")
    for name in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            if name in ("Q4_K", "Q5_K", "Q6_K") and k % 256:
                k = 1024  # the k-quants need K % 256 == 0 (Qwen2.5-0.5B's 896 is not)
            for m in (int(v) for v in args.ms.split(",")):
                fns, outs = kernels(name, n, k, m, rng)
                flop = 2.0 * m * n * k
                cells = []
                for label in fns:
                    t = best_thread_time(fns[label], args.rounds)
                    g = flop / t / 1e9
                    cells.append(f"{label} {g:6.1f} GFLOP/s {100 * g / peak:5.1f} %")
                same = ("" if len(outs) < 2 else
                        "  bitwise equal" if all(_same(outs["old"], o) for o in outs.values())
                        else "  (!) outputs differ")
                print(f"{name:5s} {shape:8s} M={m:4d}  " + "  |  ".join(cells) + same,
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
