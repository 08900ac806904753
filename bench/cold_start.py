"""Cold start of ``olv demo``: time from ``import olv_runtime`` to the first token (and to the
second), each run with an empty numba cache (a new user, a fresh CI clone). Issue 14 target for
the first token: <= 10 s.

    python bench/cold_start.py [--runs 3] [--threads 2] [--warm]

Each run starts a new process ``python -m olv_runtime.cli demo --max-new-tokens 4`` with
``NUMBA_CACHE_DIR`` set to a new empty directory and reads the line the CLI prints
(``first token X s after import olv_runtime, second token Y s``). The first token comes from
the prefill; the second one is the first decode step, whose compiled program a worker process
builds while the prefill runs (it may wait for it: the demo prints how long). ``--warm`` adds one
run that reuses the cache of the last cold run. Prints every run, the median, the process wall time and its CPU time (user +
system of the demo process and of the compile worker it starts, :mod:`olv_runtime.kernels.precompile`:
the two run on two cores at once, so on a quiet 2-core machine the wall time is below the CPU
time; ``OLV_COMPILE_WORKERS=0`` measures the single-process start).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_FIRST = re.compile(r"first token ([0-9.]+) s after import olv_runtime"
                    r"(?:, second token ([0-9.]+) s)?")
_WAIT = re.compile(r"decode calls waited ([0-9.]+) s")


def one_run(cache_dir: str, threads: int | None, workdir: str):
    """(seconds from import to the first token, to the second token (None if not printed),
    seconds the decode calls waited for kernel compilation, process wall seconds, process CPU
    seconds) of one ``olv demo``. The CPU time (user + system, all threads, the compile worker
    included) is nearly independent of other load on the machine."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-m", "olv_runtime.cli", "demo", "--max-new-tokens", "4",
           "--workdir", workdir]
    if threads:
        cmd += ["--threads", str(threads)]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if r.returncode != 0:
        raise SystemExit(f"olv demo failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    m = _FIRST.search(r.stderr)
    if m is None:
        raise SystemExit(f"no 'first token' line in the demo output:\n{r.stderr}")
    w = _WAIT.search(r.stderr)
    return (float(m.group(1)), float(m.group(2)) if m.group(2) else None,
            float(w.group(1)) if w else 0.0, wall, cpu)


def _fmt(first, second, wait, wall, cpu) -> str:
    sec = f", second token {second:.2f} s (waited {wait:.2f} s)" if second is not None else ""
    return f"first token {first:.2f} s after import olv_runtime{sec} (process {wall:.2f} s " \
           f"wall, {cpu:.2f} s CPU)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh-cache runs (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="--threads of olv demo")
    ap.add_argument("--warm", action="store_true", help="also one warm-cache run")
    ns = ap.parse_args(argv)
    firsts, seconds = [], []
    root = tempfile.mkdtemp(prefix="olv-cold-")
    try:
        cache = None
        for i in range(ns.runs):
            cache = os.path.join(root, f"numba-cache-{i}")
            os.mkdir(cache)
            run = one_run(cache, ns.threads, os.path.join(root, f"demo-{i}"))
            firsts.append(run[0])
            if run[1] is not None:
                seconds.append(run[1])
            print(f"cold run {i + 1}: {_fmt(*run)}; load average {os.getloadavg()[0]:.2f}",
                  flush=True)
        if ns.warm and cache is not None:
            run = one_run(cache, ns.threads, os.path.join(root, "demo-warm"))
            print(f"warm run: {_fmt(*run)}", flush=True)
        if firsts:
            sec = (f", second token {statistics.median(seconds):.2f} s" if seconds else "")
            print(f"cold start, median of {len(firsts)}: first token "
                  f"{statistics.median(firsts):.2f} s (target <= 10 s){sec}; load average "
                  f"{os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
