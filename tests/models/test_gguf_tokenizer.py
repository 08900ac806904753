"""Tokenizers built from GGUF ``tokenizer.ggml.*`` metadata against transformers' GGUF tokenizer
loading (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) on ASCII, multi-byte UTF-8,
whitespace runs and special tokens; ``olv generate --prompt`` on a GGUF-only conversion."""
from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import olv_runtime
import transformers

from gguf_models import write_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello there! It's a test; we're testing tokenizers' merges.",
    "Grüße aus München — naïve café, déjà vu. 你好，世界！ こんにちは 🚀🚀",
    "def f(x):\n    return x + 1\n\n\tprint(f(41))   # answer",
    "1234567890 3.14159 2026-12-01",
]
STRINGS = [
    "Hello world",
    "The lazy dog's 12345 merges!",
    "héllo wörld — 你好 🚀 こんにちは",
    "a   b\n\n\tc  \n   ",
    "  leading and trailing  ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>reasoning</think> done<|endoftext|>",
    "",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = ["<think>", "</think>"]


def _train(pre, decoder, vocab_size=400, extra=()):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=list(extra), special_tokens=[])
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [t for t, _ in vocab], merges


def _write(path, model, tokens, types, merges=None, scores=None, pre=None, add_bos=None):
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(tokens.index(SPECIAL[0]) if SPECIAL[0] in tokens else 1)
    w.add_eos_token_id(tokens.index(SPECIAL[0]) if SPECIAL[0] in tokens else 2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _compare(tmp_path, name):
    from olv_runtime.models.gguf_reader import GGUFFile
    from olv_runtime.models.gguf_tokenizer import build_tokenizer

    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=name)
    with GGUFFile(tmp_path / name) as g:
        ours, config = build_tokenizer(g)
    for s in STRINGS:
        want = ref(s)["input_ids"]
        got = ours.encode(s).ids
        assert got == want, (s, got, want)
        assert ours.decode(got, skip_special_tokens=False) == ref.decode(want)
    return ours, config


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", None])
def test_byte_level_bpe_matches_transformers(tmp_path, pre):
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    base, merges = _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                          extra=alphabet)
    tokens = base + SPECIAL + USER
    types = [1] * len(base) + [3] * len(SPECIAL) + [4] * len(USER)
    _write(tmp_path / "t.gguf", "gpt2", tokens, types, merges=merges, pre=pre)
    ours, config = _compare(tmp_path, "t.gguf")
    assert config["eos_token"] == "<|endoftext|>" and "chat_template" in config
    assert len(ours.encode("<|im_start|>").ids) == 1


@pytest.mark.parametrize("with_merges", [True, False])
def test_sentencepiece_bpe_matches_transformers(tmp_path, with_merges):
    base, merges = _train(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first"),
                          decoders.Metaspace())
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + [t for t in base if t not in byte_tokens]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    w_merges = [m for m in merges if all(p in tokens for p in m.split(" "))]
    path = tmp_path / "s.gguf"
    wtr = gguf.GGUFWriter(str(path), "llama")
    wtr.add_tokenizer_model("llama")
    wtr.add_token_list(tokens)
    wtr.add_token_types(types)
    wtr.add_token_scores(scores)
    if with_merges:
        wtr.add_token_merges(w_merges)
    wtr.add_bos_token_id(1)
    wtr.add_eos_token_id(2)
    wtr.add_unk_token_id(0)
    wtr.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    wtr.write_header_to_file()
    wtr.write_kv_data_to_file()
    wtr.write_tensors_to_file()
    wtr.close()
    from olv_runtime.models.gguf_reader import GGUFFile
    from olv_runtime.models.gguf_tokenizer import build_tokenizer

    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="s.gguf")
    with GGUFFile(path) as g:
        ours, config = build_tokenizer(g)
    assert config["add_bos_token"] is True
    for s in [x for x in STRINGS if "<|" not in x and "<think>" not in x]:
        want = ref(s)["input_ids"]
        got = ours.encode(s).ids
        assert got == want, (s, got, want)


def test_generate_with_gguf_only_download(tmp_path):
    """``olv convert`` writes tokenizer.json from the GGUF; ``olv generate --prompt`` runs."""
    path = write_gguf(tmp_path / "m.gguf", "qwen2", "Q4_0", layers=1)
    out = tmp_path / "m.onnx"
    olv_runtime.convert(path, out)
    assert (tmp_path / "tokenizer.json").is_file()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>"
    r = subprocess.run([sys.executable, "-m", "olv_runtime.cli", "generate", str(out),
                        "--prompt", "the a", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_merges_that_cannot_apply_are_dropped(tmp_path):
    """A merge whose result is not a token (placeholder vocabularies) cannot apply; the
    tokenizer is built without it."""
    from olv_runtime.models.gguf_reader import GGUFFile
    from olv_runtime.models.gguf_tokenizer import build_tokenizer

    tokens = ["<t0>", "<t1>", "<t2>", "a", "b", "ab"]
    _write(tmp_path / "p.gguf", "gpt2", tokens, [1] * len(tokens), merges=["<t1> <t2>", "a b"])
    with GGUFFile(tmp_path / "p.gguf") as g:
        tok, _ = build_tokenizer(g)
    assert tok.encode("ab").ids == [5]


def test_unknown_tokenizer_model_is_a_conversion_error(tmp_path):
    from olv_runtime.errors import ConversionError
    from olv_runtime.models.gguf_reader import GGUFFile
    from olv_runtime.models.gguf_tokenizer import tokenizer_files

    _write(tmp_path / "u.gguf", "rwkv", ["a", "b", "c"], [1, 1, 1])
    with GGUFFile(tmp_path / "u.gguf") as g, pytest.raises(ConversionError, match="rwkv"):
        tokenizer_files(g)
