"""Errors and limits with httpx: every error is an OpenAI error object with its status -- 400
naming the field, 401, 404, 413, 400 beyond the context (with the numbers), 429 with
Retry-After, 503 while loading and while shutting down -- and the server stays healthy."""
from __future__ import annotations

import threading
import time

import pytest
from live_server import LiveServer

from olv_runtime.server import ServeOptions, load_served

httpx = pytest.importorskip("httpx")

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


BAD_FIELDS = [
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"temperature": 3}, "temperature"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"top_k": "5"}, "top_k"),
    ("chat", {"min_p": 2}, "min_p"),
    ("chat", {"presence_penalty": 9}, "presence_penalty"),
    ("chat", {"frequency_penalty": None, "repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"seed": -1}, "seed"),
    ("chat", {"stop": 5}, "stop"),
    ("chat", {"stop": [""]}, "stop"),
    ("chat", {"n": 2}, "n"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"schema": {"type": "strin"}}}},
     "response_format"),
    ("chat", {"model": 7}, "model"),
    ("completion", {"prompt": None}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": [1, "a"]}, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"),
    ("completion", {"prompt": [1, 2, 99999]}, "prompt"),
    ("completion", {"logprobs": 50}, "logprobs"),
    ("completion", {"echo": True}, "echo"),
    ("completion", {"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize("kind,patch,param", BAD_FIELDS,
                         ids=[f"{k}-{p}-{i}" for i, (k, _, p) in enumerate(BAD_FIELDS)])
def test_invalid_field_is_400_naming_it(live, kind, patch, param):
    body = dict(CHAT if kind == "chat" else COMP)
    body.update(patch)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    e = _err(httpx.post(live.url + path, json=body, timeout=30), 400)
    assert e["param"] == param, e
    assert e["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff\xfe{}", b'{"prompt": NaN}',
                                 b"[" * 100_000 + b"]" * 100_000, b"", b"null"])
def test_malformed_bodies_are_400(live, raw):
    r = httpx.post(live.url + "/v1/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    _err(r, 400)


def test_unknown_model_and_route_are_404(live):
    e = _err(httpx.post(live.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"},
                        timeout=30), 404)
    assert e["param"] == "model" and e["code"] == "model_not_found"
    e = _err(httpx.get(live.url + "/v1/nothing", timeout=30), 404)
    assert "/v1/nothing" in e["message"]
    _err(httpx.get(live.url + "/v1/completions", timeout=30), 405)


def test_body_over_the_limit_is_413(live):
    big = {**COMP, "prompt": "a " * (1 << 20)}  # > 1 MiB (the fixture's limit)
    e = _err(httpx.post(live.url + "/v1/completions", json=big, timeout=30), 413)
    assert e["code"] == "body_too_large"


def test_prompt_beyond_the_context_is_400_with_the_numbers(live):
    e = _err(httpx.post(live.url + "/v1/completions",
                        json={**COMP, "prompt": [3 + i % 200 for i in range(300)], "max_tokens": 4},
                        timeout=30), 400)
    assert e["code"] == "context_length_exceeded" and e["param"] == "prompt"
    assert "300" in e["message"] and "256" in e["message"]
    e = _err(httpx.post(live.url + "/v1/chat/completions",
                        json={**CHAT, "messages": [{"role": "user", "content": "a " * 400}]},
                        timeout=30), 400)
    assert e["code"] == "context_length_exceeded" and "256" in e["message"]


def test_still_healthy_after_the_errors(live):
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    r = httpx.post(live.url + "/v1/completions", json=COMP, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


@pytest.fixture(scope="module")
def guarded(served_model):
    """API key, no waiting room (every request gets 429 once authorized)."""
    srv = LiveServer(lambda: load_served(served_model, model_name="tiny", max_batch=2,
                                         kv_cache_tokens=1024),
                     ServeOptions(api_key="sekret", max_waiting=0, shutdown_timeout=2))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_api_key_401_and_queue_full_429(guarded):
    url = guarded.url + "/v1/chat/completions"
    e = _err(httpx.post(url, json=CHAT, timeout=30), 401)
    assert e["type"] == "authentication_error"
    _err(httpx.post(url, json=CHAT, headers={"Authorization": "Bearer wrong"}, timeout=30), 401)
    _err(httpx.get(guarded.url + "/v1/models", timeout=30), 401)
    assert httpx.get(guarded.url + "/v1/models", headers={"Authorization": "Bearer sekret"},
                     timeout=30).status_code == 200
    assert httpx.get(guarded.url + "/health", timeout=30).status_code == 200  # not guarded
    r = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer sekret"}, timeout=30)
    e = _err(r, 429)
    assert r.headers["retry-after"] == "1" and e["type"] == "rate_limit_error"


def test_503_while_shutting_down(guarded):
    guarded.state.begin_drain()
    e = _err(httpx.get(guarded.url + "/health", timeout=30), 503)
    assert e["code"] == "shutting_down"
    _err(httpx.post(guarded.url + "/v1/completions", json=COMP,
                    headers={"Authorization": "Bearer sekret"}, timeout=30), 503)


def test_503_while_loading_then_200(served_model):
    go = threading.Event()

    def loader():
        assert go.wait(60)
        return load_served(served_model, model_name="tiny", max_batch=2, kv_cache_tokens=1024)

    srv = LiveServer(loader, ServeOptions(shutdown_timeout=2))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(srv.url + "/health", timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        e = _err(r, 503)
        assert e["code"] == "loading" and r.headers["retry-after"] == "1"
        _err(httpx.post(srv.url + "/v1/completions", json=COMP, timeout=30), 503)
        go.set()
        srv.wait_ready(60)
        assert httpx.post(srv.url + "/v1/completions", json=COMP, timeout=30).status_code == 200
    finally:
        go.set()
        srv.stop()
