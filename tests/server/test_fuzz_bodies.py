"""Malformed bodies: wrong types, huge numbers, non-finite numbers, deep nesting, invalid UTF-8,
truncated JSON and 10 MB strings -- more than 500 of them, each answered with a 4xx OpenAI error
object, never a 5xx; the server answers normally afterwards."""
from __future__ import annotations

import json
import random

import pytest

httpx = pytest.importorskip("httpx")

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}
COMP = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "seed", "stop", "n", "stream",
          "stream_options", "logprobs", "response_format", "ignore_eos"]
CHAT_FIELDS = FIELDS + ["messages", "max_completion_tokens", "top_logprobs"]
COMP_FIELDS = FIELDS + ["prompt", "echo", "best_of"]
#: raw JSON texts invalid as the value of every field above (types, ranges, non-finite numbers)
VALUES = ['{"deep": {"er": [1, 2, {"x": null}]}}', "1e400", "-1e400", str(2**70), str(-2**70),
          "[[[]]]", '[{"a": 1}]', "-7.5"]
#: strings are valid for some fields (stop, model, prompt): only where they are not
STRING_OK = {"stop", "model", "prompt"}


def _bodies(seed: int = 0):
    rng = random.Random(seed)
    out = []
    for path, base, fields in (("/v1/chat/completions", CHAT, CHAT_FIELDS),
                               ("/v1/completions", COMP, COMP_FIELDS)):
        text = json.dumps(base)
        for f in fields:
            for v in VALUES + ([] if f in STRING_OK else ['"x"', '"' + "y" * 5000 + '"']):
                rest = {k: w for k, w in base.items() if k != f}
                out.append((path, (json.dumps(rest)[:-1] + f', "{f}": {v}}}').encode()))
        for i in range(60):  # truncated JSON
            out.append((path, text[:rng.randrange(len(text) - 1)].encode()))
        for i in range(40):  # invalid UTF-8 somewhere
            k = rng.randrange(len(text))
            out.append((path, text[:k].encode() + bytes([rng.choice([0x80, 0xc3, 0xff])]) +
                        text[k:].encode()))
        for depth in (50, 1000, 100_000):
            out.append((path, (f'{{"model": "tiny", "messages": {"[" * depth}{"]" * depth}}}')
                        .encode()))
        out.append((path, json.dumps({**base, "stop": "z" * (10 << 20)}).encode()))  # 10 MB
        out.append((path, b"NaN"))
        out.append((path, b'{"max_tokens": Infinity}'))
    return out


def test_malformed_bodies_get_4xx_only(live):
    bodies = _bodies()
    assert len(bodies) >= 500
    statuses = {}
    with httpx.Client(base_url=live.url, timeout=60) as c:
        for path, raw in bodies:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, raw[:200], r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["message"] and err["type"]
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert set(statuses) <= {400, 404, 413}, statuses
        assert statuses.get(413) == 2  # the two 10 MB bodies (the fixture's limit is 1 MiB)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop",
                                                                                    "length")
    eng = live.state.served.engine
    assert eng.stats().waiting == 0
