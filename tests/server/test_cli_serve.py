"""``olv serve`` as users run it: a subprocess on 127.0.0.1 and a free port, the openai client,
then SIGTERM: the in-flight stream finishes, the process exits 0 within --shutdown-timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from serve_process import free_port, wait_healthy

from olv_runtime.cli import build_parser

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SHUTDOWN = 3.0


def test_defaults_bind_loopback():
    args = build_parser().parse_args(["serve", "m.onnx"])
    assert (args.host, args.port, args.api_key, args.max_batch) == ("127.0.0.1", 8000, None, 16)


def test_missing_model_is_a_usage_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "olv_runtime.cli", "serve",
                        str(tmp_path / "none.onnx"), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "no such model file" in r.stderr


def test_a_model_that_fails_to_load_exits_1(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model at all")
    r = subprocess.run([sys.executable, "-m", "olv_runtime.cli", "serve", str(bad), "--port",
                        str(free_port()), "--log-level", "warning"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "loading failed" in r.stderr


@pytest.fixture
def proc(served_model):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "olv_runtime.cli", "serve", str(served_model),
                          "--port", str(port), "--served-model-name", "tiny", "--max-batch", "4",
                          "--kv-cache-tokens", "2048", "--shutdown-timeout", str(SHUTDOWN),
                          "--kv-dtype", "int8", "--quantize-activations", "--threads", "2",
                          "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(p, url, 180, lambda: p.communicate(timeout=10))
        yield p, url
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_serve_then_sigterm(proc):
    p, url = proc
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60, max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens <= 5
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as s:
        it = s.iter_lines()
        first = next(it)
        assert first.startswith("data: ")
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        lines = [first] + [ln for ln in it if ln]
    # the in-flight stream ended properly: its last chunk has a finish reason, then [DONE]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    assert p.wait(timeout=SHUTDOWN + 30) == 0
    assert time.monotonic() - t0 < SHUTDOWN + 10
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(url + "/health", timeout=5)
