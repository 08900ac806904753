"""The README's "Serving" blocks run as written: curl lines in bash and the openai-client
snippet, against ``olv serve tiny.onnx --api-key sekret`` started on a free loopback port (the
port 8000 of the text replaced by it)."""
from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout

import pytest

from hostile import ROOT
from olv_runtime.cli import main as cli_main

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")


def _block(marker: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(re.escape(f"<!-- readme-test: {marker} -->") + r"\s*```[^\n]*\n(.*?)```",
                  text, re.S)
    assert m is not None, marker
    return m.group(1)


def test_serving_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "tiny-ckpt", "--layers", "2"]) == 0
    assert cli_main(["convert", "tiny-ckpt", "tiny.onnx"]) == 0
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "olv_runtime.cli", "serve", "tiny.onnx",
                          "--api-key", "sekret", "--port", str(port), "--log-level", "warning",
                          "--shutdown-timeout", "3"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert p.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        outs = []
        for line in _block("serve-curl").splitlines():
            if not line.strip():
                continue
            line = line.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            r = subprocess.run(["bash", "-c", "set -o pipefail; " + line], capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0, (line, r.stderr)
            outs.append(r.stdout)
        assert json.loads(outs[0]) == {"status": "ok"}
        assert json.loads(outs[1])["data"][0]["id"] == "tiny.onnx"
        assert json.loads(outs[2])["usage"]["completion_tokens"] <= 8
        assert outs[3].rstrip().endswith("data: [DONE]")
        assert "olv_kv_blocks_total" in outs[4]
        code = _block("serve-openai").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        buf = io.StringIO()
        with redirect_stdout(buf):
            exec(compile(code, "README.md:serve-openai", "exec"), {"__name__": "__readme__"})  # noqa: S102
        last = buf.getvalue().rstrip().splitlines()[-1]
        assert set(json.loads(last)) == {"city", "rank"}
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, p.stderr.read()[-2000:]
