"""Benchmark: the panel GEMM (kernels/ggml_panel.py) against the register-blocked ggml_gemm path
for int8 prefill, single thread (``time.thread_time``), alternating in one process.

    python bench/bench_ggml_panel.py [--rounds 7] [--kinds Q8_0,Q5_0,Q4_1,Q5_1,Q4_K,Q5_K,Q6_K]
                                     [--ms 128,512]
                                     [--shapes 896x896,128x896,4864x896,896x4864]

Shapes are Qwen2.5-0.5B's (N x K): q/o 896x896, k/v 128x896, gate/up 4864x896, down 896x4864
(the k-quants need K % 256 == 0: 896 is not, so those kinds run K=1024 / 4864 rounded shapes,
printed). Random valid blocks. ``gemm``: the serial driver as ggml_packed had it before the
panel (activation quantization, ``ggml_gemm.rows_i8`` per 4 rows, ``_row_i8`` for the rest, in
L2 row blocks); ``panel``: the same quantization, then ``ggml_panel.panel_groups``. Both write
bitwise equal outputs (asserted). Per (kind, shape, M) the two are timed alternately,
``--rounds`` rounds of a few calls each; the figure is the best round. GMAC/s = M N K / time.
Not run by the test command.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from olv_runtime.kernels import config
from olv_runtime.kernels import ggml_gemm as gg
from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels import ggml_panel as gpl
from olv_runtime.kernels.packed_i8 import quantize_rows_i8, store_group
from bench_ggml_gemm import random_blocks  # bench/: the same random valid blocks


@njit(**config.JIT)
def _gemm_ser(kind, data, x, m, k, n, out, xq, xd, xs8, xs16, xsum, facc):
    quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, True)
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
            for i in range(i0, ie):
                acc = gp._row_i8(kind, data, g, xq, xd, xs8, xs16, i, False)
                store_group(acc, facc, g, i, n, out)


@njit(**config.JIT)
def _panel_ser(kind, data, x, m, k, n, out, xq, xd, xs8, xs16, xsum, facc):
    quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, True)
    gpl.panel_groups(kind, data, np.int64(0), data.shape[0], xq, xd, xs8, xs16, m, n, out, facc)


def measure(name, n, k, m, rounds, rng):
    blocks = random_blocks(name, n, k, rng)
    if name in ("Q4_1", "Q5_1", "Q5_K"):  # a finite min (bench_ggml_gemm sets d, and Q4_K's)
        blocks[..., 2:4] = blocks[..., 0:2]
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = gp.make_workspace_ggml(m, k, 1)
    ys = {"gemm": np.empty((m, n), np.float32), "panel": np.empty((m, n), np.float32)}
    fns = {"gemm": _gemm_ser, "panel": _panel_ser}

    def run(key):
        fns[key](packed.kind, packed.data, x, m, k, n, ys[key], ws.xq, ws.xd, ws.xs8, ws.xs16,
                 ws.xsum, ws.facc[0])
    run("gemm")
    run("panel")
    assert np.array_equal(ys["gemm"].view(np.uint32), ys["panel"].view(np.uint32))
    calls = max(1, int(1e8 // (m * n * k)))
    best = {"gemm": np.inf, "panel": np.inf}
    for _ in range(rounds):
        for key in ("gemm", "panel"):
            t0 = time.thread_time()
            for _ in range(calls):
                run(key)
            best[key] = min(best[key], (time.thread_time() - t0) / calls)
    return {key: m * n * k / t / 1e9 for key, t in best.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kinds", default="Q8_0,Q5_0,Q4_1,Q5_1,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--ms", default="128,512")
    ap.add_argument("--shapes", default="896x896,128x896,4864x896,896x4864")
    args = ap.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"int8, 1 thread, best of {args.rounds} rounds, GMAC/s")
    print(f"{'kind':5} {'N':>5} {'K':>5} {'M':>4} {'gemm':>7} {'panel':>7} {'ratio':>6}")
    for name in args.kinds.split(","):
        bs = gp.BLOCKS[gp.KINDS[name]][0]
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            k = -(-k // bs) * bs
            for m in (int(v) for v in args.ms.split(",")):
                r = measure(name, n, k, m, args.rounds, rng)
                print(f"{name:5} {n:5d} {k:5d} {m:4d} {r['gemm']:7.1f} {r['panel']:7.1f} "
                      f"{r['panel'] / r['gemm']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
