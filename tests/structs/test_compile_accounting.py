"""Kernel preparation kept out of the reported rates (issue 14, cold start).

On a cold numba cache the first token comes from the prefill while a worker process compiles
the decode step (olv_runtime.kernels.precompile); the first decode step may then wait for it.
That wait -- and any compilation or cache load in the measured calls -- is measured on the
calling thread (``precompile.kernel_seconds``), kept out of ``GenerationStats.prefill_seconds``
/ ``decode_seconds`` and reported as ``prefill_compile_seconds`` / ``decode_compile_seconds``.

The checks are identities between measured quantities, never speeds: a rate that still held the
wait would make ``prefill + decode + compile seconds`` exceed the wall time of the call.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numba
import numpy as np
import pytest

import olv_runtime
from olv_runtime import cli
from olv_runtime.kernels import precompile

PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("accounting") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return path


@pytest.fixture
def sess(model):
    s = olv_runtime.InferenceSession(olv_runtime.load(model))
    olv_runtime.generate(s, PROMPT, 3)  # every kernel of prefill and decode ready in-process
    return s


def _stack(sess):
    (stack,) = [s for s in sess.all_steps() if s.kind == "DecoderStack"]
    return stack.impl


def _fresh():
    """A function no numba cache knows (not cached on disk, new objects each call): its first
    call compiles it and its callee."""
    def inner(x):
        return x * 3 + 1

    inner_j = numba.njit(inner)

    def outer(x):
        return inner_j(x) - 1

    return numba.njit(outer)


def _blocking_job(tmp_path, release_after: float):
    """A :class:`precompile.Job` whose worker runs until its stdin is closed, which happens
    ``release_after`` seconds after the main process starts waiting for it (so that wait lasts
    at least that long, however long the work before it took); it writes no result (nothing is
    loaded)."""
    tmp = tmp_path / "job"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read()"],
                            stdin=subprocess.PIPE)
    real_wait = proc.wait

    def wait(timeout=None):
        threading.Timer(release_after, proc.stdin.close).start()
        return real_wait(timeout)

    proc.wait = wait
    return precompile.Job([], proc, str(tmp), str(tmp / "result.pkl"))


def _timed_generate(sess, n):
    st = olv_runtime.GenerationStats()
    t0 = time.perf_counter()
    ids = olv_runtime.generate(sess, PROMPT, n, stats=st)
    return ids, st, time.perf_counter() - t0


# -- the clock ----------------------------------------------------------------------------------
def test_kernel_clock_counts_a_compilation_once_and_per_thread():
    f = _fresh()
    k0 = precompile.kernel_seconds()
    t0 = time.perf_counter()
    assert f(2) == 6
    wall = time.perf_counter() - t0
    k = precompile.kernel_seconds() - k0
    # the callee's compilation nests in the caller's: counted once, so never above the elapsed
    # time (counted twice, it would be: the caller's compilation is nearly all of it)
    assert 0 < k <= wall
    k0 = precompile.kernel_seconds()
    for _ in range(50):
        f(3)
    assert precompile.kernel_seconds() == k0  # compiled calls take no lock: nothing counted
    g = _fresh()
    th = threading.Thread(target=g, args=(1,))
    th.start()
    th.join()
    assert precompile.kernel_seconds() == k0  # another thread's compilation: not this thread's
    t0 = time.perf_counter()
    with precompile.preparing():
        time.sleep(0.05)
        with precompile.preparing():  # nested: counted once (twice would exceed the wall time)
            time.sleep(0.1)
    wall = time.perf_counter() - t0
    k = precompile.kernel_seconds() - k0
    assert 0.15 <= k <= wall


def test_job_wait_counts_its_blocked_time(tmp_path):
    job = _blocking_job(tmp_path, 0.3)
    k0 = precompile.kernel_seconds()
    t0 = time.perf_counter()
    assert job.wait() == 0  # no result file: nothing loaded
    wall = time.perf_counter() - t0
    k = precompile.kernel_seconds() - k0
    assert 0.3 <= job.waited <= k <= wall
    assert job.wait() == 0 and precompile.kernel_seconds() - k0 - k < 0.05  # done: at once


# -- GenerationStats ----------------------------------------------------------------------------
def test_decode_rate_excludes_the_wait_for_the_decode_step(sess, tmp_path):
    stack = _stack(sess)
    job = _blocking_job(tmp_path, 0.5)
    stack._precompile = job  # as on a cold cache: the first one-token call waits for the worker
    ids, st, wall = _timed_generate(sess, 4)
    assert len(ids) == 4 and stack._precompile is False
    assert job.waited >= 0.5
    assert st.decode_compile_seconds >= job.waited
    assert st.prefill_compile_seconds == 0.0
    assert st.compile_seconds == st.decode_compile_seconds
    assert st.decode_seconds > 0 and st.prefill_seconds > 0
    # the wait is in the compile seconds and not in the decode seconds
    assert st.prefill_seconds + st.decode_seconds + st.compile_seconds <= wall
    assert st.decode_tokens_per_second == 3 / st.decode_seconds


def test_in_process_compilation_is_excluded_from_both_rates(sess, monkeypatch):
    """No worker (OLV_COMPILE_WORKERS=0, one CPU): the decode step compiles in this process at
    the first one-token call; any prefill kernel compiled in the prompt call likewise."""
    stack = _stack(sess)
    real_kernel, real_generic = stack.run_kernel, stack._run_generic
    fd, fp = _fresh(), _fresh()
    calls = []

    def run_kernel(*a):
        calls.append(fd(1))  # compiles at the first decode step
        return real_kernel(*a)

    def run_generic(args):
        fp(1)  # compiles at the prefill
        return real_generic(args)

    monkeypatch.setattr(stack, "run_kernel", run_kernel)
    monkeypatch.setattr(stack, "_run_generic", run_generic)
    ids, st, wall = _timed_generate(sess, 4)
    assert len(calls) == 3
    assert st.decode_compile_seconds > 0 and st.prefill_compile_seconds > 0
    assert st.prefill_seconds + st.decode_seconds + st.compile_seconds <= wall
    # warm: nothing to compile, the same tokens
    ids2, st2, _ = _timed_generate(sess, 4)
    assert st2.compile_seconds == 0.0 and list(ids2) == list(ids)


# -- the CLI ------------------------------------------------------------------------------------
def test_cli_warm_up_runs_the_prefill_only(sess, monkeypatch):
    stack = _stack(sess)
    calls = []
    real = stack.run_kernel
    monkeypatch.setattr(stack, "run_kernel", lambda *a: (calls.append(1), real(*a))[1])
    cli._warm_up(sess, PROMPT)
    assert calls == []  # the decode step is left to the worker (or to the second token)
    olv_runtime.generate(sess, PROMPT, 2)
    assert calls == [1]


def test_cli_reports_the_second_token_and_the_wait(model):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(olv_runtime.__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-m", "olv_runtime.cli", "generate", str(model),
                        "--prompt-ids", "5,17,99", "--max-new-tokens", "3", "--output", "ids",
                        "--timings"],  # the kernel diagnostics are opt-in since issue 26
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("first token")]
    assert len(line) == 1 and ", second token " in line[0], r.stderr
    first = float(line[0].split()[2])
    second = float(line[0].split(", second token ")[1].split()[0])
    assert second >= first
    assert "warm-up prefill" in r.stderr


# -- what the worker compiles first --------------------------------------------------------------
_ENTRIES_CHILD = r"""
import json, sys
import olv_runtime
from olv_runtime.kernels.decoder_layers import precompile_entries
sess = olv_runtime.InferenceSession(olv_runtime.load(sys.argv[1]))
(step,) = [s for s in sess.all_steps() if s.kind == "DecoderStack"]
first = precompile_entries(step.impl._decode_entry())[:-1]
sigs = lambda: [[str(t) for t in f.signatures] for f, _ in first]
olv_runtime.generate(sess, [5, 17, 99], 1)  # the prefill only
after_prefill = sigs()
olv_runtime.generate(sess, [5, 17, 99], 3)  # + the compiled decode step
print(json.dumps({"names": [f.py_func.__name__ for f, _ in first],
                  "want": [str(tuple(s)) for _, s in first],
                  "prefill": after_prefill, "decode": sigs()}))
"""


def test_worker_entries_are_the_specialisations_the_prefill_runs(model, tmp_path):
    """What a compile worker builds before the decode step (decode_stack.precompile_entries:
    prefill kernels, the attention rows) are exactly the specialisations the prefill compiles
    -- and the compiled step reuses the attention rows (else the worker would compile ones
    nobody uses and the main process would compile the real ones itself). A fresh numba cache,
    no worker."""
    import json

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), OLV_COMPILE_WORKERS="0")
    r = subprocess.run([sys.executable, "-c", _ENTRIES_CHILD, str(model)], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"_rope_token", "_state_init", "_attend_rows"} <= set(got["names"])
    assert got["prefill"] == [[w] for w in got["want"]], got["names"]  # the prefill's own
    assert got["decode"] == got["prefill"]  # the step added no other specialisation
