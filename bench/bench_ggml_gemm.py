"""Benchmark: the ggml int8 kernels (kernels/ggml_packed.py ``linear_ggml_i8``) for prefill, the
multi-row path (kernels/ggml_gemm.py: each record decoded once per ROWS activation rows) against
the one-row path (every record decoded once per activation row) in the same run.

    python bench/bench_ggml_gemm.py [--threads 2] [--rounds 5] [--kinds Q8_0,Q5_0,Q4_K,Q6_K]
                                    [--ms 1,8,128,512]

Shapes: Qwen2.5-0.5B's gate/up (N=4864, K=896), down (N=896, K=4864), qkv (N=1152, K=896).
Random blocks (valid float16 scales). ``old`` is a copy of the driver as it was before the
multi-row kernels (the same activation quantization and tasks, ``_row_i8`` for every row);
``new`` is ``linear_ggml_i8`` (out and workspace preallocated; ``--exact``: ``linear_ggml_exact``
against ``_row_f32`` for every row). Per (kind, shape, M) the two
are timed alternately, ``--rounds`` rounds of a few calls each; the figure is the best round
(the machine may be shared: compare the ratio, measured in the same minute). GMAC/s =
M N K / time. Not run by the test command.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange

from olv_runtime.kernels import config
from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels.packed_i8 import quantize_rows_i8, store_group, use_vnni

SHAPES = {"gate/up": (4864, 896), "down": (896, 4864), "qkv": (1152, 896)}  # name: (N, K)


@njit(**config.JIT)
def _old_groups(kind, data, g0, g1, x, xq, xd, xs8, xs16, xsum, m, n, out, facc, quant, vnni):
    for g in range(g0, g1):
        for i in range(m):
            if quant:
                acc = gp._row_i8(kind, data, g, xq, xd, xs8, xs16, i, vnni)
            else:
                acc = gp._row_f32(kind, data, g, x, xsum, i)
            store_group(acc, facc, g, i, n, out)


@njit(**config.JIT)
def _old_linear_ser(kind, data, x, m, k, n, out, xq, xd, xs8, xs16, xsum, facc, quant, vnni):
    if quant:
        quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, quant)
    _old_groups(kind, data, np.int64(0), data.shape[0], x, xq, xd, xs8, xs16, xsum, m, n, out,
                facc, quant, vnni)


@njit(**config.PJIT)
def _old_linear(kind, data, x, m, k, n, out, ntasks, xq, xd, xs8, xs16, xsum, facc, quant,
                vnni):
    if quant:
        quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    gp._act_sums(kind, m, k, xq, xs16, x, xsum, quant)
    ng = data.shape[0]
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        _old_groups(kind, data, g0, g1, x, xq, xd, xs8, xs16, xsum, m, n, out, facc[task],
                    quant, vnni)


def random_blocks(name, n, k, rng):
    bs, ts = gp.BLOCKS[gp.KINDS[name]]
    b = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
    off = 208 if name == "Q6_K" else 0
    d = rng.uniform(0.001, 0.01, size=b.shape[:2]).astype(np.float16)
    b[..., off:off + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    if name == "Q4_K":
        b[..., 2:4] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    return b


def measure(name, n, k, m, rounds, threads, rng, exact=False):
    blocks = random_blocks(name, n, k, rng)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = gp.make_workspace_ggml(m, k, threads)
    y_new = np.empty((m, n), np.float32)
    y_old = np.empty((m, n), np.float32)
    ntasks = min(ws.n_tasks, numba.get_num_threads(), packed.n_groups)

    linear = gp.linear_ggml_exact if exact else gp.linear_ggml_i8

    def new():
        linear(x, packed, y_new, ws)

    def old():
        if m * n * k < gp.SERIAL_MAX_WORK or ntasks == 1:  # the serial driver, as _run
            _old_linear_ser(packed.kind, packed.data, x, m, k, n, y_old, ws.xq, ws.xd, ws.xs8,
                            ws.xs16, ws.xsum, ws.facc[0], not exact, use_vnni())
            return
        _old_linear(packed.kind, packed.data, x, m, k, n, y_old, ntasks, ws.xq, ws.xd, ws.xs8,
                    ws.xs16, ws.xsum, ws.facc, not exact, use_vnni())
    new()
    old()
    assert np.array_equal(y_new.view(np.uint32), y_old.view(np.uint32)), "results differ"
    calls = max(1, int(2e8 // (m * n * k)))  # ~0.2 GMAC per round and path
    best = {"old": np.inf, "new": np.inf}
    for _ in range(rounds):
        for key, fn in (("old", old), ("new", new)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[key] = min(best[key], (time.perf_counter() - t0) / calls)
    return {key: m * n * k / t / 1e9 for key, t in best.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", default="Q8_0,Q5_0,Q4_K,Q6_K")
    ap.add_argument("--ms", default="1,8,128,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--exact", action="store_true",
                    help="linear_ggml_exact (float32 activations) instead of linear_ggml_i8")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    mode = "exact" if args.exact else "int8"
    print(f"{mode}: threads={args.threads} rounds={args.rounds} (GMAC/s, best round; new/old)")
    print(f"{'kind':5} {'shape':8} {'N':>5} {'K':>5} {'M':>4} {'old':>7} {'new':>7} {'ratio':>6}")
    for name in args.kinds.split(","):
        for sname in args.shapes.split(","):
            n, k = SHAPES[sname]
            if k % gp.BLOCKS[gp.KINDS[name]][0]:
                continue  # K=896 is not a multiple of 256 (llama.cpp's fallback types cover it)
            for m in (int(v) for v in args.ms.split(",")):
                r = measure(name, n, k, m, args.rounds, args.threads, rng, args.exact)
                print(f"{name:5} {sname:8} {n:5d} {k:5d} {m:4d} {r['old']:7.1f} {r['new']:7.1f} "
                      f"{r['new'] / r['old']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
