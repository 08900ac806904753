"""Decode tok/s of GGUF files on the per-operator plan vs the compiled decoder step (issue: ggml
weights on the compiled step), alternating processes in one run, with llama-bench on the same
files when it exists.

    python bench/ggml_step.py --gguf a.gguf,b.gguf [--threads 2] [--new-tokens 64] [--rounds 3]
        [--llama-bench /work/ik/build/bin/llama-bench]

Each file is converted once (``olv convert``, payloads stay in the .gguf) beside it. Per round,
per file, every (plan | step) x (exact | int8 activations) runs in its own process: a session
(``compiled_decode`` False / True), a warm-up ``generate``, then ``--runs`` generations of
``--new-tokens`` tokens after a ``--prompt-len`` prompt; decode tok/s = 1 / median time between
tokens. Then ``llama-bench -n N -p 0 -t T -rtr 1`` on the file. The table gives medians over the
rounds; compare within one run only (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, numpy as np, olv_runtime
spec = json.loads(sys.argv[1])
m = olv_runtime.load(spec["model"])
t0 = time.perf_counter()
s = olv_runtime.InferenceSession(m, olv_runtime.SessionOptions(
    compiled_decode=spec["compiled"], quantize_activations=spec["quant"],
    num_threads=spec["threads"]))
t_sess = time.perf_counter() - t0
rng = np.random.default_rng(0)
prompt = rng.integers(10, 1000, spec["prompt_len"]).astype(np.int64)
t0 = time.perf_counter()
olv_runtime.generate(s, prompt, 4)  # compiles / loads the kernels
t_warm = time.perf_counter() - t0
gaps = []
for _ in range(spec["runs"]):
    st = []
    olv_runtime.generate(s, prompt, spec["new_tokens"],
                         callback=lambda t: st.append(time.perf_counter()))
    gaps += [b - a for a, b in zip(st, st[1:])]
kinds = [k for k, _ in s.plan()]
print("RESULT " + json.dumps({
    "tps": 1.0 / float(np.median(gaps)), "stack": kinds.count("DecoderStack"),
    "linear_steps": kinds.count("Linear"), "session_s": t_sess, "warm_s": t_warm,
    "bytes_dequantized": s.counters["bytes_dequantized"]}))
"""


def run_child(spec, env):
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], check=False,
                         capture_output=True, text=True, env=env, timeout=3600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(out.stderr[-3000:])


def llama_bench(exe, f, n, threads):
    out = subprocess.run([exe, "-m", str(f), "-n", str(n), "-p", "0", "-t", str(threads),
                          "-rtr", "1", "-o", "json"], check=False, capture_output=True, text=True,
                         timeout=1800)
    try:
        rows = json.loads(out.stdout)
        return float(rows[0]["avg_ts"])
    except (ValueError, KeyError, IndexError):
        m = re.search(r"tg\d+\s*\|\s*([\d.]+)", out.stdout)
        if m:
            return float(m.group(1))
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-bench", default="/work/ik/build/bin/llama-bench")
    args = ap.parse_args(argv)
    import olv_runtime

    files = [pathlib.Path(p).expanduser() for p in args.gguf.split(",") if p.strip()]
    models = {}
    for f in files:
        target = f.parent / f"{f.stem}_olv" / "model.onnx"
        if not target.is_file():
            print(f"olv convert {f} -> {target}", flush=True)
            olv_runtime.convert(f, target)
        models[f] = target
    env = dict(os.environ)
    configs = [(c, q) for c in (False, True) for q in (False, True)]
    res = {(f, c): [] for f in files for c in configs + ["llama"]}
    have_llama = os.path.isfile(args.llama_bench)
    for r in range(args.rounds):
        for f in files:
            for compiled, quant in configs:
                spec = dict(model=str(models[f]), compiled=compiled, quant=quant,
                            threads=args.threads, new_tokens=args.new_tokens,
                            prompt_len=args.prompt_len, runs=args.runs)
                t0 = time.time()
                out = run_child(spec, env)
                res[(f, (compiled, quant))].append(out)
                print(f"round {r} {f.name} {'step' if compiled else 'plan'} "
                      f"{'int8' if quant else 'exact'}: {out['tps']:.1f} tok/s "
                      f"(stack {out['stack']}, Linear steps {out['linear_steps']}, session "
                      f"{out['session_s']:.1f} s, warm-up {out['warm_s']:.1f} s, process "
                      f"{time.time() - t0:.0f} s)", flush=True)
            if have_llama:
                tps = llama_bench(args.llama_bench, f, args.new_tokens, args.threads)
                res[(f, "llama")].append({"tps": tps})
                print(f"round {r} {f.name} llama-bench: {tps:.1f} tok/s", flush=True)
    print()
    print("| file | plan exact | step exact | plan int8 | step int8 | step/plan exact | "
          "step/plan int8 | llama-bench -rtr 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for f in files:
        med = {c: statistics.median(x["tps"] for x in res[(f, c)]) if res[(f, c)] else None
               for c in configs + ["llama"]}
        pe, se = med[(False, False)], med[(True, False)]
        pq, sq = med[(False, True)], med[(True, True)]
        ll = f"{med['llama']:.1f}" if med["llama"] else "-"
        print(f"| {f.name} | {pe:.1f} | {se:.1f} | {pq:.1f} | {sq:.1f} | {se / pe:.2f} | "
              f"{sq / pq:.2f} | {ll} |")
    print(f"(decode tok/s, median of {args.rounds} rounds, {args.threads} threads, "
          f"{args.new_tokens} new tokens after {args.prompt_len})")


if __name__ == "__main__":
    main()
