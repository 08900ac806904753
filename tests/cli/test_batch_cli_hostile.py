"""Hostile ``olv generate --batch`` / ``olv bench --batch`` input (defects found by a hostile
review of issue 23, fixed)."""
from __future__ import annotations

import json

from olv_runtime.cli import batch as cli_batch
from olv_runtime.cli import main
from olv_runtime.kv import block_pool


def test_batch_lines_end_at_newline_only(tiny_chat_models, tmp_path, capsys):
    # str.splitlines also splits at \f, \v, \x1c-\x1e, \x85, U+2028/9: a prompt holding one
    # became two prompts, every later index shifted (a silent wrong mapping)
    f = tmp_path / "p.txt"
    f.write_bytes("one\x0cpage\r\n\ntwo\u2028lines\nthree".encode())
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f),
                 "--max-new-tokens", "1"]) == 0
    recs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2]
    assert cli_batch._read_prompts(f) == [(1, "one\x0cpage"), (3, "two\u2028lines"), (4, "three")]


def test_zero_token_prompt_names_its_line(tiny_chat_models, tmp_path, capsys, monkeypatch):
    class Tok:
        def encode(self, text):
            return type("E", (), {"ids": [] if text == "EMPTY" else [1]})()
    monkeypatch.setattr(cli_batch, "_tokenizer_for", lambda model: Tok())
    f = tmp_path / "p.txt"
    f.write_text("a\n\n\nEMPTY\n")
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f)]) == 2
    assert "--batch line 4: the prompt encodes to zero tokens" in capsys.readouterr().err


def test_prompt_cache_with_batch_refused(tiny_chat_models, tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("a\n")
    cache = tmp_path / "cache.olvstate"
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f),
                 "--prompt-cache", str(cache)]) == 2  # was: silently ignored
    assert "--prompt-cache" in capsys.readouterr().err and not cache.exists()


def test_pool_too_large_is_one_line_error(tiny_chat_models, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(block_pool, "physical_memory", lambda: 1 << 20)
    f = tmp_path / "p.txt"
    f.write_text("a\n")
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f),
                 "--kv-cache-tokens", "100000"]) == 2  # was: a MemoryError traceback
    err = capsys.readouterr().err
    assert "physical memory" in err and len(err.strip().splitlines()) == 1


def test_bench_batch_pool_sized_for_the_run(tiny_chat_models, capsys, monkeypatch):
    made = []
    real = cli_batch.Engine

    def spy(*a, **k):
        made.append(k["kv_cache_tokens"])
        return real(*a, **k)
    monkeypatch.setattr(cli_batch, "Engine", spy)
    assert main(["bench", str(tiny_chat_models["int4"]), "--batch", "1,3", "--prompt-len", "8",
                 "--new-tokens", "4", "--runs", "1"]) == 0
    assert made == [3 * (8 + 4)]  # was max-batch x 2048 tokens: 1024 x 2048 for --batch 1024


def test_batch_file_read_is_bounded_whatever_its_size_says(tiny_chat_models, tmp_path, capsys,
                                                           monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("a\n" * 10)
    monkeypatch.setattr(cli_batch, "MAX_BATCH_FILE_BYTES", 25)
    real_stat = type(f).stat

    def small_stat(self, *a, **k):  # a file that grows after stat / a /proc file (size 0)
        st = real_stat(self, *a, **k)
        return type("S", (), {"st_size": 0, "st_mode": st.st_mode})()
    monkeypatch.setattr(type(f), "stat", small_stat)
    f.write_text("a\n" * 20)
    assert main(["generate", str(tiny_chat_models["int4"]), "--batch", str(f)]) == 2
    assert "over the 25 byte limit" in capsys.readouterr().err
