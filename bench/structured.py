"""Structured output: the grammar mask's cost per token (llguidance) for the 20 JSON schemas of
the server's acceptance tests, over a Qwen2-sized vocabulary (151,936 ids).

    python bench/structured.py [--vocab 151936] [--tokenizer tokenizer.json] [--walks 5]
                               [--max-tokens 200] [--json out.json]

Without ``--tokenizer`` a byte-level BPE vocabulary of ``--vocab`` tokens is made here (no
download): the 256 byte symbols, pseudo-words of 1-3 syllables with and without a leading space
and capitalised, numbers, runs of JSON punctuation and 1-2 character CJK pieces, the way a real
150k vocabulary mixes them. ``--tokenizer`` takes a real ``tokenizer.json`` instead.

For each schema, ``--walks`` random walks (a token drawn uniformly among the allowed ones each
time, until eos or ``--max-tokens``) go through the server's own processor
(:class:`olv_runtime.generation.structured.GrammarLogitsProcessor`). Per token, two times:

* ``mask``: llguidance's ``LLMatcher.compute_bitmask`` alone (the library's cost);
* ``apply``: what the server pays per token (``olv_grammar_mask_seconds`` in ``/metrics``):
  the bitmask, unpacked to one bool per id, applied to a float32 logits row of the vocabulary.

Printed: a table of p50 / p99 microseconds per token for each schema and over all tokens, the
masks computed (one per token, the eos included), walks that hit ``--max-tokens`` before the
grammar ended, and the median schema compile time. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from olv_runtime.generation.structured import GrammarCompiler

SCHEMAS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "server" / "json_schemas.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level(text: str) -> str:
    """``text``'s UTF-8 bytes in the byte-level alphabet (GPT-2's bytes-to-unicode map)."""
    table = _BYTES
    return "".join(table[b] for b in text.encode("utf-8"))


def _bytes_to_unicode() -> list[str]:
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    out = [""] * 256
    for b, c in zip(bs, cs):
        out[b] = chr(c)
    return out


_BYTES = _bytes_to_unicode()


def synthetic_tokenizer(vocab: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly ``vocab`` ids (module docstring; no merges: the
    mask needs the token strings only), the last three ids the special tokens."""
    rng = random.Random(seed)
    n = vocab - len(SPECIALS)
    toks: dict[str, int] = {}

    def add(piece: str) -> None:
        if len(toks) < n and piece not in toks:
            toks[piece] = len(toks)

    for c in _BYTES:
        add(c)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s",
              "t", "v", "w", "x", "y", "z", "ch", "sh", "th", "st", "tr", "pr", "bl", "gr"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x"]
    for i in range(1000):
        add(str(i))
        add(_byte_level(" " + str(i)))
    punct = '{}[]":,. _-()/\\\'!?#@$%&*+=<>;|~`\n\t'
    for _ in range(6000):
        add(_byte_level("".join(rng.choice(punct) for _ in range(rng.randint(2, 4)))))
    for _ in range(12000):
        add(_byte_level("".join(chr(rng.randint(0x4E00, 0x9FFF))
                                for _ in range(rng.randint(1, 2)))))
    while len(toks) < n:
        word = "".join(rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas)
                       for _ in range(rng.choice([1, 1, 2, 2, 2, 3])))
        form = rng.random()
        word = word.capitalize() if form < 0.2 else word.upper() if form < 0.23 else word
        add(_byte_level((" " if rng.random() < 0.6 else "") + word))
    tok = Tokenizer(models.BPE(vocab=toks, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    return tok


def _pct(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def walk(compiler: GrammarCompiler, schema: dict, seed: int, max_tokens: int):
    """One random walk: (compile seconds, [mask seconds], [apply seconds], tokens, ended)."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    proc = compiler.processor(schema)
    compile_s = time.perf_counter() - t0
    eos = set(compiler.eos_ids)
    masks, applies, out = [], [], []
    row = np.zeros(compiler.vocab, np.float32)
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        proc.matcher.compute_bitmask()
        masks.append(time.perf_counter() - t0)
        row[:] = 0.0
        t0 = time.perf_counter()
        proc(out, row)  # the server's per-token work (computes the bitmask again)
        applies.append(time.perf_counter() - t0)
        tok = int(rng.choice(np.flatnonzero(np.isfinite(row))))
        proc.accept(tok)
        if tok in eos:
            return compile_s, masks, applies, len(out), True
        out.append(tok)
    return compile_s, masks, applies, len(out), False


def run(args) -> dict:
    t0 = time.perf_counter()
    if args.tokenizer:
        tok = Tokenizer.from_file(args.tokenizer)
        eos = [i for i in (tok.token_to_id(s) for s in ("<|im_end|>", "<|endoftext|>", "</s>"))
               if i is not None]
    else:
        tok = synthetic_tokenizer(args.vocab)
        eos = [tok.token_to_id("<|im_end|>")]
    vocab = tok.get_vocab_size(with_added_tokens=True)
    compiler = GrammarCompiler(tok, vocab, eos)
    compiler.processor(None)  # builds llguidance's tokenizer (once per server)
    setup_s = time.perf_counter() - t0
    table = json.loads(pathlib.Path(args.schemas).read_text())
    rows, all_mask, all_apply = [], [], []
    for e in table:
        compiles, masks, applies, unfinished = [], [], [], 0
        for w in range(args.walks):
            c, m, a, _, ended = walk(compiler, e["schema"], w, args.max_tokens)
            compiles.append(c)
            masks += m
            applies += a
            unfinished += not ended
        all_mask += masks
        all_apply += applies
        rows.append({"schema": e["name"], "masks": len(masks), "unfinished_walks": unfinished,
                     "compile_ms": round(1e3 * _pct(compiles, 0.5), 2),
                     "mask_p50_us": round(1e6 * _pct(masks, 0.5), 1),
                     "mask_p99_us": round(1e6 * _pct(masks, 0.99), 1),
                     "apply_p50_us": round(1e6 * _pct(applies, 0.5), 1),
                     "apply_p99_us": round(1e6 * _pct(applies, 0.99), 1)})
    rows.append({"schema": "all", "masks": len(all_mask),
                 "unfinished_walks": sum(r["unfinished_walks"] for r in rows),
                 "compile_ms": round(float(np.median([r["compile_ms"] for r in rows])), 2),
                 "mask_p50_us": round(1e6 * _pct(all_mask, 0.5), 1),
                 "mask_p99_us": round(1e6 * _pct(all_mask, 0.99), 1),
                 "apply_p50_us": round(1e6 * _pct(all_apply, 0.5), 1),
                 "apply_p99_us": round(1e6 * _pct(all_apply, 0.99), 1)})
    return {"vocab": vocab, "tokenizer": args.tokenizer or "synthetic byte-level BPE",
            "walks": args.walks, "setup_s": round(setup_s, 2), "rows": rows}


def table_text(report: dict) -> str:
    cols = ["schema", "masks", "unfinished_walks", "compile_ms", "mask_p50_us",
            "mask_p99_us", "apply_p50_us", "apply_p99_us"]
    head = (f"vocabulary {report['vocab']} ({report['tokenizer']}), {report['walks']} walks "
            f"per schema, tokenizer setup {report['setup_s']} s; us per token")
    lines = [head,
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in report["rows"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936,
                    help="synthetic vocabulary size (default: 151936, Qwen2's)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json instead")
    ap.add_argument("--schemas", default=str(SCHEMAS), help="[{name, schema}] JSON file")
    ap.add_argument("--walks", type=int, default=5, help="random walks per schema")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens per walk at most")
    ap.add_argument("--json", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    if args.walks < 1 or args.max_tokens < 1 or args.vocab < 512:
        ap.error("--walks >= 1, --max-tokens >= 1, --vocab >= 512")
    report = run(args)
    print(table_text(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
