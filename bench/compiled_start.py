"""Warm start, session creation, peak RSS and decode speed with and without seed 004 compiled
entries (issue 14), and llama.cpp's peak RSS on a GGUF of the same checkpoint.

    python bench/compiled_start.py MODEL.onnx [COMPILED.onnx] [--gguf Q4_0.gguf] [--threads 2]
        [--prompt-len 32] [--new-tokens 64] [--quantize-activations]

Every measurement runs in its own fresh process (so peak RSS is that backend's alone, VmHWM):
``import olv_runtime`` -> load -> InferenceSession -> prefill of a random prompt (first token)
-> ``--new-tokens`` greedy decode tokens. Printed per model: time from import to the first token,
session creation time (also as process CPU time, close to what a quiet machine shows),
compiled hits/misses, bytes repacked, decode tok/s (1 / median per-token
time), peak RSS (VmHWM) and the resident split after decode (RssAnon / RssFile). The llama.cpp
row (llama-cpp-python, mmap on, same threads, same prompt length and tokens) reports peak RSS
and decode tok/s. The numba cache must be warm (run once before; bench/cold_start.py measures
the cold case). Run on a quiet machine.

Python bytecode: a wheel install (``pip install olv_runtime``) byte-compiles the package, so its
imports read ``.pyc`` files; an editable install writes them at the first import unless
``PYTHONDONTWRITEBYTECODE`` is set (it is in some sandboxes), in which case every process
compiles each module it imports from source: ~0.05 s more session creation (the kernel modules
a session imports) and more import time. The header line says which case was measured;
``--byte-compile`` first byte-compiles the package (``compileall``, as pip does for a wheel).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time


def _status() -> dict:
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[k] = int(v.split()[0]) * 1024
    return out


def child_olv(spec: dict) -> dict:
    c0 = time.process_time()
    import numpy as np

    import olv_runtime

    t_import = olv_runtime.IMPORT_TIME
    t0 = time.perf_counter()
    model = olv_runtime.load(spec["model"])
    t1 = time.perf_counter()
    c1 = time.process_time()
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(
        num_threads=spec["threads"], quantize_activations=spec["quantize"]))
    t_sess = time.perf_counter() - t1
    c_sess = time.process_time() - c1
    vocab = int(model.metadata().get("olv.vocab_size", "1000"))
    prompt = np.random.default_rng(0).integers(0, vocab, size=spec["prompt_len"]).tolist()
    stamps = []
    cpu_first = []

    def cb(tok):
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu_first.append(time.process_time() - c0)

    olv_runtime.generate(sess, prompt, spec["new_tokens"], callback=cb)
    per = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    c = sess.counters.snapshot()
    st = _status()
    return {"first_token": stamps[0] - t_import, "session": t_sess, "session_cpu": c_sess,
            "import": t0 - t_import, "load": t1 - t0, "prefill": stamps[0] - t1 - t_sess,
            "first_decode": stamps[1] - stamps[0] if len(stamps) > 1 else 0.0,
            "first_token_cpu": cpu_first[0],
            "hits": c["compiled_hits"], "misses": c["compiled_misses"],
            "repacked": c["bytes_repacked"], "digest": c["bytes_digest_verified"],
            "decode_tps": 1.0 / per[len(per) // 2] if per else 0.0, **st}


def child_llama(spec: dict) -> dict:
    import numpy as np
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["prompt_len"] + spec["new_tokens"] + 16,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_batch=512, logits_all=False, verbose=False)
    t_sess = time.perf_counter() - t0
    nv = llm.n_vocab()
    prompt = np.random.default_rng(0).integers(0, nv, size=spec["prompt_len"]).tolist()

    def logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))

    llm.eval([int(i) for i in prompt])
    tok = int(np.argmax(logits()))
    t_first = time.perf_counter() - t0
    stamps = [time.perf_counter()]
    for _ in range(spec["new_tokens"] - 1):
        llm.eval([tok])
        tok = int(np.argmax(logits()))
        stamps.append(time.perf_counter())
    per = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return {"first_token": t_first, "session": t_sess, "decode_tps": 1.0 / per[len(per) // 2],
            **_status()}


def bytecode_status() -> str:
    """How many of olv_runtime's modules have an up-to-date .pyc, and whether Python writes
    them (PYTHONDONTWRITEBYTECODE)."""
    import importlib.util

    root = pathlib.Path(__file__).resolve().parent.parent / "olv_runtime"
    srcs = list(root.rglob("*.py"))
    fresh = 0
    for src in srcs:
        pyc = pathlib.Path(importlib.util.cache_from_source(str(src)))
        if pyc.is_file() and pyc.stat().st_mtime >= src.stat().st_mtime:
            fresh += 1
    writes = "not written (PYTHONDONTWRITEBYTECODE set)" if sys.flags.dont_write_bytecode \
        else "written at first import"
    return f"bytecode: {fresh} of {len(srcs)} olv_runtime modules byte-compiled; .pyc files {writes}"


def byte_compile() -> None:
    """Byte-compile the olv_runtime package (what pip does when it installs a wheel)."""
    import compileall

    root = pathlib.Path(__file__).resolve().parent.parent / "olv_runtime"
    compileall.compile_dir(str(root), quiet=1)


def run_child(kind: str, spec: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, spec = sys.argv[2], json.loads(sys.argv[3])
        out = child_olv(spec) if kind == "olv" else child_llama(spec)
        print(json.dumps(out))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="olv .onnx models (e.g. plain and compiled)")
    ap.add_argument("--gguf", help="llama.cpp GGUF of the same checkpoint (bench/gguf_export.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quantize-activations", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="runs per model (all printed)")
    ap.add_argument("--byte-compile", action="store_true",
                    help="byte-compile olv_runtime first (compileall), as a wheel install does")
    ns = ap.parse_args(argv)
    if ns.byte_compile:
        byte_compile()
    base = {"threads": ns.threads, "prompt_len": ns.prompt_len, "new_tokens": ns.new_tokens,
            "quantize": ns.quantize_activations}
    print(f"threads {ns.threads}, prompt {ns.prompt_len}, {ns.new_tokens} new tokens, "
          f"activations {'int8' if ns.quantize_activations else 'float32'}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(bytecode_status())
    mb = 1e6
    for path in ns.models:
        for _ in range(ns.repeat):
            r = run_child("olv", dict(base, model=path))
            print(f"olv {path}: first token {r['first_token']:.3f} s after import "
                  f"({r['first_token_cpu']:.3f} s CPU; import {r['import']:.3f} + load "
                  f"{r['load']:.3f} + session {r['session']:.3f} + first run (prefill) "
                  f"{r['prefill']:.3f} s; first decode step "
                  f"{r['first_decode']:.3f} s), session creation {r['session']:.3f} s "
                  f"({r['session_cpu']:.3f} s CPU), compiled hits "
                  f"{r['hits']} misses {r['misses']}, repacked {r['repacked'] / mb:.0f} MB, "
                  f"digests hashed {r['digest'] / mb:.0f} MB, "
                  f"decode {r['decode_tps']:.1f} tok/s, peak RSS {r['VmHWM'] / mb:.0f} MB "
                  f"(after decode: anon {r['RssAnon'] / mb:.0f} MB, file {r['RssFile'] / mb:.0f} MB)",
                  flush=True)
    if ns.gguf:
        for _ in range(ns.repeat):
            r = run_child("llama", dict(base, gguf=ns.gguf))
            print(f"llama.cpp {ns.gguf}: first token {r['first_token']:.3f} s after Llama(), "
                  f"load {r['session']:.3f} s, decode {r['decode_tps']:.1f} tok/s, peak RSS "
                  f"{r['VmHWM'] / mb:.0f} MB (after decode: anon {r['RssAnon'] / mb:.0f} MB, file "
                  f"{r['RssFile'] / mb:.0f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
