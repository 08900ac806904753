"""Benchmark: where olv's prefill time goes, per step kind of the per-operator plan.

    python bench/prefill_phases.py MODEL.onnx|FILE.gguf [--lens 128,512] [--runs 3]
                                   [--threads 2] [--exact] [--json OUT]

A prompt of ``len`` tokens runs as one call of the session's plan (the compiled decoder step
serves one-token decode only). Every step's ``fn`` is wrapped by a wall-clock timer; the time is
summed by label: the step kind, and for a Linear its kernel (``ggml Q5_0 int8``, ``packed_i8``,
...) and its output width, so the linears of each ggml block type and shape show apart. Columns
per prompt length: milliseconds (median over ``--runs`` after one warm-up), share of the steps'
sum, and, for linears, GMAC/s (``len x N x K`` multiply-adds per call; ``len = 1`` for the
lm_head, which runs on the last position only). The line ``outside steps`` is the call's wall
time minus the steps' sum (argument checks, buffer pool, Python dispatch).

A GGUF file is converted once by ``olv_runtime.convert`` into ``--cache-dir/gguf_olv/<stem>/``
(payloads stay in the .gguf), as bench/prefill_gguf.py does. The peers' totals for the same file
come from bench/decode.py's GGUF rows (ik_llama.cpp's ``llama-bench`` reports no per-operator
times); this script says which phase a gap lives in. Timings depend on the machine's load:
compare ratios of one run. Not run by the test command.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import time

import numpy as np

import olv_runtime
from olv_runtime.executor.steps import ROWWISE_KINDS


def _label(step) -> tuple[str, float]:
    """(label, multiply-adds per row it computes) of a plan step."""
    impl = getattr(step, "impl", None)
    if step.kind == "Linear" and impl is not None:
        kernel = getattr(impl, "kernel", "?")
        n, k = getattr(impl, "n", None), getattr(impl, "k", None)
        shape = f" {n}x{k}" if n and k else ""
        return f"Linear {kernel}{shape}", float(n * k) if n and k else 0.0
    return step.kind, 0.0


def _leaves(plan_steps) -> list:
    """The plan's steps, a container's (``DecoderStack``: its ``sub_steps``, which run one by
    one for a prefill) replaced by its own steps."""
    out = []
    for step in plan_steps:
        subs = getattr(getattr(step, "impl", None), "sub_steps", None)
        out.extend(_leaves(subs) if subs else [step])
    return out


def _wrap(steps, acc, macs):
    """Wrap each step's fn with a timer adding into ``acc[label]``; returns the originals."""
    saved = []
    for step in steps:
        fn = step.fn
        label, mac = _label(step)
        macs[label] = mac

        def timed(*args, _fn=fn, _label=label):
            t = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                acc[_label] += time.perf_counter() - t
        saved.append((step, fn))
        step.fn = timed
    return saved


def phases(sess, vocab, length, runs):
    """Per-label median milliseconds of a ``length``-token prefill, and the median wall time."""
    ids = np.random.default_rng(length).integers(0, vocab, length, dtype=np.int64)
    olv_runtime.generate(sess, ids, 1)  # warm-up: compilation, buffers, the slot plan
    steps = _leaves([st for st, *_ in sess._slots.steps])
    acc = collections.defaultdict(float)
    macs: dict[str, float] = {}
    counts = collections.Counter(_label(st)[0] for st in steps)
    # linears producing the logits run on the last position only (generate's last_only)
    last = {_label(st)[0] for st in steps
            if st.kind in ROWWISE_KINDS and "logits" in st.outputs}
    saved = _wrap(steps, acc, macs)
    per_run, walls = [], []
    try:
        for _ in range(runs):
            acc.clear()
            s = olv_runtime.GenerationStats()
            olv_runtime.generate(sess, ids, 1, stats=s)
            per_run.append(dict(acc))
            walls.append(s.prefill_seconds)
    finally:
        for step, fn in saved:
            step.fn = fn
    labels = sorted({k for r in per_run for k in r})
    med = {k: statistics.median(r.get(k, 0.0) for r in per_run) for k in labels}
    return med, statistics.median(walls), macs, counts, last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="an olv .onnx model or a .gguf file")
    ap.add_argument("--lens", default="128,512")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exact", action="store_true", help="float32 activations (exact mode)")
    ap.add_argument("--vocab", type=int, default=None, help="ids drawn below this (default: "
                    "the model's vocabulary)")
    ap.add_argument("--top", type=int, default=14, help="rows shown per length (largest first)")
    ap.add_argument("--cache-dir", default=os.environ.get("OLV_BENCH_CACHE", "~/.cache/olv_bench"))
    ap.add_argument("--json")
    args = ap.parse_args()
    lens = [int(v) for v in args.lens.split(",")]
    path = pathlib.Path(args.model).expanduser()
    if path.suffix == ".gguf":
        target = pathlib.Path(args.cache_dir).expanduser() / "gguf_olv" / path.stem / "model.onnx"
        if not (target.is_file() and target.stat().st_mtime >= path.stat().st_mtime):
            olv_runtime.convert(path, target)
        path = target
    opts = olv_runtime.SessionOptions(num_threads=args.threads,
                                      quantize_activations=not args.exact)
    sess = olv_runtime.InferenceSession(olv_runtime.load(path), opts)
    vocab = args.vocab or int(sess.get_outputs()[0].shape[-1])
    out = {}
    mode = "exact" if args.exact else "int8"
    for ln in lens:
        med, wall, macs, counts, last = phases(sess, vocab, ln, args.runs)
        total = sum(med.values())
        print(f"\n{path.parent.name} ({mode}, {args.threads} threads), prefill {ln}: "
              f"{wall * 1e3:.1f} ms wall = {ln / wall:.1f} tok/s; steps {total * 1e3:.1f} ms")
        print("| step (calls per prefill) | ms | share | GMAC/s |\n|---|---|---|---|")
        for k in sorted(med, key=med.get, reverse=True)[:args.top]:
            rows = 1 if k in last else ln
            g = (rows * macs[k] * counts[k] / med[k] / 1e9) if macs[k] and med[k] else None
            print(f"| {k} ({counts[k]}) | {med[k] * 1e3:.2f} | {med[k] / total:.1%} | "
                  + (f"{g:.1f} |" if g else "|"))
        rest = sorted(med, key=med.get, reverse=True)[args.top:]
        if rest:
            print(f"| {len(rest)} other labels | {sum(med[k] for k in rest) * 1e3:.2f} | "
                  f"{sum(med[k] for k in rest) / total:.1%} | |")
        print(f"| outside steps | {(wall - total) * 1e3:.2f} | | |")
        out[ln] = {"wall": wall, "steps": med, "calls": dict(counts)}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
