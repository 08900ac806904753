"""generation/structured.py: a JSON schema's token mask through llguidance, without a model --
random walks over the allowed tokens always produce JSON that validates."""
from __future__ import annotations

import json

import numpy as np
import pytest

from olv_runtime.errors import InvalidArgument
from olv_runtime.generation.structured import GrammarCompiler, GrammarError
from olv_runtime.models.random_checkpoint import build_tokenizer

pytest.importorskip("llguidance")  # the serve extra (in the test extra too: runs in CI)
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def compiler():
    tok = build_tokenizer(vocab_size=300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    vocab = tok.get_vocab_size() + 14  # a model vocabulary padded past the tokenizer's
    return GrammarCompiler(tok, vocab, [tok.token_to_id("<|im_end|>")])


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -3, "maximum": 3}},
     "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "yy", 7]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{2,4}$"},
                                      "b": {"type": "boolean"}},
     "required": ["s", "b"], "additionalProperties": False},
    {"type": "string", "maxLength": 5},
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("schema", SCHEMAS, ids=[str(i) for i in range(len(SCHEMAS))])
def test_random_walk_over_the_mask_validates(compiler, schema, seed):
    rng = np.random.default_rng(seed)
    proc = compiler.processor(schema)
    eos = set(compiler.eos_ids)
    out = []
    for _ in range(200):
        row = rng.standard_normal(compiler.vocab).astype(np.float32)
        proc(out, row)
        assert np.isneginf(row[compiler.tokenizer.get_vocab_size():]).all()  # padding ids
        ok = np.flatnonzero(np.isfinite(row))
        tok = int(rng.choice(ok))
        proc.accept(tok)
        if tok in eos:
            break
        out.append(tok)
    else:
        pytest.fail("the grammar did not end in 200 tokens")
    jsonschema.validate(json.loads(compiler.tokenizer.decode(out)), schema)
    assert proc.masks == len(out) + 1 and proc.mask_seconds > 0


def test_json_object(compiler):
    proc = compiler.processor(None)
    allowed = proc.allowed()
    first = {compiler.tokenizer.decode([int(i)]) for i in np.flatnonzero(allowed)}
    assert first and all(t.lstrip().startswith("{") for t in first)


def test_a_disallowed_token_is_refused(compiler):
    proc = compiler.processor(SCHEMAS[0])
    bad = int(np.flatnonzero(~proc.allowed())[0])
    with pytest.raises(GrammarError, match="refused token"):
        proc.accept(bad)


@pytest.mark.parametrize("schema,match", [
    ({"type": "strin"}, "cannot be compiled"),
    ([1, 2], "must be an object"),
    ({"type": "object", "x": float("nan")}, "not plain JSON"),
    ({"type": "string", "pattern": "(("}, "cannot be compiled"),
])
def test_bad_schemas_are_refused(compiler, schema, match):
    with pytest.raises(InvalidArgument, match=match):
        compiler.processor(schema)


def test_compiler_needs_eos_in_the_vocabulary():
    tok = build_tokenizer(vocab_size=300)
    with pytest.raises(InvalidArgument, match="at least one eos"):
        GrammarCompiler(tok, 300, [])
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        GrammarCompiler(tok, 300, [300])
