"""Issue 26 item 7: a new user's first hour (each item found by a fresh user following the
README)."""
from __future__ import annotations

import shutil
import sys
import tomllib

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import olv_runtime
from olv_runtime.cli import main as cli_main
from olv_runtime.errors import MissingDependencyError
from olv_runtime.generation.evaluate import logit_source
from olv_runtime.proto import ModelProto
from olv_runtime.io.sidecars import record

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


def test_prompt_that_encodes_to_zero_tokens_says_why(tiny_chat_models, tmp_path, capsys):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_chat_models["int4"].parent, model_dir)
    # a placeholder vocabulary (word-level, tokens nobody types), as a GGUF written without its
    # real tokenizer gives; recorded as the model's own tokenizer.json
    tok = Tokenizer(models.BPE({f"<t{i}>": i for i in range(8)}, []))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    model = model_dir / "model.onnx"
    _record_sidecar(model, "tokenizer.json")
    assert cli_main(["generate", str(model), "--prompt", "hello world"]) == 2
    err = capsys.readouterr().err
    assert "the prompt encodes to zero tokens: tokenizer.json beside the model" in err
    assert "has 8 tokens ('<t0>', '<t1>', '<t2>', '<t3>', ...)" in err
    assert "placeholder vocabulary" in err and "--prompt-ids" in err
    assert cli_main(["generate", str(model), "--prompt", "   "]) == 2
    assert "empty or only whitespace" in capsys.readouterr().err


def _record_sidecar(model, name):
    """Record the current bytes of sidecar ``name`` in the model (as olv convert does)."""
    proto = ModelProto()
    proto.ParseFromString(model.read_bytes())
    listed = {p.value for p in proto.metadata_props if p.key == "olv.sidecars"}
    names = set(next(iter(listed)).split(",")) if listed else set()
    record(proto, {n: (model.parent / n).read_bytes() for n in names | {name}})
    model.write_bytes(proto.SerializeToString())


def test_a_tokenizer_that_raises_is_a_cli_error(tiny_chat_models, tmp_path, capsys):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_chat_models["int4"].parent, model_dir)
    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(8)}))  # no unk token
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    _record_sidecar(model_dir / "model.onnx", "tokenizer.json")
    assert cli_main(["generate", str(model_dir / "model.onnx"), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "--prompt cannot be encoded with tokenizer.json" in err and "Traceback" not in err


def test_convert_float32_reports_the_bytes_written(tiny_qwen2_dir, tmp_path, capsys):
    out = tmp_path / "f32" / "model.onnx"
    assert cli_main(["convert", str(tiny_qwen2_dir), str(out), "--weights", "float32",
                     "--external-data", "yes"]) == 0
    printed = capsys.readouterr().out
    data = out.with_name("model.onnx.data")
    assert data.stat().st_size > 100_000  # the float32 weights are in the data file
    total = out.stat().st_size + data.stat().st_size
    assert f"({total / 1e6:.1f} MB, weights float32)" in printed, printed


def test_inspect_verbose_says_more(tiny_chat_models, capsys):
    model = str(tiny_chat_models["int4"])
    assert cli_main(["inspect", model]) == 0
    plain = capsys.readouterr().out
    assert cli_main(["inspect", model, "-v"]) == 0
    verbose = capsys.readouterr().out
    assert verbose != plain and len(verbose.splitlines()) > len(plain.splitlines())
    assert "dense initializers:" in verbose and "dense initializers:" not in plain
    assert "scale float16[" in verbose and "operators: " in verbose and "olv::Decode x" in verbose
    assert all(line in verbose.splitlines() for line in plain.splitlines())


def test_result_text_and_cli_agree_on_special_tokens(tiny_chat_models, capsys, monkeypatch):
    """One default for both: GenerationResult.text leaves special tokens out, as olv generate
    prints the text; skip_special_tokens=False / --special keep them."""
    model = tiny_chat_models["int4"]
    real = Tokenizer.from_file(str(model.parent / "tokenizer.json"))
    sess = olv_runtime.InferenceSession(olv_runtime.load(model))
    prompt = real.encode("the lazy dog").ids
    ids = olv_runtime.generate(sess, prompt, 4, eos_token_id=None).tolist()
    special = ids[1]

    class Marked:  # the real tokenizer, with the 2nd generated id treated as a special token
        def decode(self, seq, skip_special_tokens=False):
            return "".join("<SPECIAL>" if i == special and not skip_special_tokens
                           else real.decode([i]) for i in seq)

        def __getattr__(self, name):
            return getattr(real, name)

    res = olv_runtime.generate(sess, prompt, 4, tokenizer=Marked(), eos_token_id=None,
                               return_result=True)
    assert res.ids.tolist() == ids and "<SPECIAL>" not in res.text
    kept = olv_runtime.generate(sess, prompt, 4, tokenizer=Marked(), eos_token_id=None,
                                return_result=True, skip_special_tokens=False)
    assert "<SPECIAL>" in kept.text
    monkeypatch.setattr(olv_runtime.cli, "_tokenizer_for", lambda path: Marked())
    capsys.readouterr()
    base = ["generate", str(model), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", "4", "--ignore-eos", "--output", "text"]
    assert cli_main(base) == 0
    assert capsys.readouterr().out.rstrip("\n").endswith(res.text)
    assert cli_main(base + ["--special"]) == 0
    assert capsys.readouterr().out.rstrip("\n").endswith(kept.text)


def test_warm_generate_prints_no_kernel_diagnostics_and_no_fake_rate(tiny_chat_models, capsys):
    model = str(tiny_chat_models["int4"])
    args = ["generate", model, "--prompt-ids", "5,17,99", "--max-new-tokens", "4",
            "--output", "ids"]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    for diag in ("warm-up prefill", "waited", "compiling or loading", "first token"):
        assert diag not in err, err
    # 3 decode steps of a tiny model take milliseconds: no tok/s figure for them
    assert "decode rate n/a (3 steps in" in err and "too short to measure" in err
    assert cli_main(args + ["--timings"]) == 0
    err = capsys.readouterr().err
    assert "warm-up prefill" in err and "first token" in err
