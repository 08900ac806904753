"""Tiny random Hugging Face checkpoints built with transformers (the helpers behind the
conftest.py fixtures; a module of its own so a test can import them: ``from conftest import``
resolves to whichever conftest.py pytest imported last)."""
from __future__ import annotations

import json
import pathlib

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


def _write_tokenizer(path: pathlib.Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab_size - len(vocab))]
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))


def _build(tmp_path_factory, name: str, cls_name: str, dtype: str = "float32", **cfg) -> pathlib.Path:
    import torch
    import transformers

    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, cls_name)
    config = config_cls(**{**TINY, **cfg}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(out), safe_serialization=True)
    _write_tokenizer(out, config.vocab_size)
    return out
