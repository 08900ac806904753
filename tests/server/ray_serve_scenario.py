"""The Ray scenario of tests/server/test_ray_serve.py, run by that test in a child process inside
a new network namespace (``unshare -rn``, a PID namespace too): Ray binds many of its services on
0.0.0.0 / the machine's address whatever ``_node_ip_address`` says, and there the only interface
is loopback. Not a test module (no ``test_`` prefix): ``python ray_serve_scenario.py MODEL``.

Brings ``lo`` up, starts a local Ray on 127.0.0.1 (no dashboard) and ``olv serve --replicas 2``
attached to it, then records what happens (16 concurrent requests, a replica's actor killed while
streams run on both, the replacement, SIGTERM); stops everything it started, and prints one line
``RESULT_PREFIX + json`` with the observations. The test asserts on them (the expected results
are the engine's, computed there). Every wait here is bounded; a step the next ones need that
does not happen ends the scenario with ``fatal`` set."""
from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

RESULT_PREFIX = "OLV_RAY_SCENARIO_RESULT "
START_SECONDS = 150
MAX_TOKENS = 8
LONG = 200  # tokens of the streams a replica's death interrupts (the prompts + 200 <= 256)
PROMPTS = [f"tell {w} " * (1 + i % 5) for i, w in enumerate("abcdefghijklmnop")]

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> str:
    """Bring this network namespace's ``lo`` up: ``ip link set lo up``, or an ioctl without ip."""
    if os.path.exists("/usr/sbin/ip"):
        subprocess.run(["/usr/sbin/ip", "link", "set", "lo", "up"], check=True, timeout=30)
        return "ip"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req + b"\0" * 22)
                              [:18])[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS,
                    struct.pack("16sh", b"lo", flags | _IFF_UP) + b"\0" * 22)
    return "ioctl"


def _hex_ip(h: str) -> str:
    raw = bytes.fromhex(h)
    # /proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listeners() -> list[tuple[str, int]]:
    """Sorted (address, port) of the TCP sockets listening in this process's network namespace
    (/proc/net/tcp and tcp6: state 0A)."""
    out = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    ip, port = fields[1].split(":")
                    out.add((_hex_ip(ip), int(port, 16)))
    return sorted(out)


def main(model: str) -> dict:
    import httpx
    import ray
    from ray import serve

    from olv_runtime.server.ray_serve import APP_NAME, DEPLOYMENT_NAME, REPLICA_HEADER

    res: dict = {"fatal": None, "netns": os.readlink("/proc/self/ns/net")}
    res["lo_up_by"] = loopback_up()
    res["interfaces"] = sorted(n for _, n in socket.if_nameindex())

    def deployment_status():
        app = serve.status().applications.get(APP_NAME)
        return None if app is None else app.deployments.get(DEPLOYMENT_NAME)

    def running(n: int) -> bool:
        d = deployment_status()
        return d is not None and d.replica_states.get("RUNNING", 0) == n and \
            sum(d.replica_states.values()) == n

    def complete(prompt: str):
        r = httpx.post(url + "/v1/completions",
                       json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                             "temperature": 0, "logprobs": 0}, timeout=60)
        if r.status_code != 200:
            return [r.status_code, r.headers.get(REPLICA_HEADER), None, r.text[:300]]
        c = r.json()["choices"][0]
        return [r.status_code, r.headers.get(REPLICA_HEADER),
                [c["text"], c["logprobs"]["token_logprobs"]], None]

    def stream(prompt: str, started):
        """[replica, status, number of token chunks, the finish reason if [DONE] came, error]
        of one streamed completion."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True, "stream": True}
        replica = status = err = finish = None
        chunks, done = 0, False
        with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as c:
            try:
                with c.stream("POST", url + "/v1/completions", json=body) as s:
                    replica, status = s.headers.get(REPLICA_HEADER), s.status_code
                    started.append((replica, status))
                    if status != 200:
                        return [replica, status, 0, None, s.read().decode()[:300]]
                    for line in s.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            obj = json.loads(line[6:])
                            if "error" in obj:
                                err = obj["error"]
                            elif obj["choices"][0]["finish_reason"] is None:
                                chunks += 1
                            else:
                                finish = obj["choices"][0]["finish_reason"]
            except httpx.HTTPError as exc:
                err = repr(exc)
            return [replica, status, chunks, finish if done else None, err]

    p = None
    ray_started = False
    try:
        # address="local": a new Ray, never a cluster this machine already runs
        ray.init(address="local", num_cpus=3, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
        ray_started = True
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        res["port"] = port
        url = f"http://127.0.0.1:{port}"
        p = subprocess.Popen(
            [sys.executable, "-m", "olv_runtime.cli", "serve", model, "--replicas", "2",
             "--ray-address", ray.get_runtime_context().gcs_address, "--port", str(port),
             "--served-model-name", "tiny", "--max-batch", "4", "--kv-cache-tokens", "2048",
             "--num-cpus-per-replica", "1", "--shutdown-timeout", "3", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_SECONDS
        while True:
            if p.poll() is not None:
                out, err = p.communicate(timeout=10)
                raise RuntimeError(f"olv serve exited {p.returncode}: {out[-2000:]}"
                                   f"{err[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"olv serve --replicas 2 not ready in {START_SECONDS} s")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200 and running(2):
                    break
            time.sleep(0.2)

        # what listens in the namespace once the replicas are up
        res["listeners"] = listeners()
        if shutil.which("ss"):
            res["ss"] = subprocess.run(["ss", "-ltn"], capture_output=True, text=True,
                                       timeout=30, check=False).stdout

        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            res["concurrent"] = list(ex.map(complete, PROMPTS))
        res["gets"] = {}
        for path in ("/health", "/v1/models", "/metrics"):
            g = httpx.get(url + path, timeout=10)
            res["gets"][path] = [g.status_code, g.headers.get(REPLICA_HEADER)]

        # streams on both replicas, then one replica's actor is killed
        started = []
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(stream, PROMPTS[i], started) for i in range(8)]
            deadline = time.monotonic() + 60
            while len(streaming := {r for r, status in started if status == 200}) < 2 and \
                    time.monotonic() < deadline and not all(f.done() for f in futs):
                time.sleep(0.01)
            res["streaming"] = sorted(streaming)
            if len(streaming) != 2:
                for f in futs:
                    f.result(timeout=120)
                raise RuntimeError(f"streams did not run on 2 replicas: {started}")
            victim = min(streaming)
            res["victim"] = victim
            actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim}",
                                  namespace="serve")
            t_kill = time.monotonic()
            ray.kill(actor, no_restart=True)
            res["streams"] = [f.result(timeout=90) for f in futs]
        res["kill_to_streams_end_s"] = time.monotonic() - t_kill

        # requests go on meanwhile, and Serve replaces the replica
        res["after_kill"] = complete(PROMPTS[0])
        deadline = time.monotonic() + START_SECONDS
        while not running(2) and time.monotonic() < deadline:
            time.sleep(0.5)
        res["replaced"] = running(2)
        res["status_after_kill"] = str(deployment_status())[:2000]
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            res["after_replacement"] = list(ex.map(complete, PROMPTS[:8]))

        # SIGTERM: olv serve deletes its application and exits 0
        p.send_signal(signal.SIGTERM)
        try:
            res["sigterm_exit"] = p.wait(60)
        except subprocess.TimeoutExpired:
            res["sigterm_exit"] = "no exit in 60 s"
        res["app_after_sigterm"] = None if serve.status().applications.get(APP_NAME) is None \
            else "still deployed"
    except Exception:  # noqa: BLE001 -- whatever stops the scenario is reported to the test
        res["fatal"] = traceback.format_exc()[-6000:]
    finally:
        if p is not None:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            with contextlib.suppress(Exception):
                _, err = p.communicate(timeout=30)
                res["olv_serve_stderr_tail"] = err[-3000:]
        if ray_started:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
    return res


if __name__ == "__main__":
    result = main(sys.argv[1])
    print(RESULT_PREFIX + json.dumps(result), flush=True)
