"""Issue 24 acceptance: the same seeded request gives the same completion and bitwise-equal
logprobs whatever the concurrency (1, 4, 16) and arrival order, in exact mode (a server started
without ``--quantize-activations``), on the INT4 and the float32-weight conversions.

A probe request (sampled: temperature > 0 and a seed, with logprobs and top alternatives) runs
alone, then among 3 and 15 other requests (random prompts, lengths and sampling settings, streamed
and not) arriving before it, around it and after it in shuffled orders, then alone again. Every
run must give the same token pieces, the same float64 bit patterns of the chosen logprobs and of
every top alternative, and the same finish reason.
"""
from __future__ import annotations

import concurrent.futures
import json
import random
import struct
import time

import pytest
from live_server import LiveServer

from olv_runtime.server import ServeOptions, load_served

httpx = pytest.importorskip("httpx")

#: the concurrencies of the acceptance criterion (the probe included)
CONCURRENCY = (4, 16)
#: where the probe arrives among the others
POSITIONS = ("first", "middle", "last")
#: seconds between two arrivals (the order the requests reach the server in)
STAGGER = 0.005
#: seconds added to each engine step (:func:`_slowed_loader`)
STEP_SLEEP = 0.01
TIMEOUT = 120

WORDS = ["alpha", "beta", "gamma", "delta", "hello", "world", "the", "of", "cat", "sat"]

PROBES = {
    # a short completion prompt: the whole prompt is one chunk of a partial block
    "completion": ("/v1/completions", {
        "model": "tiny", "prompt": "the same prompt, sampled", "max_tokens": 12,
        "temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": 5, "ignore_eos": True}),
    # a chat prompt over two 64-token KV blocks (prefix-cache hits on the later runs), top_k and
    # min_p filtering, chat logprobs with top alternatives
    "chat": ("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": " ".join(
            WORDS[i % len(WORDS)] for i in range(36))}], "max_tokens": 12,
        "temperature": 1.1, "top_k": 40, "min_p": 0.01, "seed": 99, "logprobs": True,
        "top_logprobs": 4, "ignore_eos": True}),
}


def _bits(x: float) -> str:
    return struct.pack(">d", x).hex()


def _fingerprint(kind: str, choice: dict) -> tuple:
    """(pieces, chosen logprob bits, top alternatives with their bits, finish reason)."""
    lp = choice["logprobs"]
    if kind == "chat":
        content = lp["content"]
        return (tuple(e["token"] for e in content),
                tuple(_bits(e["logprob"]) for e in content),
                tuple(tuple((a["token"], _bits(a["logprob"])) for a in e["top_logprobs"])
                      for e in content),
                choice["finish_reason"])
    return (tuple(lp["tokens"]), tuple(_bits(v) for v in lp["token_logprobs"]),
            tuple(tuple(sorted((t, _bits(v)) for t, v in top.items()))
                  for top in lp["top_logprobs"]),
            choice["finish_reason"])


def _other(rng: random.Random) -> tuple[str, dict]:
    """A random request beside the probe: completion or chat, 1..40 words, 1..24 tokens,
    greedy or seeded sampling, with or without logprobs, streamed or not."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body = {"model": "tiny", "max_tokens": rng.randint(1, 24), "ignore_eos": rng.random() < 0.5,
            "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body.update(temperature=0)
    else:
        body.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1000),
                    top_p=rng.choice([1.0, 0.8]))
    if rng.random() < 0.5:
        body.update(prompt=text)
        if rng.random() < 0.5:
            body.update(logprobs=rng.randint(0, 5))
        return "/v1/completions", body
    body.update(messages=[{"role": "user", "content": text}])
    if rng.random() < 0.5:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    return "/v1/chat/completions", body


def _send(client: httpx.Client, route: str, body: dict) -> dict:
    """The response's first choice (a streamed one is read to its end); a non-200 fails."""
    if not body.get("stream"):
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    finish = None
    with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                if obj["choices"] and obj["choices"][0]["finish_reason"]:
                    finish = obj["choices"][0]["finish_reason"]
    assert finish is not None
    return {"finish_reason": finish}


def _slowed_loader(path):
    """load_served with an engine whose steps take >= STEP_SLEEP seconds more (the numbers do
    not change): a 12-token probe lasts longer than the staggered arrivals of 16 requests, so
    the requests of a round run together."""
    def loader():
        served = load_served(path, model_name="tiny", max_batch=16, kv_cache_tokens=16 * 512)
        step = served.engine.step

        def slow_step():
            time.sleep(STEP_SLEEP)
            return step()

        served.engine.step = slow_step  # the background loop calls self.step()
        return served
    return loader


@pytest.fixture(scope="module", params=["int4", "float32"])
def exact(request, tiny_chat_models):
    """An exact-mode server (float32 activations, float32 KV) with room for 16 rows in a step."""
    srv = LiveServer(_slowed_loader(tiny_chat_models[request.param]),
                     ServeOptions(max_waiting=64, shutdown_timeout=5))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_same_seed_same_logprobs_whatever_the_concurrency_and_order(exact, probe):
    route, body = PROBES[probe]
    kind = "chat" if "chat" in route else "completion"
    rng = random.Random(f"{probe}-24")
    eng = exact.state.served.engine
    with httpx.Client(base_url=exact.url, timeout=TIMEOUT) as client:
        solo = _fingerprint(kind, _send(client, route, body))
        assert len(solo[0]) == body["max_tokens"] and solo[3] == "length"
        assert len(set(solo[1])) > 1  # sampled: not one constant logprob
        for n in CONCURRENCY:
            for pos in POSITIONS:
                others = [_other(rng) for _ in range(n - 1)]
                rng.shuffle(others)
                at = {"first": 0, "middle": (n - 1) // 2, "last": n - 1}[pos]
                order = others[:at] + [(route, body)] + others[at:]
                s0 = eng.stats()
                with concurrent.futures.ThreadPoolExecutor(n) as ex:
                    futs = []
                    for r, b in order:
                        futs.append(ex.submit(_send, client, r, b))
                        time.sleep(STAGGER)
                    got = [f.result(timeout=TIMEOUT) for f in futs]
                assert _fingerprint(kind, got[at]) == solo, (n, pos)
                assert all(g["finish_reason"] in ("stop", "length") for g in got)
                s1 = eng.stats()
                # the requests overlapped: more decode rows than steps, so some step decoded
                # several requests at once
                assert s1.decode_rows - s0.decode_rows > s1.steps - s0.steps, (n, pos)
        again = _fingerprint(kind, _send(client, route, body))
    assert again == solo
