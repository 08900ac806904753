"""Issue 26 item 7: the README's new-user recipe runs as written.

The fenced block after ``<!-- readme-test: tiny -->`` in README.md is extracted and each line
run, in order, in a fresh folder: ``olv ...`` through the CLI's ``main`` (the console script's
entry point), ``echo TEXT | olv ...`` with TEXT as stdin. Every command must exit 0; the files
the recipe names must exist afterwards.
"""
from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys

from tokenizers import Tokenizer

from olv_runtime.cli import main as cli_main

from hostile import ROOT


def readme_block(marker: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(re.escape(f"<!-- readme-test: {marker} -->") + r"\s*```[^\n]*\n(.*?)```",
                  text, re.S)
    assert m is not None, f"README.md has no block marked readme-test: {marker}"
    return [ln for ln in m.group(1).splitlines() if ln.strip()]


def run_line(line: str, monkeypatch) -> int:
    if line.startswith("python "):  # a repository script, run from the checkout
        words = shlex.split(line, comments=True)
        script = str(ROOT / words[1])
        boot = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); "  # this checkout's package
                "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
        r = subprocess.run([sys.executable, "-c", boot, str(ROOT), script, *words[2:]],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        return 0
    stdin = ""
    if "|" in line:
        left, line = (part.strip() for part in line.split("|", 1))
        words = shlex.split(left)
        assert words[0] == "echo", left
        stdin = " ".join(words[1:]) + "\n"
    words = shlex.split(line, comments=True)
    assert words[0] == "olv", line
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return cli_main(words[1:])


def test_tiny_checkpoint_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    lines = readme_block("tiny")
    assert lines[0].startswith("olv make-checkpoint") and len(lines) >= 5
    for line in lines:
        rc = run_line(line, monkeypatch)
        out, err = capsys.readouterr()
        assert rc == 0, (line, err[-2000:])
        assert "Traceback" not in err, (line, err)
    for name in ("tiny-ckpt/config.json", "tiny-ckpt/tokenizer.json",
                 "tiny-ckpt/tokenizer_config.json", "tiny.onnx", "tokenizer.json",
                 "chat.jsonl", "tiny-fast.onnx"):
        assert (tmp_path / name).is_file(), name
    turns = (tmp_path / "chat.jsonl").read_text().splitlines()
    assert len(turns) == 1
    assert "<|im_start|>user\nhello there<|im_end|>" in json.loads(turns[0])["rendered"]


def test_make_checkpoint_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert cli_main(["make-checkpoint", str(tmp_path / "x")]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_tiny_gguf_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for line in readme_block("tiny")[:2] + readme_block("tiny-gguf"):  # make, convert, GGUF
        rc = run_line(line, monkeypatch)
        out, err = capsys.readouterr()
        assert rc == 0, (line, err[-2000:])
    # the GGUF carries the real tokenizer: the prompt encodes to the same ids through both
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    back = Tokenizer.from_file(str(tmp_path / "tiny-gguf" / "tokenizer.json"))
    text = "The capital of France is"
    assert back.encode(text).ids == ours.encode(text).ids
    assert "chat_template" in json.loads(
        (tmp_path / "tiny-gguf" / "tokenizer_config.json").read_text())


def test_python_snippets_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's Python quickstart and continuation blocks, on olv make-checkpoint's model
    converted to qwen.onnx (tokenizer.json and the chat template beside it)."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "ckpt"]) == 0
    assert cli_main(["convert", "ckpt", "qwen.onnx"]) == 0
    capsys.readouterr()
    for marker in ("python-quickstart", "python-continue"):
        code = "\n".join(readme_block(marker))
        namespace: dict = {"__name__": "__readme__"}
        exec(compile(code, f"README.md:{marker}", "exec"), namespace)  # noqa: S102 - our README
    assert len(namespace["ids"]) == 32 and namespace["res"].finish_reason in ("length", "eos",
                                                                               "stop")
    assert namespace["conv"].state is not None


def test_cli_sampling_lines_run_in_bash(tmp_path, monkeypatch, capsys):
    """The README's stopping and sampling lines, each run by bash as written (its quoting,
    $'\\n' and $(cat long.txt) included), with ``olv`` this checkout's CLI and qwen.onnx the
    tiny model."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "ckpt"]) == 0
    assert cli_main(["convert", "ckpt", "qwen.onnx"]) == 0
    capsys.readouterr()
    (tmp_path / "long.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "olv"
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                    "from olv_runtime.cli import main\nsys.exit(main())\n")
    shim.chmod(0o755)
    lines = readme_block("cli-sampling")
    assert len(lines) >= 6
    for line in lines:
        r = subprocess.run(["bash", "-c", f'PATH={shlex.quote(str(bindir))}:"$PATH"; {line}'],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (line, r.stderr)
    assert (tmp_path / "long.npz").is_file()  # the prompt-cache line wrote its state


def test_compile_lines_run_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["make-checkpoint", "ckpt"]) == 0
    assert cli_main(["convert", "ckpt", "out.onnx"]) == 0
    capsys.readouterr()
    for line in readme_block("compile"):
        assert run_line(line, monkeypatch) == 0, (line, capsys.readouterr().err[-2000:])
    out = capsys.readouterr().out
    assert (tmp_path / "fast.onnx.compiled").is_file() and "hit" in out
