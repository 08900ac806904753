"""Benchmark: olv prefill tok/s on GGUF files (int8 activations), for A/B runs of two checkouts.

    python bench/prefill_gguf.py FILE.gguf[,FILE2.gguf] [--lens 128,512] [--runs 3] [--threads 2]
                                 [--exact] [--json OUT]

Each file is converted once by ``olv_runtime.convert`` (payloads stay in the .gguf) into
``--cache-dir/gguf_olv/<stem>/model.onnx``; a session with ``quantize_activations=True`` (or
exact mode with ``--exact``) then runs ``generate(ids, 1)`` on random prompt ids of each length:
one warm-up, then ``--runs`` measured prefills (``GenerationStats.prefill_seconds``), median
tok/s. The olv checkout measured is the one on ``PYTHONPATH``: run it once per checkout
(alternating) with a private ``NUMBA_CACHE_DIR`` each, and ik_llama.cpp's
``llama-bench -p 128,512 -n 0 -t 2 -rtr 1 -m FILE`` in the same minutes for the ratio.
Not run by the test command.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import numpy as np

import olv_runtime


def prefill_tps(sess, vocab, lens, runs):
    out = {}
    for ln in lens:
        ids = np.random.default_rng(ln).integers(0, vocab, ln, dtype=np.int64)

        def one(ids=ids):
            s = olv_runtime.GenerationStats()
            olv_runtime.generate(sess, ids, 1, stats=s)
            return s.prefill_seconds
        one()  # warm-up: compilation, buffers of this length
        out[ln] = statistics.median(ln / one() for _ in range(runs))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files")
    ap.add_argument("--lens", default="128,512")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exact", action="store_true", help="float32 activations (exact mode)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--cache-dir", default=os.environ.get("OLV_BENCH_CACHE", "~/.cache/olv_bench"))
    ap.add_argument("--json")
    args = ap.parse_args()
    lens = [int(v) for v in args.lens.split(",")]
    cache = pathlib.Path(args.cache_dir).expanduser()
    res = {}
    for f in (pathlib.Path(p).expanduser() for p in args.files.split(",")):
        target = cache / "gguf_olv" / f.stem / "model.onnx"
        if not (target.is_file() and target.stat().st_mtime >= f.stat().st_mtime):
            olv_runtime.convert(f, target)
        opts = olv_runtime.SessionOptions(num_threads=args.threads,
                                          quantize_activations=not args.exact)
        sess = olv_runtime.InferenceSession(olv_runtime.load(target), opts)
        res[f.name] = prefill_tps(sess, args.vocab, lens, args.runs)
        print(f"{f.name}: " + ", ".join(f"prefill {ln}: {v:.1f} tok/s"
                                         for ln, v in res[f.name].items()), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
