"""Issue 26 item 7: a new user's first hour (each item found by a fresh user following the
README)."""
from __future__ import annotations

import sys
import tomllib

import pytest

from olv_runtime.cli import main as cli_main
from olv_runtime.errors import MissingDependencyError
from olv_runtime.evaluate import logit_source

from hostile import ROOT


def test_hf_reference_without_torch_names_the_extra(tiny_qwen2_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'olv_runtime\[reference\]'"):
        logit_source(tiny_qwen2_dir)


def test_cli_eval_hf_reference_without_transformers_is_one_line(tiny_chat_models, tiny_qwen2_dir,
                                                               tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i) for i in range(5, 40)))
    assert cli_main(["eval", str(tiny_chat_models["int4"]), "--token-ids", str(ids),
                     "--reference", str(tiny_qwen2_dir), "--ctx", "16"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "pip install 'olv_runtime[reference]'" in err and "transformers" in err


def test_the_reference_extra_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["reference"]
    assert {d.split(">")[0].split("=")[0] for d in extra} == {"torch", "transformers"}
