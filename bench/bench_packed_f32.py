"""Benchmark: exact-mode INT4 linear on the packed_i8 layout (packed_f32.linear_packed_i8_exact).

(Until issue 22 it ran beside the exact mode of the 64-row tiled kernel of kernels/packed.py,
``old``; that kernel was chosen by nothing and is gone.)

    python bench/bench_packed_f32.py [--threads 2] [--rounds 5] [--max-load 0.3] [--ms 1,128]

Weights stream from DRAM: each pass calls the kernel once on each of several copies of the packed
weight (> 1 GiB in total per layout; for large M, where the kernels are compute bound, at most
--max-copies-big copies), timed as a whole, divided by the number of calls (Python wrapper
included). Figures: best of --rounds passes; weight GB/s
(packed.nbytes / time) and GFLOP/s (2 M N K / time). Before each (shape, M) burst the script
waits until the 1-minute load average is below --max-load and prints the loads seen.
Not run by the test command.
"""
from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

from olv_runtime.kernels import config  # noqa: F401  (threading layer selection first)
from olv_runtime.kernels.packed_f32 import linear_packed_i8_exact, make_workspace_f32
from olv_runtime.kernels.packed_i8 import prepack_int4_i8

SHAPES = {  # name: (N, K)
    "gate/up": (4864, 896), "down": (896, 4864), "gate+up": (9728, 896),
    "lm_head": (151936, 896),
}
GIB = 1 << 30


def load1() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def wait_quiet(max_load, max_wait):
    t0 = time.time()
    while True:
        ld = load1()
        if ld < max_load or time.time() - t0 > max_wait:
            return ld
        time.sleep(2.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-load", type=float, default=0.3)
    ap.add_argument("--wait", type=float, default=300.0)
    ap.add_argument("--ms", default="1,128")
    ap.add_argument("--max-copies-big", type=int, default=4, help="copies when M >= 16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    nt = numba.get_num_threads()
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.ms.split(",")]
    print(f"threads={nt} layer={config.threading_layer()} pid={os.getpid()} "
          f"max_load={args.max_load}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        kb = -(-k // 32)
        payload = rng.integers(0, 256, size=(n * k + 1) // 2, dtype=np.uint8)
        scale = (rng.random((n, kb), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
        p8 = prepack_int4_i8(payload, scale, None, n, k, 32)
        ncopy = max(2, int(np.ceil(1.05 * GIB / p8.nbytes)))
        p8s = [p8] + [p8.copy() for _ in range(ncopy - 1)]
        print(f"\n{name} N={n} K={k}: packed "
              f"{p8.nbytes / 1e6:.2f} MB (i8 layout), {ncopy} copies "
              f"({ncopy * p8.nbytes / GIB:.2f} GiB per layout)")
        for m in ms:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out_n = np.empty((m, n), np.float32)
            wsf = make_workspace_f32(m, k)
            linear_packed_i8_exact(x, p8, out_n, workspace=wsf)
            cp = ncopy if m < 16 else min(ncopy, args.max_copies_big)
            rounds = args.rounds if m < 16 else max(2, args.rounds // 2)

            def run_new(cp=cp):
                for p in p8s[:cp]:
                    linear_packed_i8_exact(x, p, out_n, workspace=wsf)

            best = {"new": (np.inf, 0.0)}
            ld0 = wait_quiet(args.max_load, args.wait)
            for _ in range(rounds):
                for key, fn in (("new", run_new),):
                    ld = max(ld0, load1())
                    t0 = time.perf_counter()
                    fn()
                    t = (time.perf_counter() - t0) / cp
                    if t < best[key][0]:
                        best[key] = (t, ld)
            tn = best["new"][0]
            fl = 2.0 * m * n * k
            flag = lambda ld: "!" if ld >= args.max_load else " "  # noqa: E731
            print(f"  M={m:4d} ({cp} copies): new {p8.nbytes / tn / 1e9:6.1f} GB/s "
                  f"{fl / tn / 1e9:7.1f} GFLOP/s {tn * 1e6:9.1f} us (load {best['new'][1]:.2f}"
                  f"{flag(best['new'][1])}) [burst end load {load1():.2f}]", flush=True)
        del p8s


if __name__ == "__main__":
    main()
