"""Tokenizers from a GGUF file's ``tokenizer.ggml.*`` metadata, built with the ``tokenizers``
library and saved beside the converted model (``tokenizer.json``, ``tokenizer_config.json``).

GGUF keys read (llama.cpp ``gguf-py/gguf/constants.py`` ``Keys.Tokenizer``): ``model``
(``gpt2`` = byte-level BPE, ``llama`` = SentencePiece-style BPE with byte fallback), ``pre``
(the pre-tokenizer split of byte-level vocabularies), ``tokens``, ``merges`` (``"left right"``;
for ``llama`` files without merges they are derived from the vocabulary and ``scores``),
``token_type`` (3 = control: special tokens, 4 = user-defined: added tokens), ``bos/eos/
unknown/padding_token_id``, ``add_bos_token`` / ``add_eos_token`` and ``chat_template``.

* ``gpt2``: ``BPE(vocab, merges)`` over byte-level symbols; the pre-tokenizer is the split regex
  of the vocabulary's family (``qwen2``, ``llama-bpe`` / llama 3, ...; GPT-2's own otherwise)
  followed by ``ByteLevel``; decoder ``ByteLevel``.
* ``llama``: ``BPE(vocab, merges, byte_fallback, unk)`` with the ``Metaspace`` pre-tokenizer
  (``▁`` for spaces, one prepended to the first word), decoder ``▁`` -> space, byte fallback,
  fuse, strip the prepended space; BOS added when the file asks for it (llama.cpp's default).

Control tokens are added as special tokens and user-defined ones as added tokens, so they stay
whole. ``olv generate out.onnx --prompt ...`` then works with a GGUF-only download.
"""
from __future__ import annotations

import json

from olv_runtime.errors import ConversionError

__all__ = ["has_tokenizer", "build_tokenizer", "tokenizer_files"]

_T = "tokenizer.ggml."
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns of byte-level BPE families (the public regexes of the Qwen2 and Llama 3
# tokenizers; GPT-2's is ByteLevel's built-in one).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
          "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3}
#: ``tokenizer.ggml.pre`` values that mean GPT-2's own split (ByteLevel's built-in regex), as
#: in llama.cpp (absent: "default", with a warning there). Any value neither here nor in
#: :data:`SPLITS` is refused, as llama.cpp refuses an unknown pre-tokenizer type: a silent
#: GPT-2 fallback would tokenize (e.g. digits, CJK) differently from the model's training.
GPT2_SPLIT = (None, "", "default", "gpt-2", "gpt2")


def has_tokenizer(g) -> bool:
    """True if the GGUF metadata holds a vocabulary (``tokenizer.ggml.tokens``)."""
    return g.get(_T + "tokens") is not None


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes 33..126, 161..172, 174..255 map to
    themselves, the rest to 256 + n in order)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _derived_merges(tokens: list[str], scores) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two tokens, best-scored
    merged token first (ties: longer left, then longer right piece, then vocabulary order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    cands = []
    for tok, score in zip(tokens, scores):
        local = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ids and tok[i:] in ids]
        local.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        cands.extend((float(score), left, right) for left, right in local)
    cands.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in cands]


def _gpt2_tokenizer(g, vocab: dict, merges):
    """A byte-level BPE tokenizer (``tokenizer.ggml.model`` gpt2) with the pre-tokenizer the file
    names (``tokenizer.ggml.pre``; an unknown one is a ConversionError)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges or [], fuse_unk=False))
    pre = g.get(_T + "pre")
    if pre not in GPT2_SPLIT and pre not in SPLITS:
        raise ConversionError(
            f"{g.path}: tokenizer.ggml.pre {str(pre)[:80]!r} is not a pre-tokenizer this "
            "importer knows (as llama.cpp, an unknown one is refused rather than replaced by "
            f"GPT-2's); known: {', '.join(sorted(SPLITS))}, {', '.join(GPT2_SPLIT[2:])} "
            "(or none, or empty)")
    split = SPLITS.get(pre)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _llama_tokenizer(g, tokens: list, vocab: dict, merges, unk):
    """A SentencePiece-style BPE tokenizer (``tokenizer.ggml.model`` llama: byte fallback,
    metaspace), merges derived from the scores when the file has none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if merges is None:
        scores = g.get(_T + "scores")
        if scores is None or len(scores) != len(tokens):
            raise ConversionError(f"{g.path}: a llama vocabulary without merges needs "
                                  "tokenizer.ggml.scores for every token")
        merges = _derived_merges(tokens, scores)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                               unk_token=unk))
    prefix = bool(g.get(_T + "add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    seq = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        seq.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(seq)
    return tok


def build_tokenizer(g):
    """The ``tokenizers.Tokenizer`` and the ``tokenizer_config.json`` dict of a GGUF file.

    Parameters
    ----------
    g : GGUFFile

    Returns
    -------
    (tokenizers.Tokenizer, dict)

    Raises
    ------
    ConversionError
        No vocabulary, an unsupported ``tokenizer.ggml.model``, malformed merges or ids.
    """
    from tokenizers import AddedToken, processors

    tokens = g.get(_T + "tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConversionError(f"{g.path}: no tokenizer.ggml.tokens")
    kind = g.get(_T + "model")
    types = g.get(_T + "token_type")
    types = [int(t) for t in types] if types is not None else [1] * len(tokens)
    if len(types) != len(tokens):
        raise ConversionError(f"{g.path}: {len(types)} token types for {len(tokens)} tokens")
    merges_raw = g.get(_T + "merges")
    merges = None
    if merges_raw is not None:
        merges = []
        for m in merges_raw:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ConversionError(f"{g.path}: merge {m!r} is not 'left right'")
            merges.append((parts[0], parts[1]))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if merges is not None:
        # a merge whose pieces or result are not tokens can never apply (llama.cpp looks the
        # merged symbol up and finds nothing); tokenizers' BPE rejects such merges, so drop them
        merges = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]

    def token_of(key):
        i = g.get(_T + key)
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise ConversionError(f"{g.path}: tokenizer.ggml.{key} = {i} is outside the "
                                  f"vocabulary of {len(tokens)}")
        return tokens[int(i)]

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    unk, pad = token_of("unknown_token_id"), token_of("padding_token_id")
    if kind == "gpt2":
        tok = _gpt2_tokenizer(g, vocab, merges)
        add_bos_default = False
        spelled = set(_byte_alphabet().values())
    elif kind == "llama":
        tok = _llama_tokenizer(g, tokens, vocab, merges, unk)
        add_bos_default = True
        spelled = None
    else:
        raise ConversionError(
            f"{g.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)"
        )
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types)
               if ty == _CONTROL and (spelled is None or set(t) <= spelled)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        tok.add_tokens(user)
    add_bos = bool(g.get(_T + "add_bos_token", add_bos_default))
    add_eos = bool(g.get(_T + "add_eos_token", False))
    if (add_bos and bos is not None) or (add_eos and eos is not None):
        single = ([f"{bos}:0"] if add_bos and bos is not None else []) + ["$A:0"] + (
            [f"{eos}:0"] if add_eos and eos is not None else [])
        special = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None}
                   if t is not None]
        post = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(
            single + [s.replace("$A", "$B") for s in single[1:]]), special_tokens=special)
        tok.post_processor = (post if tok.post_processor is None else
                              processors.Sequence([tok.post_processor, post]))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
              "model_max_length": int(g.get(f"{g.get('general.architecture')}.context_length",
                                            1 << 30))}
    for key, value in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk),
                       ("pad_token", pad)):
        if value is not None:
            config[key] = value
    template = g.get(_T.replace("ggml.", "") + "chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return tok, config


def tokenizer_files(g) -> dict[str, str]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ...}`` for a GGUF file with a
    vocabulary (empty when it has none). Raises ConversionError as :func:`build_tokenizer`."""
    if not has_tokenizer(g):
        return {}
    try:
        tok, config = build_tokenizer(g)
    except ConversionError:
        raise
    except Exception as exc:  # tokenizers' own validation (a Rust exception)
        raise ConversionError(f"{g.path}: the tokenizer.ggml.* metadata does not make a "
                              f"tokenizer: {exc}") from None
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}
