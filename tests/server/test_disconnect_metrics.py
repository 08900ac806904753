"""A client that leaves cancels its request (its KV blocks are free at the next step, the
engine forgets it); /metrics reports the request and engine figures."""
from __future__ import annotations

import re
import time

import pytest
from live_server import LiveServer

from olv_runtime.server import ServeOptions, load_served

httpx = pytest.importorskip("httpx")

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
        "temperature": 0, "ignore_eos": True}


def _slow_loader(served_model):
    def loader():
        served = load_served(served_model, model_name="tiny", max_batch=4, kv_cache_tokens=2048)
        eng = served.engine
        step = eng.step

        def slow_step():
            time.sleep(0.02)
            return step()

        eng.step = slow_step  # the background loop calls self.step()
        return served
    return loader


@pytest.fixture(scope="module")
def slow(served_model):
    """A server whose engine takes >= 20 ms per step (a request of 150 tokens lasts >= 3 s)."""
    srv = LiveServer(_slow_loader(served_model), ServeOptions(shutdown_timeout=2))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _wait_idle(srv, timeout=10.0):
    eng = srv.state.served.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s.running == 0 and s.waiting == 0 and s.blocks_used == 0 and not eng.requests \
                and not srv.state.abandoned:
            return s
        time.sleep(0.02)
    raise AssertionError(f"not idle after {timeout} s: {eng.stats()}, requests "
                         f"{list(eng.requests)}, abandoned {srv.state.abandoned}")


def _metric(text, name):
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_stream_disconnect_cancels(slow):
    eng = slow.state.served.engine
    before = eng.stats().finished
    t0 = time.monotonic()
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", slow.url + "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got >= 3:
                    break
        assert eng.stats().blocks_used > 0 or eng.stats().running > 0
    s = _wait_idle(slow)
    assert time.monotonic() - t0 < 2.5  # well before the 150 tokens could have been generated
    assert s.finished == before + 1
    assert s.generated_tokens < 100


def test_whole_request_disconnect_cancels(slow):
    eng = slow.state.served.engine
    gen0 = eng.stats().generated_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/v1/chat/completions", json=BODY, timeout=0.5)
    s = _wait_idle(slow)
    assert s.generated_tokens - gen0 < 100


def test_metrics(slow):
    long = {**BODY, "max_tokens": 3, "messages": [{"role": "user", "content": "a b " * 60}]}
    first = httpx.post(slow.url + "/v1/chat/completions", json=long, timeout=30).json()
    again = httpx.post(slow.url + "/v1/chat/completions", json=long, timeout=30).json()
    assert first["usage"]["prompt_tokens"] > 64
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = again["usage"]["prompt_tokens"]
    # the full 64-token blocks of the prompt (its last token is always computed)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 64 * 64 > 0
    _wait_idle(slow)
    text = httpx.get(slow.url + "/metrics", timeout=10).text
    for name in ("olv_time_to_first_token_seconds_count", "olv_inter_token_latency_seconds_count",
                 "olv_e2e_request_latency_seconds_count", "olv_prompt_tokens_total",
                 "olv_generation_tokens_total", "olv_engine_steps_total",
                 "olv_engine_rows_total", "olv_prefix_cache_hit_tokens_total"):
        assert _metric(text, name) > 0, name
    assert _metric(text, "olv_kv_blocks_total") == slow.state.served.engine.stats().blocks_total
    for name in ("olv_requests_running", "olv_requests_waiting", "olv_kv_blocks_used"):
        assert _metric(text, name) == 0, name
    assert 'olv_requests_total{finish_reason="cancelled"}' in text
    assert 'olv_requests_total{finish_reason="length"}' in text


def test_drain_ends_in_flight_streams_properly(served_model):
    """Shutdown: new requests get 503; a stream still running at 80 % of shutdown_timeout is
    cancelled and ends with a finish reason and [DONE] (not a cut connection)."""
    srv = LiveServer(_slow_loader(served_model), ServeOptions(shutdown_timeout=1.0))
    try:
        srv.wait_ready()
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions",
                          json={**BODY, "stream": True}) as r:
                it = r.iter_lines()
                assert next(it).startswith("data: ")
                t0 = time.monotonic()
                srv.state.begin_drain()
                assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
                lines = [ln for ln in it if ln]
            elapsed = time.monotonic() - t0
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in lines[-2]
        assert 0.6 < elapsed < 2.5  # cancelled at 0.8 s, long before 150 tokens at >= 20 ms
        _wait_idle(srv)
    finally:
        srv.stop()
