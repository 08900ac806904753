"""Tokenizers from GGUF ``tokenizer.ggml.*`` metadata (filled in below)."""
from __future__ import annotations


def tokenizer_files(gguf) -> dict[str, str]:
    return {}
