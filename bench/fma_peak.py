"""The float32 FMA peak of this CPU, measured: the ceiling of olv's exact-mode prefill (issue 25).

    python bench/fma_peak.py [--threads 2] [--seconds 1.0] [--repeats 5]

One loop written in LLVM IR (llvmlite, compiled for the host CPU): ``ACC`` = 10 independent
accumulator vectors of ``W`` float32 lanes (W = 16, one zmm, where the CPU has AVX-512F; else 8,
one ymm) each go through ``llvm.fma`` (``acc * a + b``) every iteration, all in registers: 10
chains cover the FMA latency (4 cycles) times its ports (2) on Zen 3/4 and recent Intel. The
machine code is checked for ``vfmadd`` instructions, so a figure from a non-FMA build is never
printed as the peak. Each thread calls the compiled function through ctypes (which releases the
GIL), all threads started together.

Prints GFLOP/s (2 flops per lane per FMA) for 1 thread and ``--threads``: the best of
``--repeats`` timed runs of about ``--seconds`` each, with the median beside it (this VM's
figures move with placement and with other load). ``--json FILE`` writes them.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time

import llvmlite.binding as llvm

ACC = 10  # independent accumulator vectors


def _compile():
    """(ctypes function float(int64 n), lanes W, engine, asm) of the FMA loop for this CPU."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    w = 16 if features.get("avx512f") else 8
    v = f"<{w} x float>"
    a = ", ".join(["float 0x3FEFFFFFE0000000"] * w)  # 0.99999994: |acc| stays bounded
    b = ", ".join(["float 0x3EB0C6F7A0000000"] * w)  # 1e-6
    one = ", ".join(["float 1.0"] * w)
    phis = "\n".join(f"  %a{j} = phi {v} [<{one}>, %entry], [%n{j}, %loop]" for j in range(ACC))
    fmas = "\n".join(f"  %n{j} = call {v} @llvm.fma.v{w}f32({v} %a{j}, {v} <{a}>, {v} <{b}>)"
                      for j in range(ACC))
    sums = "\n".join(f"  %s{j + 1} = fadd {v} %s{j}, %n{j}" for j in range(ACC))
    ir = f"""
declare {v} @llvm.fma.v{w}f32({v}, {v}, {v})
define float @fma_loop(i64 %iters) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i1, %loop]
{phis}
{fmas}
  %i1 = add i64 %i, 1
  %done = icmp sge i64 %i1, %iters
  br i1 %done, label %exit, label %loop
exit:
  %s0 = fadd {v} zeroinitializer, zeroinitializer
{sums}
  %r = extractelement {v} %s{ACC}, i32 0
  ret float %r
}}
"""
    mod = llvm.parse_assembly(ir)
    mod.verify()
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=features.flatten(),
                                      opt=2)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    asm = tm.emit_assembly(mod)
    fn = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64)(engine.get_function_address("fma_loop"))
    return fn, w, engine, asm


def measure(threads: int, seconds: float, repeats: int, compiled=None) -> dict:
    """``{"threads", "gflops_best", "gflops_median", "fma", "lanes"}`` of ``threads`` concurrent
    calls; flops = 2 x ACC x W x iterations x threads."""
    fn, w, _engine, asm = compiled or _compile()
    n = 1 << 16
    while True:  # calibrate one call to ~seconds (bounded)
        t = time.perf_counter()
        fn(n)
        dt = time.perf_counter() - t
        if dt > seconds / 4 or n >= 1 << 40:
            break
        n *= 2
    n = max(1, int(n * seconds / max(dt, 1e-9)))

    def run_all():
        start = threading.Barrier(threads + 1)
        ts = [threading.Thread(target=lambda: (start.wait(), fn(n))) for _ in range(threads)]
        for th in ts:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        for th in ts:
            th.join()
        return time.perf_counter() - t0

    rates = [2.0 * ACC * w * n * threads / run_all() / 1e9 for _ in range(repeats)]
    return {"threads": threads, "gflops_best": max(rates),
            "gflops_median": statistics.median(rates),
            "fma": "vfmadd" in asm, "lanes": w}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="length of one timed run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or not 0 < args.seconds <= 60:
        ap.error("--threads and --repeats must be >= 1, --seconds in (0, 60]")
    compiled = _compile()
    res = [measure(t, args.seconds, args.repeats, compiled) for t in sorted({1, args.threads})]
    for r in res:
        flag = "" if r["fma"] else "  (!) no FMA instruction in the loop: not a peak"
        print(f"float32 FMA peak, {r['threads']} thread(s): {r['gflops_best']:.1f} GFLOP/s best, "
              f"{r['gflops_median']:.1f} median ({r['lanes']} float32 lanes per FMA){flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
