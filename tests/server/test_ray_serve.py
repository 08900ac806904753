"""``olv serve --replicas 2`` on Ray Serve, as users run it: a local Ray head on 127.0.0.1 started
here, ``olv serve`` in a subprocess attached to it with ``--ray-address``, httpx clients.

16 concurrent requests equal the engine's own greedy results and reach both replicas (the
``x-olv-replica`` header); then one replica's actor is killed while streams run on both: the
other replica's streams finish, the killed one's end promptly with an error (no hang), new
requests keep working, and Serve starts a replacement (bounded waits throughout)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import ray
from ray import serve

from olv_runtime.cli import build_parser
from olv_runtime.errors import InvalidArgument
from olv_runtime.server import load_served
from olv_runtime.server.ray_serve import (
    APP_NAME,
    DEPLOYMENT_NAME,
    REPLICA_HEADER,
    EngineReplica,
    RayServeOptions,
    RayUnavailable,
    build_app,
    connect,
)

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

START_SECONDS = 150
MAX_TOKENS = 8
LONG = 200  # tokens of the streams a replica's death interrupts (the prompts + 200 <= 256)
PROMPTS = [f"tell {w} " * (1 + i % 5) for i, w in enumerate("abcdefghijklmnop")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tiny_chat_models):
    # the INT4 conversion: the engine's exact mode is bitwise batch-invariant on it
    return tiny_chat_models["int4"]


@pytest.fixture(scope="module")
def reference(model):
    """The engine's greedy completion of each prompt (no HTTP, no Ray)."""
    served = load_served(model, model_name="tiny", max_batch=4, kv_cache_tokens=2048)
    ids = [served.tokenizer.encode(p).ids for p in PROMPTS]
    res = served.engine.generate(ids, {"max_new_tokens": MAX_TOKENS, "eos_token_id": "auto",
                                       "logprobs": True})
    return {p: (r.text, [lp.logprob for lp in r.logprobs]) for p, r in zip(PROMPTS, res)}


@pytest.fixture(scope="module")
def ray_head():
    """A local Ray head on 127.0.0.1 (no dashboard): its GCS address."""
    # address="local": a new Ray, never a cluster this machine already runs
    ray.init(address="local", num_cpus=3, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def olv_ray(ray_head, model):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "olv_runtime.cli", "serve", str(model),
                          "--replicas", "2", "--ray-address", ray_head, "--port", str(port),
                          "--served-model-name", "tiny", "--max-batch", "4",
                          "--kv-cache-tokens", "2048", "--num-cpus-per-replica", "1",
                          "--shutdown-timeout", "3", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert p.poll() is None, p.communicate(timeout=10)
            assert time.monotonic() < deadline, f"olv serve --replicas 2 not ready in " \
                                                f"{START_SECONDS} s"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200 and \
                        _running(2):
                    break
            time.sleep(0.2)
        yield p, url, port
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        p.communicate(timeout=30)


def _deployment_status():
    app = serve.status().applications.get(APP_NAME)
    return None if app is None else app.deployments.get(DEPLOYMENT_NAME)


def _running(n: int) -> bool:
    d = _deployment_status()
    return d is not None and d.replica_states.get("RUNNING", 0) == n and \
        sum(d.replica_states.values()) == n


def _complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                  "max_tokens": max_tokens, "temperature": 0,
                                                  "logprobs": 0},
                   timeout=60)
    return r


def _answer(r):
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def _stream(url: str, prompt: str, started, max_tokens: int):
    """(replica, status, texts of the token chunks, the finish reason if [DONE] came, error)
    of one streamed completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, done, err, finish = [], False, None, None
    with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as c:
        try:
            with c.stream("POST", url + "/v1/completions", json=body) as s:
                replica = s.headers.get(REPLICA_HEADER)
                started.append((replica, s.status_code))
                if s.status_code != 200:
                    return replica, s.status_code, text, None, s.read().decode()
                for line in s.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            err = obj["error"]
                        elif obj["choices"][0]["finish_reason"] is None:
                            text.append(obj["choices"][0]["text"])
                        else:
                            finish = obj["choices"][0]["finish_reason"]
        except httpx.HTTPError as exc:
            err = repr(exc)
        return replica, s.status_code, text, finish if done else None, err


def test_two_replicas_answer_like_the_engine_and_survive_a_killed_replica(olv_ray, reference):
    p, url, port = olv_ray
    # Serve's HTTP proxy listens on 127.0.0.1 only
    addrs = {c.laddr.ip for c in psutil.net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert addrs == {"127.0.0.1"}

    # 16 concurrent requests: each equals the engine's result; both replicas answer
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        rs = list(ex.map(lambda q: _complete(url, q), PROMPTS))
    assert [r.status_code for r in rs] == [200] * 16, [r.text[:200] for r in rs]
    # the same tokens, and bitwise the same log-probabilities (exact mode, INT4 weights)
    assert [_answer(r) for r in rs] == [reference[q] for q in PROMPTS]
    replicas = {r.headers[REPLICA_HEADER] for r in rs}
    assert len(replicas) == 2, replicas
    for path in ("/health", "/v1/models", "/metrics"):
        g = httpx.get(url + path, timeout=10)
        assert g.status_code == 200 and g.headers[REPLICA_HEADER] in replicas, path

    # streams on both replicas, then one replica's actor is killed
    started = []
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(_stream, url, PROMPTS[i], started, LONG) for i in range(8)]
        deadline = time.monotonic() + 60
        while len(streaming := {r for r, status in started if status == 200}) < 2 and \
                time.monotonic() < deadline and not all(f.done() for f in futs):
            time.sleep(0.01)
        assert len(streaming) == 2, started
        victim = min(streaming)
        actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim}",
                              namespace="serve")
        t_kill = time.monotonic()
        ray.kill(actor, no_restart=True)
        results = [f.result(timeout=90) for f in futs]
    outcomes = [(r[0], r[1], len(r[2]), r[3], str(r[4])[:120]) for r in results]
    kept = [r for r in results if r[0] not in (victim, None)]
    assert kept, outcomes
    for replica, status, text, done, err in kept:  # the survivor's streams all finished
        assert (status, done, err) == (200, "length", None) and len(text) >= 1, outcomes
    # the victim's: a stream already running is cut (no [DONE]: the client sees an error);
    # a request it had not answered yet gets a 5xx from the proxy
    failed = [r for r in results if r[0] in (victim, None)]
    assert failed, outcomes
    for replica, status, text, done, err in failed:
        assert not done and err is not None, outcomes
        assert (replica, status) == (victim, 200) or status >= 500, outcomes
    assert time.monotonic() - t_kill < 60

    # requests go on meanwhile, and Serve replaces the replica
    r = _complete(url, PROMPTS[0])
    assert r.status_code == 200 and _answer(r) == reference[PROMPTS[0]]
    deadline = time.monotonic() + START_SECONDS
    while not _running(2):
        assert time.monotonic() < deadline, _deployment_status()
        time.sleep(0.5)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda q: _complete(url, q), PROMPTS[:8]))
    assert [r.status_code for r in rs] == [200] * 8
    assert victim not in {r.headers[REPLICA_HEADER] for r in rs}

    # SIGTERM: olv serve deletes its application and exits 0
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
    assert serve.status().applications.get(APP_NAME) is None


# -- bad input: clear errors, no Ray started ------------------------------------------------------
def _olv_serve(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "olv_runtime.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_replicas_must_be_positive(model):
    r = _olv_serve(str(model), "--replicas", "0")
    assert r.returncode == 2 and "--replicas: expected an integer >= 1, got 0" in r.stderr


def test_ray_options_need_replicas():
    args = build_parser().parse_args(["serve", "m.onnx"])
    assert (args.replicas, args.ray_address, args.num_cpus_per_replica) == (None, None, None)
    r = _olv_serve("m.onnx", "--ray-address", "127.0.0.1:6379", "--max-replicas", "3")
    assert r.returncode == 2
    assert "--ray-address, --max-replicas need --replicas N" in r.stderr


def test_unreachable_ray_address_is_named(model):
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    r = _olv_serve(str(model), "--replicas", "1", "--ray-address", f"127.0.0.1:{port}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--ray-address 127.0.0.1:{port}: unreachable" in r.stderr
    assert time.monotonic() - t0 < 60
    r = _olv_serve(str(model), "--replicas", "1", "--ray-address", "no-port-here")
    assert r.returncode == 2 and "expected HOST:PORT" in r.stderr


def test_ray_not_installed_names_the_pip_command(monkeypatch, model):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "ray" else real(name, *a))
    with pytest.raises(RayUnavailable, match=r"pip install 'olv_runtime\[serve,ray\]'"):
        connect(None)
    with pytest.raises(RayUnavailable, match="ray"):
        build_app({"model": str(model)})


@pytest.mark.parametrize("kw, match", [
    ({"replicas": 0}, r"replicas: expected an integer >= 1, got 0"),
    ({"num_cpus_per_replica": 0}, r"num_cpus_per_replica: expected a number > 0"),
    ({"max_ongoing_requests": 0}, r"max_ongoing_requests: expected an integer >= 1"),
    ({"replicas": 2, "max_replicas": 1},
     r"min_replicas <= replicas <= max_replicas, got 1 <= 2 <= 1"),
    ({"replicas": 2, "min_replicas": 3, "max_replicas": 4}, r"got 3 <= 2 <= 4"),
    ({"min_replicas": -1}, r"min_replicas: expected an integer >= 0, got -1"),
])
def test_ray_options_out_of_range(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        RayServeOptions(**kw)


def test_deployment_options():
    fixed = RayServeOptions(replicas=3, num_cpus_per_replica=2).deployment_options(16)
    assert fixed == {"name": DEPLOYMENT_NAME, "ray_actor_options": {"num_cpus": 2},
                     "max_ongoing_requests": 16, "num_replicas": 3}
    auto = RayServeOptions(replicas=2, max_replicas=4, max_ongoing_requests=5) \
        .deployment_options(8)
    assert auto["num_replicas"] == "auto" and auto["max_ongoing_requests"] == 5
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                          "initial_replicas": 2, "target_ongoing_requests": 4}


def test_local_ray_needs_the_cpus():
    with pytest.raises(InvalidArgument, match=r"1000 replicas x 1.0 CPUs need 1000 CPUs; this "
                                              r"machine has \d+"):
        connect(None, ray_options=RayServeOptions(replicas=1000))


@pytest.mark.parametrize("args, match", [
    ({}, r"args need 'model'"),
    ({"model": "m.onnx", "replica": 2}, r"unknown args \['replica'\]"),
    ({"model": "m.onnx", "replicas": 0}, r"replicas: expected an integer >= 1"),
])
def test_config_file_builder_rejects_bad_args(args, match):
    with pytest.raises(InvalidArgument, match=match):
        build_app(args)


def test_config_file_builder_makes_an_application():
    """``import_path: olv_runtime.server.ray_serve:build_app`` (docs/serving.md): one
    parameter, a Serve Application back (Serve calls it with the config file's ``args``)."""
    app = build_app({"model": "/models/m.onnx", "replicas": 2, "max_batch": 8, "threads": 2,
                     "api_key": "k", "kv_dtype": "int8"})
    assert isinstance(app, serve.Application)


def test_health_check_fails_once_the_engine_loop_stops():
    """Serve's check_health of a replica (no Ray needed): ok while the engine's loop runs."""
    alive = [True]
    state = types.SimpleNamespace(load_error=None, draining=False, served=types.SimpleNamespace(
        engine=types.SimpleNamespace(running_in_background=lambda: alive[0])))
    rep = object.__new__(EngineReplica)  # Serve makes replicas; only the state matters here
    rep.olv_app = types.SimpleNamespace(state=types.SimpleNamespace(olv=state))
    rep.check_health()
    alive[0] = False
    with pytest.raises(RuntimeError, match="step loop is not running"):
        rep.check_health()
    state.draining = True  # a replica shutting down stops its loop on purpose
    rep.check_health()
    state.load_error = OSError("gone")
    with pytest.raises(RuntimeError, match="the engine failed to start: gone"):
        rep.check_health()
