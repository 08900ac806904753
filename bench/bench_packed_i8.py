"""Benchmark: int8-dot INT4 GEMV (packed_i8_gemm.linear_packed_i8) against the streaming read.

(Until issue 22 it ran beside the 64-row tiled kernel of kernels/packed.py, ``old quant`` in
bench/RESULTS.md; that kernel was chosen by nothing and is gone.)

    python bench/bench_packed_i8.py [--threads 2] [--rounds 5] [--max-load 0.3] [--shapes ...]

For the Qwen2.5-0.5B shapes, M = 1 and 4: weight GB/s (packed.nbytes / time per call) with the
weights streaming from DRAM (each measurement is one pass over copies of the packed weight
totalling > 1 GiB, one call per copy, timed as a whole and divided by the number of calls, Python
wrapper included), next to a 2-thread streaming read measured the same way (a numba parallel sum
over chunks of the same size cycled through a > 1 GiB buffer) and a plain 1 GiB streaming sum.

The machine may be shared: before every burst of passes (one burst per shape and M, a few
seconds, so the script barely raises the load average itself) the script waits up to --wait
seconds until the 1-minute load average is below --max-load, and prints next to every figure the
load seen at its best pass (the max of the burst-start and pass-start readings; flagged with '!'
when >= --max-load, i.e. not to be trusted). Figures are the best of --rounds passes.
Not run by the test command.
"""
from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

from _bandwidth import stream_sum
from numba import njit, prange

from olv_runtime.kernels import config  # noqa: F401  (threading layer selection first)
from olv_runtime.kernels.packed_i8 import make_workspace_i8, prepack_int4_i8
from olv_runtime.kernels.packed_i8_gemm import linear_packed_i8

SHAPES = {  # name: (N, K)
    "gate/up": (4864, 896), "down": (896, 4864), "qkv": (1152, 896), "lm_head": (151936, 896),
}
GIB = 1 << 30


_stream_sum = stream_sum  # bench/_bandwidth.py


def load1() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def wait_quiet(max_load, max_wait):
    t0 = time.time()
    while True:
        ld = load1()
        if ld < max_load or time.time() - t0 > max_wait:
            return ld
        time.sleep(2.0)


class Best:
    def __init__(self):
        self.t, self.load = float("inf"), None

    def add(self, t, ld):
        if t < self.t:
            self.t, self.load = t, ld


def fmt(gbs, ld, max_load):
    flag = "!" if ld is None or ld >= max_load else " "
    return f"{gbs:5.1f} GB/s (load {ld:.2f}{flag})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-load", type=float, default=0.3)
    ap.add_argument("--wait", type=float, default=240.0, help="max seconds to wait for quiet")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    nt = numba.get_num_threads()
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.ms.split(",")]

    buf = np.ones(GIB + (64 << 20), np.uint8)  # > 1 GiB streaming buffer
    whole = buf[:GIB].view(np.uint64).reshape(-1, 16)
    _stream_sum(whole, nt)
    print(f"threads={nt} layer={config.threading_layer()} pid={os.getpid()} "
          f"max_load={args.max_load}")

    def stream_whole():
        b = Best()
        ld0 = wait_quiet(args.max_load, args.wait)
        for _ in range(args.rounds):
            ld = max(ld0, load1())
            t0 = time.perf_counter()
            _stream_sum(whole, nt)
            b.add(time.perf_counter() - t0, ld)
        return b

    b = stream_whole()
    print(f"streaming read, 1 GiB sum: {fmt(GIB / b.t / 1e9, b.load, args.max_load)}")

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        kb = -(-k // 32)
        payload = rng.integers(0, 256, size=(n * k + 1) // 2, dtype=np.uint8)
        scale = (rng.random((n, kb), dtype=np.float32) * 0.02 + 1e-3).astype(np.float32)
        t0 = time.perf_counter()
        p8 = prepack_int4_i8(payload, scale, None, n, k, 32)
        tprep = time.perf_counter() - t0
        ncopy = max(2, int(np.ceil(1.05 * GIB / p8.nbytes)))
        p8s = [p8] + [p8.copy() for _ in range(ncopy - 1)]
        # streaming read "the same way": chunks of the same size cycled through the buffer
        rows = (p8.nbytes + 127) // 128
        nchunk = min(ncopy, buf.nbytes // (rows * 128))
        chunks = [buf[i * rows * 128:(i + 1) * rows * 128].view(np.uint64).reshape(-1, 16)
                  for i in range(nchunk)]
        print(f"\n{name} N={n} K={k}: packed "
              f"{p8.nbytes / 1e6:.2f} MB (i8, prepack {tprep * 1e3:.0f} ms), {ncopy} copies "
              f"({ncopy * p8.nbytes / GIB:.2f} GiB per layout)")
        for m in ms:
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, n), np.float32)
            ws8 = make_workspace_i8(m, k)
            ref = linear_packed_i8(x, p8)
            linear_packed_i8(x, p8s[-1], out, workspace=ws8)
            same = np.array_equal(out, ref)  # a copy of the weight, a given workspace: same bits

            def run_new():
                for p in p8s:
                    linear_packed_i8(x, p, out, workspace=ws8)

            def run_stream():
                for c in chunks:
                    _stream_sum(c, nt)

            res = {"i8": Best(), "stream": Best()}
            fns = {"i8": (run_new, len(p8s)), "stream": (run_stream, len(chunks))}
            # one short burst per (shape, M): wait for a quiet machine once, then all passes
            # interleaved (a burst of a few seconds barely moves the 1-minute load average)
            ld0 = wait_quiet(args.max_load, args.wait)
            for _ in range(args.rounds):
                for key, (fn, calls) in fns.items():  # interleaved, side by side
                    ld = load1()
                    t0 = time.perf_counter()
                    fn()
                    res[key].add((time.perf_counter() - t0) / calls, max(ld, ld0))
            print(f"  [burst load: start {ld0:.2f}, end {load1():.2f}]")
            gb = {key: p8.nbytes / r.t / 1e9 for key, r in res.items()}
            print(f"  M={m}: i8 {fmt(gb['i8'], res['i8'].load, args.max_load)} "
                  f"{res['i8'].t * 1e6:8.1f} us | stream same-size chunks "
                  f"{fmt(gb['stream'], res['stream'].load, args.max_load)} | "
                  f"i8/stream {gb['i8'] / gb['stream']:.2f} | bitwise equal {same}")
        del p8s, chunks

    b = stream_whole()
    print(f"\nstreaming read again, 1 GiB sum: {fmt(GIB / b.t / 1e9, b.load, args.max_load)}")


if __name__ == "__main__":
    main()
