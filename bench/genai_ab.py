"""olv_runtime against onnxruntime-genai on the same builder folder, interleaved (issue 12).

bench/decode.py measures each backend in its own phase; on a shared machine the load can change
between phases. This script alternates the backends round by round in one process (same prompt,
same threads, greedy decode), so each round's ratio compares the two under the same load:

    python bench/genai_ab.py ~/.cache/olv_bench/genai/q05b_int4 --rounds 5 --new-tokens 48

Prints per round the median per-token decode rate of onnxruntime-genai, olv int8 activations
and olv exact, the ratios, and the median ratio over the rounds. The genai folder's
``genai_config.json`` sets onnxruntime-genai's threads (``intra_op_num_threads``); olv uses
``--threads`` (default: the same).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    folder = args.folder.expanduser()
    cfg = json.loads((folder / "genai_config.json").read_text())
    so = cfg["model"]["decoder"].get("session_options", {})
    threads = args.threads or int(so.get("intra_op_num_threads") or os.cpu_count())

    import onnxruntime_genai as og

    import olv_runtime
    from olv_runtime.kernels import set_num_threads

    set_num_threads(threads)
    vocab = int(cfg["model"]["vocab_size"])
    prompt = np.random.default_rng(0).integers(10, vocab - 10, args.prompt_len).astype(np.int64)
    n = args.new_tokens

    model = og.Model(og.Config(str(folder)))

    def genai_rate():
        params = og.GeneratorParams(model)
        total = len(prompt) + n + 1
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens([int(i) for i in prompt])
        gen.generate_next_token()
        stamps = [time.perf_counter()]
        for _ in range(n - 1):
            gen.generate_next_token()
            stamps.append(time.perf_counter())
        return 1.0 / statistics.median(np.diff(stamps))

    sessions = {}
    for mode, quant in (("olv int8", True), ("olv exact", False)):
        sessions[mode] = olv_runtime.InferenceSession(
            str(folder / "model.onnx"), olv_runtime.SessionOptions(
                quantize_activations=quant, num_threads=threads))

    def olv_rate(sess):
        stamps = []
        olv_runtime.generate(sess, prompt, n, callback=lambda t: stamps.append(time.perf_counter()))
        return 1.0 / statistics.median(np.diff(stamps))

    genai_rate()  # warm-up
    for sess in sessions.values():
        olv_rate(sess)
    kinds = [k for k, _ in sessions["olv int8"].plan()]
    print(f"olv plan: {len(kinds)} steps, DecoderStack: {kinds.count('DecoderStack')}; "
          f"threads {threads}; load {os.getloadavg()[0]:.2f}")
    ratios = {m: [] for m in sessions}
    for r in range(args.rounds):
        g = genai_rate()
        row = [f"round {r}: genai {g:6.1f} tok/s"]
        for mode, sess in sessions.items():
            v = olv_rate(sess)
            ratios[mode].append(v / g)
            row.append(f"{mode} {v:6.1f} ({v / g:.2f}x)")
        print(", ".join(row) + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    for mode, rs in ratios.items():
        print(f"{mode} / onnxruntime-genai: median {statistics.median(rs):.2f}x "
              f"(rounds {', '.join(f'{x:.2f}' for x in rs)})")


if __name__ == "__main__":
    main()
