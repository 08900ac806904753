"""The README's batching-engine section runs as written (issue 23; the README-test convention of
issue 26): the Python block and the command-line block, on olv make-checkpoint's model
converted to qwen.onnx."""
from __future__ import annotations

import json
import shlex

import pytest
from test_readme import readme_block

from olv_runtime.cli import main as cli_main


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """olv make-checkpoint's model converted to qwen.onnx (made once for both blocks)."""
    d = tmp_path_factory.mktemp("readme_engine")
    assert cli_main(["make-checkpoint", str(d / "ckpt")]) == 0
    assert cli_main(["convert", str(d / "ckpt"), str(d / "qwen.onnx")]) == 0
    return d


def test_engine_python_block(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    capsys.readouterr()
    code = "\n".join(readme_block("engine-python"))
    ns: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md:engine-python", "exec"), ns)  # noqa: S102 - our README
    results = ns["results"]
    assert len(results) == 3 and all(r.finish_reason in ("length", "eos") for r in results)
    assert all(r.error is None and r.ids.size >= 1 for r in results)
    out = capsys.readouterr().out
    assert out.count("length") + out.count("eos") >= 4
    st = ns["engine"].stats()
    assert st.finished == 4 and st.blocks_used == 0 and ns["engine"].batched


def test_engine_cli_block(workdir, monkeypatch, capsys):
    tmp_path = workdir
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    lines = readme_block("engine-cli")
    assert lines[0].startswith("printf ")
    (tmp_path / "prompts.txt").write_text("The capital of France is\nOnce upon a time\n")
    for line in lines[1:]:
        words = shlex.split(line)
        out_file = None
        if ">" in words:
            i = words.index(">")
            out_file, words = words[i + 1], words[:i]
        assert words[0] == "olv", line
        assert cli_main(words[1:]) == 0, (line, capsys.readouterr().err[-2000:])
        out, _ = capsys.readouterr()
        if out_file:
            (tmp_path / out_file).write_text(out)
    recs = [json.loads(ln) for ln in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [r["index"] for r in recs] == [0, 1]
    assert all(len(r["ids"]) >= 1 and r["finish_reason"] in ("length", "eos") for r in recs)
