"""``olv generate --batch FILE`` and ``olv bench --batch`` (issue 23 item 4)."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

import olv_runtime
from olv_runtime import Engine, GenerationConfig
from olv_runtime.cli import batch as cli_batch
from olv_runtime.cli import main


def test_generate_batch_jsonl(tiny_chat_models, tmp_path, capsys):
    path = tiny_chat_models["int4"]
    lines = ["hello there", "the cat sat on the mat", "", "a b c"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["generate", str(path), "--batch", str(f), "--max-new-tokens", "6",
                 "--ignore-eos", "--max-batch", "2"]) == 0
    out, err = capsys.readouterr()
    recs = [json.loads(ln) for ln in out.splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2]  # the blank line is not a prompt
    tok = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    sess = olv_runtime.InferenceSession(olv_runtime.load(path))
    cfg = GenerationConfig(max_new_tokens=6, eos_token_id=None)
    for rec, text in zip(recs, [ln for ln in lines if ln]):
        ids = tok.encode(text).ids
        g = olv_runtime.generate_result(sess, ids, cfg, tokenizer=tok)
        assert rec["ids"] == g.ids.tolist() and rec["text"] == g.text
        assert rec["finish_reason"] == "length" and rec["prompt_tokens"] == len(ids)
    assert "3 prompts in" in err and "tokens generated" in err


@pytest.mark.parametrize("content, match", [
    ("", "no prompt"),
    ("\n\n  \n", "no prompt"),
    (b"\xff\xfe bad", "not UTF-8"),
])
def test_generate_batch_bad_files(tiny_chat_models, tmp_path, capsys, content, match):
    f = tmp_path / "p.txt"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f)]) == 2
    assert match in capsys.readouterr().err


def test_generate_batch_limits(tiny_chat_models, tmp_path, capsys, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("a\nb\nc\n")
    monkeypatch.setattr(cli_batch, "MAX_BATCH_PROMPTS", 2)
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f)]) == 2
    assert "over the 2 prompt limit" in capsys.readouterr().err
    monkeypatch.setattr(cli_batch, "MAX_BATCH_FILE_BYTES", 3)
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f)]) == 2
    assert "byte limit" in capsys.readouterr().err
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch",
                 str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_bench_batch_table(tiny_chat_models, capsys):
    assert main(["bench", str(tiny_chat_models["int4"]), "--batch", "1,3", "--prompt-len", "8",
                 "--new-tokens", "4", "--runs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["B", "prefill", "tok/s", "decode", "tok/s", "per", "seq"]
    rows = [ln.split() for ln in out[1:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert float(r[2]) > 0 and abs(float(r[3]) - float(r[2]) / int(r[0])) < 0.11


@pytest.mark.parametrize("arg", ["0", "1,x", "2000", ","])
def test_bench_batch_sizes_checked(tiny_chat_models, capsys, arg):
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_chat_models["int4"]), "--batch", arg])
    assert e.value.code == 2
    assert "--batch" in capsys.readouterr().err


def test_fallback_is_said_once(tiny_chat_dir, tmp_path, capsys):
    paged = tmp_path / "paged.onnx"
    olv_runtime.convert(tiny_chat_dir, paged, kv="paged-int8")
    assert main(["bench", str(paged), "--batch", "2", "--prompt-len", "4", "--new-tokens", "2",
                 "--runs", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count("one by one") == 1
    eng = Engine(olv_runtime.InferenceSession(olv_runtime.load(paged)))
    assert eng.fallback_reason in err
