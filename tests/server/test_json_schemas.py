"""Issue 24 acceptance: 20 JSON schemas (tests/server/json_schemas.json: objects, arrays with
minItems / maxItems, enums, const, nested objects, required and optional fields, string patterns,
bounded integers, booleans, nullable through type lists and anyOf, $defs / $ref, prefixItems,
unions of objects) as ``response_format`` json_schema through the server -- chat and completions,
greedy and seeded sampling -- and through ``generate(..., json_schema=)``: every output ends with
the grammar (finish reason stop / eos), parses and validates with jsonschema.

The tiny model's text is random: the grammar alone makes the output valid, and the schemas bound
every string, array and integer so that any path through the grammar ends well within
``MAX_TOKENS``.
"""
from __future__ import annotations

import json
import pathlib

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

#: [{"name", "schema"}]; bench/structured.py times the masks of the same table
TABLE = json.loads((pathlib.Path(__file__).parent / "json_schemas.json").read_text())
IDS = [e["name"] for e in TABLE]
MAX_TOKENS = 150
MSGS = [{"role": "user", "content": "answer in JSON"}]


def test_the_table_has_20_distinct_valid_schemas():
    assert len(TABLE) == 20
    assert len({json.dumps(e["schema"], sort_keys=True) for e in TABLE}) == 20
    assert len(set(IDS)) == 20
    for e in TABLE:
        jsonschema.Draft202012Validator.check_schema(e["schema"])


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as c:
        yield c


def _format(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("entry", TABLE, ids=IDS)
def test_chat_output_validates(client, entry, temperature, seed):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=MAX_TOKENS,
                                       temperature=temperature, seed=seed,
                                       response_format=_format(entry["schema"]))
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), entry["schema"])


@pytest.mark.parametrize("entry", TABLE, ids=IDS)
def test_completion_output_validates(client, entry):
    r = client.completions.create(model="tiny", prompt="{", max_tokens=MAX_TOKENS,
                                  temperature=1.3, seed=len(entry["name"]),
                                  extra_body={"response_format": _format(entry["schema"])})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].text), entry["schema"])


@pytest.fixture(scope="module")
def session(served_model):
    from tokenizers import Tokenizer

    import olv_runtime

    tok = Tokenizer.from_file(str(served_model.parent / "tokenizer.json"))
    return olv_runtime.InferenceSession(olv_runtime.load(served_model)), tok


@pytest.mark.parametrize("entry", TABLE[::4], ids=IDS[::4])
def test_generate_json_schema_validates(session, entry):
    import olv_runtime

    sess, tok = session
    r = olv_runtime.generate_result(
        sess, tok.encode("answer in JSON").ids,
        olv_runtime.GenerationConfig(max_new_tokens=MAX_TOKENS, eos_token_id="auto",
                                     temperature=0.9, seed=3),
        tokenizer=tok, json_schema=entry["schema"])
    assert r.finish_reason == "eos", r
    jsonschema.validate(json.loads(r.text), entry["schema"])


def test_bench_reports_the_mask_cost_of_the_table(capsys):
    """bench/structured.py over the same table (a small synthetic vocabulary here): a row per
    schema and one over all, every walk ended by the grammar; timings are printed, not
    checked."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "structured.py"
    spec = importlib.util.spec_from_file_location("bench_structured", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.synthetic_tokenizer(3000).get_vocab_size() == 3000
    assert bench.main(["--vocab", "4096", "--walks", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split(" | ") for ln in lines if ln.startswith("| ") and "schema" not in ln]
    assert [r[0][2:] for r in rows] == IDS + ["all"]
    assert all(int(r[1]) > 0 and r[2] == "0" for r in rows)
    assert int(rows[-1][1]) == sum(int(r[1]) for r in rows[:-1])
