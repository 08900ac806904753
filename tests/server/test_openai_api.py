"""The OpenAI routes with the official openai client against a live in-process server: chat and
completions, streamed and not, logprobs, usage, stop strings, seeds, structured output,
concurrent requests equal to solo runs (20 JSON schemas: test_json_schemas.py)."""
from __future__ import annotations

import concurrent.futures
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as c:
        yield c


def test_health_and_models(live, client):
    assert httpx.get(live.url + "/health", timeout=10).json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_text_equals_the_engine(live, client):
    eng = live.state.served.engine
    ids = live.state.served.tokenizer.encode("hello world").ids
    want = eng.generate([ids], {"max_new_tokens": 6, "eos_token_id": "auto"})[0]
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=6,
                                  temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == {"length": "length", "eos": "stop"}[want.finish_reason]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == want.ids.size
    # token ids as the prompt: the same completion
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == want.text


def test_chat_streamed_equals_whole_with_usage(client):
    whole = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    fins = [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason]
    assert fins == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    u = chunks[-1].usage
    assert (u.prompt_tokens, u.completion_tokens) == (whole.usage.prompt_tokens,
                                                      whole.usage.completion_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert whole.usage.completion_tokens <= 8


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == e.top_logprobs[0].logprob  # greedy: the chosen one is the best
        assert [a.logprob for a in e.top_logprobs] == sorted(
            (a.logprob for a in e.top_logprobs), reverse=True)


def test_completion_logprobs_streamed_and_not(client):
    kw = {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**kw).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert len(whole.tokens) == 5 and all(len(t) == 2 for t in whole.top_logprobs)
    assert [lp for s in streamed for lp in s.token_logprobs] == whole.token_logprobs


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model="tiny", prompt="hello world", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=12,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]


def test_same_seed_same_sample(client):
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 10, "temperature": 1.0, "top_p": 0.9,
              "seed": 1234}
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_sampling_fields_accepted(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_completion_tokens=3, temperature=0.7, top_p=0.8,
        presence_penalty=0.5, frequency_penalty=0.5, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens <= 3


def test_json_object_output_parses(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=120,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # completions take response_format too (a bounded schema: a random model may write one
    # endless key in a free object -- the grammar bounds the form, not the length)
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}}}
    r = client.completions.create(model="tiny", prompt="x", max_tokens=120, temperature=1.0,
                                  seed=2, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    # the mask cost per token is reported
    text = httpx.get(str(client.base_url).replace("/v1/", "/metrics"), timeout=10).text
    count = [ln for ln in text.splitlines() if ln.startswith("olv_grammar_mask_seconds_count")]
    assert count and float(count[0].split()[1]) >= 1


def test_concurrent_streams_equal_solo_runs(client):
    prompts = [f"say {w} " * (1 + i) for i, w in enumerate("abcdefgh")]

    def run(p, stream):
        if not stream:
            return client.completions.create(model="tiny", prompt=p, max_tokens=10,
                                             temperature=0).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True) if c.choices)

    solo = [run(p, False) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        both = list(ex.map(lambda p: run(p, True), prompts))
    assert both == solo


@pytest.fixture(scope="module")
def live_int4(tiny_chat_models):
    """A server of the INT4 conversion (bitwise batch invariance at concurrency 1, 4 and 16 on
    both conversions: tests/server/test_determinism.py)."""
    from live_server import LiveServer

    from olv_runtime.server import ServeOptions, load_served

    srv = LiveServer(lambda: load_served(tiny_chat_models["int4"], model_name="tiny",
                                         max_batch=8, kv_cache_tokens=4096),
                     ServeOptions(shutdown_timeout=2))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_many_clients_some_leaving(live_int4):
    """24 concurrent streams of random lengths, 3 of them leaving after their first tokens: no
    server error, every completed text equals the engine's own run of the same request, and the
    KV blocks are all free afterwards."""
    import random
    import time

    rng = random.Random(0)
    served = live_int4.state.served
    tok, eng = served.tokenizer, served.engine
    jobs = [(" ".join(rng.choice(["ab", "cd", "ef", "gh"]) for _ in range(rng.randrange(1, 40))),
             rng.randrange(1, 20)) for _ in range(24)]
    leaving = {3, 11, 19}

    def run(i):
        prompt, n = jobs[i]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                "stream": True, "ignore_eos": True}
        text, done = "", False
        with httpx.Client(timeout=60) as c, c.stream("POST", live_int4.url + "/v1/completions",
                                                     json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if i in leaving:
                    return None  # the connection closes here, mid-stream
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    text += obj["choices"][0]["text"]
        assert done
        return text

    with concurrent.futures.ThreadPoolExecutor(24) as ex:
        got = list(ex.map(run, range(24)))
    want = eng.generate([tok.encode(p).ids for p, _ in jobs],
                        [{"max_new_tokens": n, "eos_token_id": None} for _, n in jobs])
    for i, (g, w) in enumerate(zip(got, want)):
        if i not in leaving:
            assert g == w.text, i
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = eng.stats()
        if s.blocks_used == 0 and s.running == 0 and not eng.requests:
            break
        time.sleep(0.05)
    assert (s.blocks_used, s.running, len(eng.requests)) == (0, 0, 0), s
