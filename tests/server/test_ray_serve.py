"""``olv serve --replicas 2`` on Ray Serve, as users run it: a local Ray head on 127.0.0.1,
``olv serve`` in a subprocess attached to it with ``--ray-address``, httpx clients.

16 concurrent requests equal the engine's own greedy results and reach both replicas (the
``x-olv-replica`` header); then one replica's actor is killed while streams run on both: the
other replica's streams finish, the killed one's end promptly with an error (no hang), new
requests keep working, and Serve starts a replacement (bounded waits throughout).

Ray binds many of its own services (GCS, raylet, workers, agents) on 0.0.0.0 or the machine's
address whatever ``_node_ip_address`` says, and servers in tests may listen on 127.0.0.1 only: so
the whole scenario (ray_serve_scenario.py) runs in one child process in new user, network and PID
namespaces (``unshare -rn --pid --fork --kill-child --mount-proc``) whose only interface is
loopback; the namespace's last process gone, the kernel ends every process in it. The test
compares the child's observations with the engine's results computed here, and checks that no
process of the scenario listened on the host meanwhile."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from ray import serve
from ray_serve_scenario import LONG, MAX_TOKENS, PROMPTS, RESULT_PREFIX
from serve_process import free_port

from olv_runtime.cli import build_parser
from olv_runtime.errors import InvalidArgument
from olv_runtime.server import load_served
from olv_runtime.server.ray_serve import (
    DEPLOYMENT_NAME,
    EngineReplica,
    RayServeOptions,
    RayUnavailable,
    build_app,
    connect,
)

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

SCENARIO = Path(__file__).with_name("ray_serve_scenario.py")
SCENARIO_SECONDS = 900  # the scenario's own waits add up to ~700 s at most
NAMESPACES = ["-rn", "--pid", "--fork", "--kill-child", "--mount-proc"]


@pytest.fixture(scope="module")
def model(tiny_chat_models):
    # the INT4 conversion: the engine's exact mode is bitwise batch-invariant on it
    return tiny_chat_models["int4"]


@pytest.fixture(scope="module")
def reference(model):
    """The engine's greedy completion of each prompt (no HTTP, no Ray), as JSON gives it back."""
    served = load_served(model, model_name="tiny", max_batch=4, kv_cache_tokens=2048)
    ids = [served.tokenizer.encode(p).ids for p in PROMPTS]
    res = served.engine.generate(ids, {"max_new_tokens": MAX_TOKENS, "eos_token_id": "auto",
                                       "logprobs": True})
    return {p: [r.text, [lp.logprob for lp in r.logprobs]] for p, r in zip(PROMPTS, res)}


def _unshare() -> str:
    """The unshare binary, checked to make the namespaces here; the test fails (never skips)
    without it: CI runs as root on this image."""
    exe = shutil.which("unshare")
    if exe is None:
        pytest.fail("the Ray test needs 'unshare' (util-linux) on PATH to run Ray in a "
                    "loopback-only network namespace; it is missing")
    probe = subprocess.run([exe, *NAMESPACES, "true"], capture_output=True, text=True,
                           timeout=30, check=False)
    if probe.returncode != 0:
        pytest.fail(f"'unshare {' '.join(NAMESPACES)} true' is not permitted here (exit "
                    f"{probe.returncode}: {probe.stderr.strip()[:500]}); the Ray test needs user, "
                    "network and PID namespaces (root, or unprivileged user namespaces enabled)")
    return exe


def _host_listeners() -> dict:
    """{(address, port): (pid, process name)} of the TCP listeners in this (the host's) network
    namespace."""
    out = {}
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN:
            name = None
            if c.pid is not None:
                try:
                    name = psutil.Process(c.pid).name()
                except psutil.Error:
                    pass
            out[(c.laddr.ip, c.laddr.port)] = (c.pid, name)
    return out


def _tree(pid: int) -> dict[int, float]:
    """{pid: creation time} of a process and its descendants."""
    out = {}
    try:
        proc = psutil.Process(pid)
        for q in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                out[q.pid] = q.create_time()
    except psutil.Error:
        pass
    return out


def _alive(pids: dict[int, float]) -> list[int]:
    """The processes of ``pids`` still running (the same process: same creation time)."""
    out = []
    for pid, created in pids.items():
        with contextlib.suppress(psutil.Error):
            q = psutil.Process(pid)
            if q.create_time() == created and q.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


@pytest.fixture(scope="module")
def scenario(model, tmp_path_factory):
    """Run ray_serve_scenario.py in the namespaces (bounded: the process group is killed past
    SCENARIO_SECONDS); its observations, and what listened on the host meanwhile."""
    exe = _unshare()
    out_dir = tmp_path_factory.mktemp("ray_scenario")
    before = _host_listeners()
    with open(out_dir / "stdout", "w+") as so, open(out_dir / "stderr", "w+") as se:
        p = subprocess.Popen([exe, *NAMESPACES, sys.executable, str(SCENARIO), str(model)],
                             stdout=so, stderr=se, start_new_session=True)
        pids, new_on_host, timed_out = _tree(p.pid), {}, False
        try:
            deadline = time.monotonic() + SCENARIO_SECONDS
            while p.poll() is None and time.monotonic() < deadline:
                # the scenario's processes (host pids), and host listeners that were not there
                pids.update(_tree(p.pid))
                for addr, owner in _host_listeners().items():
                    if addr not in before:
                        new_on_host[addr] = owner
                time.sleep(0.5)
            if p.poll() is None:
                timed_out = True
        finally:
            if p.poll() is None:
                # unshare's child (the PID namespace's init) dies with it (--kill-child); the
                # kernel then kills every process of the namespace
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(60)
        so.seek(0)
        se.seek(0)
        stdout, stderr = so.read(), se.read()
    # nothing of the scenario outlives it
    deadline = time.monotonic() + 30
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _host_listeners()
    assert not timed_out, f"the Ray scenario ran past {SCENARIO_SECONDS} s: {stderr[-4000:]}"
    lines = [x for x in stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    assert p.returncode == 0 and len(lines) == 1, \
        f"exit {p.returncode}: {stdout[-2000:]} {stderr[-6000:]}"
    return types.SimpleNamespace(res=json.loads(lines[0][len(RESULT_PREFIX):]), pids=pids,
                                 alive=alive, before=before, after=after,
                                 new_on_host=new_on_host)


def test_ray_runs_only_in_a_loopback_namespace(scenario):
    res = scenario.res
    assert res["fatal"] is None, res["fatal"]
    # the child's network namespace is not the host's, and loopback is its only interface
    assert res["netns"] != os.readlink("/proc/self/ns/net")
    assert res["interfaces"] == ["lo"]
    assert res["lo_up_by"] == ("ip" if os.path.exists("/usr/sbin/ip") else "ioctl")
    inside = {tuple(a) for a in res["listeners"]}
    # Ray's services listen in there (some on 0.0.0.0 / ::: reachable only on its loopback)
    assert len(inside) >= 3, inside
    # Serve's HTTP proxy listens on 127.0.0.1 only
    assert {ip for ip, port in inside if port == res["port"]} == {"127.0.0.1"}, inside
    # no process of the scenario listened on the host, and none is left
    assert len(scenario.pids) >= 3, scenario.pids  # unshare, the scenario, Ray, olv serve...
    mine = {a: o for a, o in scenario.new_on_host.items() if o[0] in scenario.pids}
    assert not mine, mine
    ray_like = {a: o for a, o in scenario.new_on_host.items()
                if o[1] and any(k in o[1] for k in ("ray", "gcs_server"))}
    assert not ray_like, ray_like
    assert not scenario.alive, scenario.alive
    # and, after it, no listener on the host that was not there before is the scenario's
    left = {a: o for a, o in scenario.after.items() if a not in scenario.before}
    assert not {a: o for a, o in left.items() if o[0] in scenario.pids or
                (o[1] and any(k in o[1] for k in ("ray", "gcs_server")))}, left


def test_two_replicas_answer_like_the_engine_and_survive_a_killed_replica(scenario,
                                                                          reference):
    res = scenario.res
    assert res["fatal"] is None, res["fatal"]
    # 16 concurrent requests: each equals the engine's result; both replicas answer
    rs = res["concurrent"]
    assert [r[0] for r in rs] == [200] * 16, [r[3] for r in rs]
    # the same tokens, and bitwise the same log-probabilities (exact mode, INT4 weights): JSON
    # gives a float back exactly (repr round-trips)
    assert [r[2] for r in rs] == [reference[q] for q in PROMPTS]
    replicas = {r[1] for r in rs}
    assert len(replicas) == 2 and None not in replicas, replicas
    for path in ("/health", "/v1/models", "/metrics"):
        status, replica = res["gets"][path]
        assert status == 200 and replica in replicas, (path, status, replica)

    # streams on both replicas, then one replica's actor is killed
    assert set(res["streaming"]) == replicas
    victim = res["victim"]
    assert victim == min(res["streaming"])
    results = res["streams"]
    assert len(results) == 8
    kept = [r for r in results if r[0] not in (victim, None)]
    assert kept, results
    for replica, status, chunks, done, err in kept:  # the survivor's streams all finished
        assert (status, done, err) == (200, "length", None) and 1 <= chunks <= LONG, results
    # the victim's: a stream already running is cut (no [DONE]: the client sees an error);
    # a request it had not answered yet gets a 5xx from the proxy
    failed = [r for r in results if r[0] in (victim, None)]
    assert failed, results
    for replica, status, chunks, done, err in failed:
        assert not done and err is not None, results
        assert (replica, status) == (victim, 200) or (status is not None and status >= 500), \
            results
    assert res["kill_to_streams_end_s"] < 60

    # requests go on meanwhile, and Serve replaces the replica
    status, _, answer, body = res["after_kill"]
    assert status == 200 and answer == reference[PROMPTS[0]], (status, body)
    assert res["replaced"], res["status_after_kill"]
    rs = res["after_replacement"]
    assert [r[0] for r in rs] == [200] * 8, [r[3] for r in rs]
    assert victim not in {r[1] for r in rs}

    # SIGTERM: olv serve deletes its application and exits 0
    assert res["sigterm_exit"] == 0, res.get("olv_serve_stderr_tail")
    assert res["app_after_sigterm"] is None


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
    port = free_port()  # nothing listens there
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
