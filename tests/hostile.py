"""Run hostile cases in a child process with a memory cap and a time limit (issue 26).

``run_cases(setup, cases)`` starts one Python child (address space capped with RLIMIT_AS, the
whole run bounded by ``timeout``) that executes ``setup`` once, then for each case
``(name, expression)`` evaluates the expression and prints one JSON line: the case name, the
outcome (``"ok"`` with ``repr`` of the result, or the exception's class name, its OlvError-ness
and message) and the seconds the case took. A case that exhausts the memory cap shows up as a
``MemoryError`` (or the child dying), a hang as the child being killed at ``timeout``: both are
failures the caller's asserts see, never a stuck or swapped test run.
"""
from __future__ import annotations

import json
import pathlib
import resource
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

_RUNNER = r'''
import json, sys, time, traceback
sys.path.insert(0, __ROOT__)  # this checkout's olv_runtime, not an installed one
from olv_runtime.errors import OlvError
__SETUP__
for __name, __expr in __CASES__:
    __t0 = time.perf_counter()
    try:
        __r = eval(__expr)
        __rec = {"case": __name, "outcome": "ok", "result": repr(__r)[:300]}
    except BaseException as __exc:  # noqa: BLE001 - reported to the parent
        __rec = {"case": __name, "outcome": type(__exc).__name__,
                 "olv": isinstance(__exc, OlvError), "msg": str(__exc)[:500]}
    __rec["seconds"] = time.perf_counter() - __t0
    print(json.dumps(__rec), flush=True)
'''


def _limit(mem_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_cases(setup: str, cases: list, *, timeout: float = 180.0,
              mem_bytes: int = 2 << 30) -> dict:
    """Run ``cases`` (``[(name, python expression)]``) after ``setup`` in one capped child.

    Returns ``{name: record}``; a case with no record (the child died or was killed) is
    missing, and ``"__exit__"`` holds the child's return code and the tail of its stderr.
    """
    code = _RUNNER.replace("__SETUP__", textwrap.dedent(setup)).replace(
        "__CASES__", repr(list(cases))).replace("__ROOT__", repr(str(ROOT)))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=_limit(mem_bytes))
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc = "timeout"
    got = {}
    for line in out.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            got[rec["case"]] = rec
    got["__exit__"] = {"rc": rc, "stderr": err[-2000:]}
    return got
