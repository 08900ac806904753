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


# -- generate(..., json_schema=...) and olv generate --json-schema (issue 24 item 1) ----------
BOUNDED = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -3, "maximum": 3},
                                            "b": {"enum": ["x", "yy"]}},
           "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def chat_model(tiny_chat_models):
    from tokenizers import Tokenizer

    import olv_runtime

    path = tiny_chat_models["int4"]
    tok = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    return olv_runtime.InferenceSession(olv_runtime.load(path)), tok


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 1), (1.3, 2)])
def test_generate_json_schema_validates(chat_model, temperature, seed):
    import olv_runtime

    sess, tok = chat_model
    cfg = olv_runtime.GenerationConfig(max_new_tokens=64, eos_token_id="auto", logprobs=True,
                                       temperature=temperature, seed=seed)
    r = olv_runtime.generate_result(sess, tok.encode("hello").ids, cfg, tokenizer=tok,
                                    json_schema=BOUNDED)
    assert r.finish_reason == "eos", r
    jsonschema.validate(json.loads(r.text), BOUNDED)
    assert all(np.isfinite(lp.logprob) and lp.logprob <= 0 for lp in r.logprobs)
    ids = olv_runtime.generate(sess, tok.encode("hello").ids, 64, eos_token_id="auto",
                               temperature=temperature, seed=seed, tokenizer=tok,
                               json_schema=BOUNDED)
    assert ids.tolist() == r.ids.tolist()  # the keyword form takes it too


def test_generate_json_object(chat_model):
    import olv_runtime

    sess, tok = chat_model
    r = olv_runtime.generate_result(sess, tok.encode("hi").ids, olv_runtime.GenerationConfig(
        max_new_tokens=200, eos_token_id="auto"), tokenizer=tok, json_schema=True)
    if r.finish_reason == "eos":
        assert isinstance(json.loads(r.text), dict)
    else:  # the grammar bounds the form, not the length: a long string may run out of tokens
        assert r.finish_reason == "length" and r.text.startswith("{")


def test_generate_json_schema_errors(chat_model):
    import olv_runtime

    sess, tok = chat_model
    ids = tok.encode("hello").ids
    with pytest.raises(InvalidArgument, match="tokenizer"):
        olv_runtime.generate_result(sess, ids, json_schema=BOUNDED)
    with pytest.raises(InvalidArgument, match="eos"):
        olv_runtime.generate_result(sess, ids, olv_runtime.GenerationConfig(eos_token_id=None),
                                    tokenizer=tok, json_schema=BOUNDED)
    with pytest.raises(InvalidArgument, match="cannot be compiled"):
        olv_runtime.generate_result(sess, ids, olv_runtime.GenerationConfig(eos_token_id="auto"),
                                    tokenizer=tok, json_schema={"type": "nonsense"})
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    with pytest.raises(InvalidArgument, match="must be an object"):
        olv_runtime.generate_result(None, ids, olv_runtime.GenerationConfig(eos_token_id="auto"),
                                    tokenizer=tok, json_schema=["not", "a", "schema"],
                                    state=state)
    assert state.tokens == [] and state.cached_tokens == 0  # nothing was run


def test_cli_json_schema(tiny_chat_models, tmp_path, capsys):
    from olv_runtime.cli import main

    path = tiny_chat_models["int4"]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(BOUNDED))
    assert main(["generate", str(path), "--prompt", "hello", "--json-schema", str(f),
                 "--max-new-tokens", "64", "--temperature", "0.8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello")
    jsonschema.validate(json.loads(out[len("hello"):].strip()), BOUNDED)
    for bad, match in ((tmp_path / "missing.json", "No such file"), (tmp_path, "regular file")):
        assert main(["generate", str(path), "--prompt", "x", "--json-schema", str(bad)]) == 2
        assert match in capsys.readouterr().err
    f.write_text("[1, 2]")
    assert main(["generate", str(path), "--prompt", "x", "--json-schema", str(f)]) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    f.write_text("{not json")
    assert main(["generate", str(path), "--prompt", "x", "--json-schema", str(f)]) == 2
    assert "not a JSON document" in capsys.readouterr().err
    f.write_text(json.dumps(BOUNDED))
    p = tmp_path / "p.txt"
    p.write_text("a\n")
    assert main(["generate", str(path), "--batch", str(p), "--json-schema", str(f)]) == 2
    assert "not supported with --batch" in capsys.readouterr().err
