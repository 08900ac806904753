"""Per-step time breakdown of the batching engine's compiled rows step, by phase and task.

The engine's step (olv_runtime.kernels.rows_layers) stamps the CPU's time-stamp counter at its
phase boundaries when its barrier array is longer than the normal one (``barrier_slots(nt) + nt
* PROF_SLOTS``; with the normal array each stamp costs one compare), as the one-token step does
(bench/stack_phases.py). This script

1. makes a session (``--model``, int8 activations unless ``--exact``, ``--threads``) and an
   :class:`olv_runtime.Engine`, adds ``--batch`` requests of ``--prompt`` random ids and steps
   until every one decodes, keeping the arguments of the last ``rows_forward`` call (B decode
   rows, each at its own position);
2. times ``--calls`` calls of the compiled forward alone with the normal barrier array, then as
   many with the long one (a call rewrites the same keys and values: the pool is unchanged), and
   prints each phase's mean time per step for every task (the waits are the barriers: time a
   task spent waiting for the others) and per row;
3. times the engine's ``step()`` around it: the rest is the engine's Python (scheduling, block
   tables, sampling).

    python bench/rows_phases.py [--model ~/.cache/olv_bench/q05b_int4/model.onnx] [--batch 8]
        [--threads 2] [--calls 20] [--prompt 128] [--exact]

Timings only (bench/, never asserted); on a shared machine the waits absorb other processes.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/olv_bench/q05b_int4/model.onnx"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--exact", action="store_true", help="exact mode (float32 activations)")
    a = ap.parse_args()

    import olv_runtime
    from olv_runtime.kernels import rows_layers as rl
    from olv_runtime.kernels import step_sync as ss

    sess = olv_runtime.InferenceSession(olv_runtime.load(a.model), olv_runtime.SessionOptions(
        num_threads=a.threads, quantize_activations=not a.exact))
    eng = olv_runtime.Engine(sess, max_batch=max(16, a.batch),
                             kv_cache_tokens=max(16, a.batch) * (a.prompt + 4 * a.calls + 64))
    if eng.program.compiled is None:
        raise SystemExit("the engine runs this model's per-operator rows program (no compiled "
                         "rows step): nothing to profile")
    seen = {}
    real = rl.rows_forward

    def capture(*args):
        seen["args"] = args
        return real(*args)

    rng = np.random.default_rng(0)
    cfg = olv_runtime.GenerationConfig(max_new_tokens=4 * a.calls + 32, eos_token_id=None)
    for _ in range(a.batch):
        eng.add_request(list(rng.integers(0, 1000, a.prompt)), cfg)
    while eng.stats().decode_rows < a.batch:
        eng.step()
    rl.rows_forward = capture
    try:
        for _ in range(3):
            eng.step()
    finally:
        rl.rows_forward = real
    nt, quant, batch, ws, kv, w, dims = seen["args"]
    r_n = np.int64(batch.pos.shape[0])
    i8ws = ws.i8 if quant else (ws.digit_buffers() if dims.vnni else None)  # as rows_forward
    prof = np.zeros(ss.barrier_slots(nt) + nt * ss.PROF_SLOTS, np.int64)

    def call(bar):
        if nt > 1:
            rl._rows_par(nt, r_n, batch, bar, i8ws, w, dims, ws.rs, kv)
        else:
            rl._rows_thread(np.int64(0), np.int64(1), r_n, batch, bar, i8ws, w, dims, ws.rs, kv)

    def timed(bar, n):
        ts = np.empty(n)
        for i in range(n):
            t0 = time.perf_counter()
            call(bar)
            ts[i] = time.perf_counter() - t0
        return ts * 1e3

    call(ws.bar)
    t_plain = timed(ws.bar, a.calls)
    call(prof)
    prof[ss.barrier_slots(nt):] = 0
    c0, w0 = ss.cycles_now(), time.perf_counter()
    t_prof = timed(prof, a.calls)
    c1, w1 = ss.cycles_now(), time.perf_counter()
    hz = (c1 - c0) / (w1 - w0)
    ph = prof[ss.barrier_slots(nt):].reshape(nt, ss.PROF_SLOTS)[:, :len(ss.PHASES)]
    us = ph / hz * 1e6 / a.calls

    # the engine's step around the forward
    steps = []
    for _ in range(a.calls):
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    step_ms = float(np.median(steps)) * 1e3

    print(f"model {a.model}; {'exact' if a.exact else 'int8 activations'}; {nt} task(s); "
          f"{int(r_n)} rows ({'decode rows, fused rope+attention' if batch.fused else 'mixed'}), "
          f"positions {int(batch.pos.min())}..{int(batch.pos.max())}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"forward alone: median {np.median(t_plain):.3f} ms (min {t_plain.min():.3f}); with "
          f"the phase stamps: median {np.median(t_prof):.3f} ms; time-stamp counter "
          f"{hz / 1e9:.3f} GHz")
    print()
    print("| phase | " + " | ".join(f"task {t} us/step" for t in range(nt)) + " | us/row |")
    print("|---|" + "---|" * (nt + 1))
    for k, name in enumerate(ss.PHASES):
        if us[:, k].sum() == 0:
            continue
        print(f"| {name} | " + " | ".join(f"{us[t, k]:.0f}" for t in range(nt))
              + f" | {us[:, k].mean() / int(r_n):.0f} |")
    print("| sum | " + " | ".join(f"{us[t].sum():.0f}" for t in range(nt))
          + f" | {us.sum(axis=1).mean() / int(r_n):.0f} |")
    waits = [k for k, n in enumerate(ss.PHASES) if n.startswith("wait") or n == "final wait"]
    print()
    print(f"waits (mean over tasks): {us[:, waits].sum(axis=1).mean():.0f} us/step")
    print(f"engine step(): median {step_ms:.3f} ms ({int(r_n) / step_ms * 1e3:.1f} tok/s); the "
          f"forward {np.median(t_plain):.3f} ms; the engine's Python around it "
          f"{step_ms - np.median(t_plain):.3f} ms")


if __name__ == "__main__":
    main()
