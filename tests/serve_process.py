"""A server in a subprocess, as the tests start one: a free loopback port, a bounded wait for
``/health`` while the process stays alive, and a bounded stop. Used by the tests that run
``olv serve`` (or a README command, or llama-cpp-python's server) as users do; the in-process
server is tests/server/live_server.py."""
from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, why=lambda: "") -> None:
    """Poll ``url + "/health"`` every 0.1 s until it answers 200. Fails the test (AssertionError)
    when ``proc`` exits first (message: ``why()``, e.g. the tail of its stderr) or after
    ``timeout`` seconds."""
    import httpx  # the test extra has it; the callers importorskip it first

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}: {why()}"
        assert time.monotonic() < deadline, f"the server was not ready in {timeout} s: {why()}"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate ``proc`` if it still runs, kill it after ``timeout`` seconds, reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
