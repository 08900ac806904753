"""Issue 26 item 6: CLI outputs never overwrite inputs.

Every option that writes a file (``olv chat --transcript``, ``olv generate --prompt-cache``,
``olv eval --json / --per-token / --plot``, ``olv export-standard OUTPUT``) is checked, before
any work, against the files the command reads with the shared same-file test
(``olv_runtime.io.same_file``: resolved path or inode, as ``convert`` and ``compile`` do); the
input stays byte for byte as it was. ``olv eval --token-ids`` with a ``.npy`` header declaring
``(2**42,)`` is a clear error, not an allocation.
"""
from __future__ import annotations

import io
import os
import shutil
import struct
import sys

import numpy as np
import pytest

from olv_runtime.cli import main as cli_main
from olv_runtime.errors import InvalidArgument
from olv_runtime.generation.evaluate import read_tokens


@pytest.fixture()
def model(tiny_chat_models, tmp_path):
    """A private copy of the tiny chat model folder (its files may be targeted)."""
    src = tiny_chat_models["int4"].parent
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst / "model.onnx"


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _refused(args, capsys, folder, match, stdin=None, monkeypatch=None):
    before = _snapshot(folder)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert "Traceback" not in err
    assert _snapshot(folder) == before  # nothing was written, nothing appended


@pytest.mark.parametrize("target, what", [
    ("model.onnx", "the model file"),
    ("tokenizer.json", "the model's tokenizer.json"),
    ("tokenizer_config.json", "the model's tokenizer_config.json"),
])
def test_chat_transcript_onto_a_model_file(model, capsys, monkeypatch, target, what):
    t = model.parent / target
    _refused(["chat", str(model), "--transcript", str(t), "--max-new-tokens", "2"], capsys,
             model.parent, f"--transcript {str(t)!r} would overwrite {what}",
             stdin="hello\n", monkeypatch=monkeypatch)


def test_chat_transcript_through_a_hard_link_and_onto_the_template(model, capsys, monkeypatch,
                                                                  tmp_path):
    link = tmp_path / "transcript.jsonl"
    os.link(model, link)  # another name of the model file: the same inode
    _refused(["chat", str(model), "--transcript", str(link)], capsys, model.parent,
             "would overwrite the model file", stdin="hello\n", monkeypatch=monkeypatch)
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    _refused(["chat", str(model), "--chat-template", str(tpl), "--transcript", str(tpl)],
             capsys, model.parent, "would overwrite the --chat-template file",
             stdin="hello\n", monkeypatch=monkeypatch)
    assert tpl.read_text().startswith("{% for")


def test_chat_transcript_elsewhere_still_works(model, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    t = tmp_path / "t.jsonl"
    assert cli_main(["chat", str(model), "--transcript", str(t), "--max-new-tokens", "2"]) == 0
    assert len(t.read_text().splitlines()) == 1


def test_generate_prompt_cache_onto_the_model(model, capsys):
    _refused(["generate", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
              "--prompt-cache", str(model)], capsys, model.parent,
             f"--prompt-cache {str(model)!r} would overwrite the model file")


def test_eval_outputs_onto_inputs(model, capsys, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i) for i in range(5, 60)))
    base = ["eval", str(model), "--token-ids", str(ids), "--ctx", "16"]
    _refused(base + ["--json", str(model)], capsys, model.parent,
             f"--json {str(model)!r} would overwrite the model file")
    _refused(base + ["--per-token", str(model.parent / "tokenizer.json")], capsys,
             model.parent, "would overwrite the model's tokenizer.json")
    _refused(base + ["--json", str(ids)], capsys, tmp_path,
             f"--json {str(ids)!r} would overwrite the --token-ids input")
    out = tmp_path / "o.json"
    assert cli_main(base + ["--json", str(out), "--per-token", str(out)]) == 2
    assert f"--per-token {str(out)!r} would overwrite the --json output" in \
        capsys.readouterr().err
    assert not out.exists()
    assert cli_main(base + ["--json", str(out)]) == 0
    assert out.is_file()


def test_export_standard_onto_the_input(model, capsys, tmp_path):
    _refused(["export-standard", str(model), str(model), "--feedback"], capsys, model.parent,
             f"output {str(model)!r} would overwrite the model file")
    assert cli_main(["export-standard", str(model), str(tmp_path / "std.onnx"), "--feedback"]) == 0
    assert (tmp_path / "std.onnx").is_file()


def _npy_header(text: str) -> bytes:
    body = text.encode("latin-1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body


def test_eval_token_ids_npy_header_is_checked_before_allocating(tmp_path, tiny_chat_models,
                                                                capsys):
    huge = tmp_path / "huge.npy"
    huge.write_bytes(_npy_header("{'descr': '<i8', 'fortran_order': False, 'shape': "
                                 "(4398046511104,), }\n") + b"\0" * 64)
    with pytest.raises(InvalidArgument, match=r"header declares \(4398046511104,\) int64 "
                                              r"\(35184372088832 bytes of data\), the file "
                                              r"holds 64 bytes"):
        read_tokens(huge, None, token_ids=True)
    assert cli_main(["eval", str(tiny_chat_models["int4"]), "--token-ids", str(huge)]) == 2
    assert "35184372088832 bytes of data" in capsys.readouterr().err
    floats = tmp_path / "f.npy"
    np.save(floats, np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument, match="token ids must be integers, got dtype float32"):
        read_tokens(floats, None, token_ids=True)
    deep = tmp_path / "deep.npy"
    deep.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 300_001) + b"(" * 300_000 + b"\n")
    with pytest.raises(InvalidArgument, match="header length 300001 is not in"):
        read_tokens(deep, None, token_ids=True)
    good = tmp_path / "g.npy"
    np.save(good, np.arange(5, 12, dtype=np.int32))
    assert read_tokens(good, None, token_ids=True).tolist() == list(range(5, 12))
