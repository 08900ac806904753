"""Progress bars: drawn on a terminal (pseudo-terminal test), quiet when output is captured."""
from __future__ import annotations

import os
import pathlib
import select
import sys
import time

import numpy as np

from olv_runtime.cli import main as cli_main
from olv_runtime.progress import ConversionProgress

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_convert_bar_counts_layers(tiny_chat_dir, tmp_path, capsys):
    from olv_runtime.models.hf import convert

    with ConversionProgress(enabled=True) as p:
        convert(tiny_chat_dir, tmp_path / "m.onnx", progress=p)
    err = capsys.readouterr().err
    assert "5/5" in err and "100%" in err  # 2 layers + embedding + head + write


def test_quiet_when_not_a_terminal(tiny_chat_dir, tmp_path, capsys):
    assert cli_main(["convert", str(tiny_chat_dir), str(tmp_path / "m.onnx")]) == 0
    cap = capsys.readouterr()
    assert "wrote" in cap.out
    assert "%|" not in cap.err and "layer" not in cap.err
    ids = tmp_path / "t.ids"
    ids.write_text(" ".join(str(i) for i in range(40)))
    assert cli_main(["eval", str(tmp_path / "m.onnx"), "--token-ids", str(ids), "--ctx", "16"]) == 0
    assert "%|" not in capsys.readouterr().err


def test_eval_bar_in_a_terminal(tiny_chat_models, tmp_path):
    import pty

    ids = tmp_path / "t.ids"
    ids.write_text(" ".join(map(str, np.random.default_rng(0).integers(0, 200, 120).tolist())))
    argv = [sys.executable, "-m", "olv_runtime.cli", "eval", str(tiny_chat_models["int4"]),
            "--token-ids", str(ids), "--reference", str(tiny_chat_models["float32"]),
            "--ctx", "48"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pid, fd = pty.fork()
    if pid == 0:  # a 24x100 terminal (a new pty has 0 columns)
        import fcntl
        import struct
        import termios

        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        os.execve(sys.executable, argv, env)
    buf = bytearray()
    deadline = time.monotonic() + 180
    status = None
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    chunk = b""
                buf += chunk
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
    finally:
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    assert status is not None and os.WEXITSTATUS(status) == 0, bytes(buf[-600:])
    text = buf.decode("utf-8", "replace")
    assert "eval: 100%" in text and "119/119" in text  # the bar over the scored tokens
    assert "KLD mean" in text
