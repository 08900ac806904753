"""Benchmark: the panel GEMM (kernels/ggml_panel.py) against the register-blocked ggml_gemm path
for int8 prefill, single thread (``time.thread_time``), alternating in one process.

    python bench/bench_ggml_panel.py [--rounds 7] [--kinds Q8_0,Q5_0,Q4_1,Q5_1,Q4_K,Q5_K,Q6_K]
                                     [--ms 128,512] [--paths vnni,panel,vpanel]
                                     [--shapes 896x896,128x896,4864x896,896x4864]

Shapes are Qwen2.5-0.5B's (N x K): q/o 896x896, k/v 128x896, gate/up 4864x896, down 896x4864
(the k-quants need K % 256 == 0: 896 is not, so those kinds run K=1024 / 4864 rounded shapes,
printed). Random valid blocks. Paths (all after the same activation quantization):
``avx2`` / ``vnni``: ``ggml_packed._groups``' register-blocked driver (``ggml_gemm.chunks_i8``
per (group, L2 row block), ``_row_i8`` for the rows left over) with the ``vnni`` flag off / on
(``vnni`` only on a VNNI host: ``vpdpbusd``); ``panel`` / ``vpanel``: ``ggml_panel.panel_groups``
with the ``vnni`` flag off / on (the AVX2 or the zmm ``vpdpbusd`` tiles; default paths on a VNNI
host ``vnni,panel,vpanel``, else ``avx2,panel``). All write
bitwise equal outputs (asserted). Per (kind, shape, M) the paths are timed alternately,
``--rounds`` rounds of a few calls each; the GMAC/s figure (M N K / time) is the best round,
the ratio columns (a panel path's speed over each path before it on ``--paths``) the median over
rounds of the ratio within a round (the paths run back to back: robust to a shared machine's
load swings). Not run by the test command.
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
from olv_runtime.kernels.packed_i8 import HOST_VNNI, quantize_rows_i8, store_group
from bench_ggml_gemm import random_blocks  # bench/: the same random valid blocks


@njit(**config.JIT)
def _gemm_ser(kind, data, x, m, k, n, out, xq, xd, xs8, xs16, xsum, facc, vnni):
    quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, True)
    mb = gg.block_rows(xq.shape[1])
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        for g in range(data.shape[0]):
            i0 = gg.chunks_i8(kind, data, g, xq, xd, xs8, xs16, ib, ie, n, out, facc, vnni)
            for i in range(i0, ie):
                acc = gp._row_i8(kind, data, g, xq, xd, xs8, xs16, i, vnni)
                store_group(acc, facc, g, i, n, out)


@njit(**config.JIT)
def _panel_ser(kind, data, x, m, k, n, out, xq, xd, xs8, xs16, xsum, facc, vnni):
    quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, True)
    gpl.panel_groups(kind, data, np.int64(0), data.shape[0], xq, xd, xs8, xs16, m, n, out, facc,
                     vnni)


def measure(name, n, k, m, rounds, rng, paths):
    blocks = random_blocks(name, n, k, rng)
    if name in ("Q4_1", "Q5_1", "Q5_K"):  # a finite min (bench_ggml_gemm sets d, and Q4_K's)
        blocks[..., 2:4] = blocks[..., 0:2]
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = gp.make_workspace_ggml(m, k, 1)
    ys = {key: np.empty((m, n), np.float32) for key in paths}
    fns = {"avx2": (_gemm_ser, False), "vnni": (_gemm_ser, True), **PANELS}
    fns = {k: (f, v) for k, (f, v) in fns.items() if k in paths}

    def run(key):
        fn, vnni = fns[key]
        fn(packed.kind, packed.data, x, m, k, n, ys[key], ws.xq, ws.xd, ws.xs8, ws.xs16,
           ws.xsum, ws.facc[0], vnni)
    for key in paths:
        run(key)
        assert np.array_equal(ys[paths[0]].view(np.uint32), ys[key].view(np.uint32)), key
    calls = max(1, int(3e7 // (m * n * k)))
    times = {key: [] for key in paths}
    for _ in range(rounds):
        for key in paths:
            t0 = time.thread_time()
            for _ in range(calls):
                run(key)
            times[key].append((time.thread_time() - t0) / calls)
    out = {key: m * n * k / min(t) / 1e9 for key, t in times.items()}
    for p in paths:  # the median over rounds of the per-round speed ratio to each other path
        for q in paths:
            out[p, q] = float(np.median(np.array(times[q]) / np.array(times[p])))
    return out


#: the panel paths (name: (serial driver, vnni flag)), timed beside ggml_gemm's.
PANELS = {"panel": (_panel_ser, False), "vpanel": (_panel_ser, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kinds", default="Q8_0,Q5_0,Q4_1,Q5_1,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--ms", default="128,512")
    ap.add_argument("--shapes", default="896x896,128x896,4864x896,896x4864")
    ap.add_argument("--paths", default="vnni,panel,vpanel" if HOST_VNNI else "avx2,panel")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if ("vnni" in paths or "vpanel" in paths) and not HOST_VNNI:
        ap.error("--paths vnni / vpanel: this CPU has no AVX-512 VNNI")
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    # ratio columns: each panel path over each path before it on --paths
    pairs = [(p, q) for i, p in enumerate(paths) if p in PANELS for q in paths[:i]]
    print(f"int8, 1 thread, best of {args.rounds} rounds, GMAC/s; ratio = panel path / path, "
          "the median of the per-round ratios (the paths alternate within a round)")
    print(f"{'kind':5} {'N':>5} {'K':>5} {'M':>4} " + " ".join(f"{p:>7}" for p in paths) + " "
          + " ".join(f"{p + '/' + q:>12}" for p, q in pairs))
    for name in args.kinds.split(","):
        bs = gp.BLOCKS[gp.KINDS[name]][0]
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            k = -(-k // bs) * bs
            for m in (int(v) for v in args.ms.split(",")):
                r = measure(name, n, k, m, args.rounds, rng, paths)
                print(f"{name:5} {n:5d} {k:5d} {m:4d} " + " ".join(f"{r[p]:7.1f}" for p in paths)
                      + " " + " ".join(f"{r[p, q]:12.2f}" for p, q in pairs),
                      flush=True)


if __name__ == "__main__":
    main()
