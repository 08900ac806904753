"""Per-token time breakdown of the compiled contiguous decode step, by phase and task.

The step (olv_runtime.kernels.decoder_layers) stamps the CPU's time-stamp counter at its phase
boundaries when its barrier array is longer than the normal one (``barrier_slots(nt) + nt *
PROF_SLOTS``; with the normal array the stamps cost one compare each). This script

1. makes a session (``--model``, int8 activations unless ``--exact``, ``--threads``), prefills
   a ``--prompt``-token random prompt and decodes ``--tokens`` tokens through ``State.run``,
   keeping the arguments of the step's last call;
2. times ``--calls`` calls of the compiled step alone with the normal barrier array, then as
   many with the long one, and prints each phase's mean time per token for every task (the
   waits are the barriers: time a task spent waiting for the others);
3. times ``olv_runtime.generate`` per token (median of the callback-to-callback times of 3
   runs of 64 tokens) and the step's call inside it: the rest is the Python around the step
   (executor, state, sampling) measured with the caches as the step leaves them.

    python bench/stack_phases.py [--model ~/.cache/olv_bench/q05b_int4/model.onnx]
        [--threads 2] [--calls 100] [--exact]

Timings only (bench/, never asserted); wrap in ``flock /tmp/olv_bench.lock`` on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/olv_bench/q05b_int4/model.onnx"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--exact", action="store_true", help="exact mode (float32 activations)")
    a = ap.parse_args()

    import olv_runtime
    from olv_runtime.state import empty_cache, make_state

    sess = olv_runtime.InferenceSession(olv_runtime.load(a.model), olv_runtime.SessionOptions(
        num_threads=a.threads, quantize_activations=not a.exact))
    stacks = [s.impl for s in sess.all_steps() if s.kind == "DecoderStack"]
    if not stacks:
        raise SystemExit("the plan has no compiled decode step (DecoderStack)")
    stack = stacks[0]
    ds = stack._ds
    seen = {}
    real = stack.run_kernel

    def capture(*args):
        seen["args"] = args
        return real(*args)

    stack.run_kernel = capture
    vocab = stack.vocab
    st = make_state(sess, empty_cache(sess))
    feed = np.random.default_rng(0).integers(0, vocab, (1, a.prompt)).astype(np.int64)
    for _ in range(a.tokens + 1):
        lg = st.run({"input_ids": feed})["logits"][0, -1]
        feed = np.array([[int(np.argmax(lg))]], np.int64)
    stack.run_kernel = real
    if "args" not in seen:
        raise SystemExit("the compiled step did not run (one-token calls went per-operator)")
    fn, call = ds._stack_call(*seen["args"])
    call = list(call)
    nt = 1 if fn is ds._stack_thread else int(call[0])  # serial entry: (0, 1, ...)
    bi = next(i for i, v in enumerate(call) if v is seen["args"][-2].bar)
    normal = call[bi]
    prof = np.zeros(ds.barrier_slots(nt) + nt * ds.PROF_SLOTS, np.int64)

    def timed(n):
        ts = np.empty(n)
        for i in range(n):
            t0 = time.perf_counter()
            fn(*call)
            ts[i] = time.perf_counter() - t0
        return ts * 1e3

    for _ in range(5):
        fn(*call)
    t_plain = timed(a.calls)
    call[bi] = prof
    fn(*call)
    prof[ds.barrier_slots(nt):] = 0
    c0, w0 = ds.cycles_now(), time.perf_counter()
    t_prof = timed(a.calls)
    c1, w1 = ds.cycles_now(), time.perf_counter()
    call[bi] = normal
    hz = (c1 - c0) / (w1 - w0)
    ph = prof[ds.barrier_slots(nt):].reshape(nt, ds.PROF_SLOTS)[:, :len(ds.PHASES)]
    us = ph / hz * 1e6 / a.calls

    # generate: per-token time and the step's call inside it
    inside = []

    def timed_kernel(*args):
        t0 = time.perf_counter()
        r = real(*args)
        inside.append(time.perf_counter() - t0)
        return r

    prompt = np.random.default_rng(0).integers(0, vocab, a.prompt).astype(np.int64)
    olv_runtime.generate(sess, prompt, 16)
    stack.run_kernel = timed_kernel
    inside.clear()
    tt = []
    for _ in range(3):
        stamps = []
        olv_runtime.generate(sess, prompt, 64, callback=lambda t: stamps.append(time.perf_counter()))
        tt += list(np.diff(stamps))
    stack.run_kernel = real
    tok = float(np.median(tt)) * 1e3
    ker = float(np.median(inside)) * 1e3

    print(f"model {a.model}; {'exact' if a.exact else 'int8 activations'}; {nt} task(s); "
          f"context {a.prompt + a.tokens}; load average {os.getloadavg()[0]:.2f}")
    print(f"step alone: median {np.median(t_plain):.3f} ms (min {t_plain.min():.3f}); with the "
          f"phase stamps: median {np.median(t_prof):.3f} ms; time-stamp counter {hz / 1e9:.3f} GHz")
    print()
    print("| phase | " + " | ".join(f"task {t} us/token" for t in range(nt)) + " |")
    print("|---|" + "---|" * nt)
    for k, name in enumerate(ds.PHASES):
        print(f"| {name} | " + " | ".join(f"{us[t, k]:.1f}" for t in range(nt)) + " |")
    print("| sum | " + " | ".join(f"{us[t].sum():.1f}" for t in range(nt)) + " |")
    waits = [k for k, n in enumerate(ds.PHASES) if n.startswith("wait") or n == "final wait"]
    print()
    print("waits (mean over tasks): %.1f us/token" % us[:, waits].sum(axis=1).mean())
    print(f"generate: {tok:.3f} ms/token ({1e3 / tok:.1f} tok/s), the step's call inside it "
          f"{ker:.3f} ms, Python around it {tok - ker:.3f} ms")


if __name__ == "__main__":
    main()
