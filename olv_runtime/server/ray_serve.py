"""Scale-out on Ray Serve: ``olv serve MODEL --replicas N`` (docs/serving.md).

Each replica of one Serve deployment (:class:`EngineReplica`) loads the model, makes its own
:class:`~olv_runtime.Engine` and serves the same Starlette application as the single-process
server (:func:`olv_runtime.server.app.create_app`); Ray Serve's HTTP proxy receives the requests
and hands each one, as ASGI, to a replica (late-bound ``@serve.ingress``). The application is
wrapped in one small ASGI layer, :class:`ReplicaHeader`, that names the replica in an
``x-olv-replica`` header on every response. ``/metrics`` is the replica's own.

Ray is an optional extra (``pip install 'olv_runtime[serve,ray]'``): it is imported inside the
functions that need it (:data:`olv_runtime.config.LAZY_IMPORTS`), so this module imports without
it and only the calls that reach Ray raise :class:`RayUnavailable`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import threading

from olv_runtime.errors import InvalidArgument, OlvError
from olv_runtime.executor.session import SessionOptions
from olv_runtime.server.app import ServeOptions, create_app
from olv_runtime.server.run import load_served

__all__ = ["APP_NAME", "DEPLOYMENT_NAME", "REPLICA_HEADER", "EngineReplica", "ProxyUnavailable",
           "RayServeOptions", "RayUnavailable", "ReplicaHeader", "build_app", "connect",
           "deployment", "serve_on_ray"]

log = logging.getLogger("olv_runtime.server")

#: the Serve application and deployment names (the replica actors are named
#: ``SERVE_REPLICA::olv#OlvEngine#<replica id>`` in the namespace ``serve``)
APP_NAME = "olv"
DEPLOYMENT_NAME = "OlvEngine"
#: the response header that names the replica
REPLICA_HEADER = "x-olv-replica"
RAY_PIP = "pip install 'olv_runtime[serve,ray]'"
#: seconds to wait for a TCP connection to --ray-address before saying it is unreachable
CONNECT_SECONDS = 5.0


class RayUnavailable(OlvError):
    """Ray cannot be used: not installed, or no cluster answers at the address given."""


class ProxyUnavailable(OlvError):
    """Ray Serve's HTTP proxy cannot listen on the address asked (the port is in use)."""


@dataclasses.dataclass
class RayServeOptions:
    """How the deployment is spread over Ray.

    Attributes
    ----------
    replicas : int
        Engine replicas (>= 1); with autoscaling, the number started with.
    num_cpus_per_replica : float
        CPUs Ray reserves for each replica (> 0); also the default numba thread count of its
        engine (at least 1).
    max_ongoing_requests : int or None
        Requests the proxy hands one replica at a time (>= 1); more wait in Serve's queue.
        None: the engine's ``max_batch``.
    min_replicas, max_replicas : int or None
        Autoscaling bounds (Serve's ``autoscaling_config``) when either is set:
        ``0 <= min_replicas <= replicas <= max_replicas``; min defaults to 1, max to
        ``replicas``.

    Raises
    ------
    InvalidArgument
        A value out of its range (the message names the field, expected and got).
    """

    replicas: int = 1
    num_cpus_per_replica: float = 1.0
    max_ongoing_requests: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None

    def __post_init__(self):
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidArgument(f"replicas: expected an integer >= 1, got {self.replicas!r}")
        if not self.num_cpus_per_replica > 0:
            raise InvalidArgument("num_cpus_per_replica: expected a number > 0, got "
                                  f"{self.num_cpus_per_replica!r}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise InvalidArgument("max_ongoing_requests: expected an integer >= 1, got "
                                  f"{self.max_ongoing_requests!r}")
        if self.autoscaling:
            lo, hi = self.bounds
            if lo < 0:
                raise InvalidArgument(f"min_replicas: expected an integer >= 0, got {lo}")
            if not lo <= self.replicas <= hi:
                raise InvalidArgument(
                    f"autoscaling needs min_replicas <= replicas <= max_replicas, got "
                    f"{lo} <= {self.replicas} <= {hi}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(min_replicas, max_replicas) with their defaults."""
        return (1 if self.min_replicas is None else self.min_replicas,
                self.replicas if self.max_replicas is None else self.max_replicas)

    def deployment_options(self, max_batch: int) -> dict:
        """Keyword arguments of ``serve.deployment(...)``."""
        out = {"name": DEPLOYMENT_NAME,
               "ray_actor_options": {"num_cpus": self.num_cpus_per_replica},
               "max_ongoing_requests": self.max_ongoing_requests or max_batch}
        if self.autoscaling:
            lo, hi = self.bounds
            out["num_replicas"] = "auto"
            out["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi,
                                         "initial_replicas": self.replicas,
                                         "target_ongoing_requests": max(1, max_batch // 2)}
        else:
            out["num_replicas"] = self.replicas
        return out


class ReplicaHeader:
    """ASGI middleware: adds ``x-olv-replica: <replica>`` to every HTTP response of ``app``
    (lifespan and other scopes pass through untouched).

    Parameters
    ----------
    app : ASGI application
    replica : str
        The value of the header (the Serve replica id).
    """

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode("latin-1"), replica.encode("latin-1"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), self.header])
            await send(message)

        await self.app(scope, receive, named)


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_tag


class EngineReplica:
    """One replica of the deployment: the model loaded into its own engine, the single-process
    server's application around it. Made by Ray Serve (through :func:`deployment`), not by hand.

    Parameters
    ----------
    model_path : str
        The converted model, at this path on every node that runs a replica.
    load : dict
        Keyword arguments of :func:`~olv_runtime.server.load_served` (``session_options`` as a
        dict of :class:`~olv_runtime.executor.session.SessionOptions` fields).
    options : dict
        Fields of :class:`~olv_runtime.server.app.ServeOptions`.

    Raises
    ------
    OlvError
        The model cannot be loaded (Serve reports the replica as failed and retries).
    """

    async def __init__(self, model_path: str, load: dict, options: dict):
        load = dict(load)
        if load.get("session_options") is not None:
            load["session_options"] = SessionOptions(**load["session_options"])
        # loaded before the replica reports ready: the proxy sends it no request while it loads
        served = await asyncio.to_thread(load_served, model_path, **load)
        self.replica = _replica_id()
        self.olv_app = create_app(lambda: served, ServeOptions(**options))

    def __serve_build_asgi_app__(self):
        return ReplicaHeader(self.olv_app, self.replica)

    def check_health(self) -> None:
        """Serve's periodic health check (Serve replaces a replica that fails it).

        Raises
        ------
        RuntimeError
            The engine failed to start, or its step loop has stopped (not while draining).
        """
        st = self.olv_app.state.olv
        if st.load_error is not None:
            raise RuntimeError(f"the engine failed to start: {st.load_error}")
        if st.served is not None and not st.draining \
                and not st.served.engine.running_in_background():
            raise RuntimeError("the engine's step loop is not running")


def _require_ray():
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise RayUnavailable(f"--replicas needs Ray Serve (ray[serve]): {RAY_PIP}")


def deployment(model_path, *, load: dict | None = None, options: ServeOptions | None = None,
               ray_options: RayServeOptions | None = None):
    """The Serve application of a model: :class:`EngineReplica` replicas as one deployment.

    Parameters
    ----------
    model_path : path
        The converted model; every node that runs a replica reads it at this path.
    load : dict, optional
        :func:`~olv_runtime.server.load_served` keyword arguments (``model_name``, ``max_batch``,
        ``kv_cache_tokens``, ``kv_dtype``, ``max_tokens_per_step``, ``session_options`` as a
        dict); ``session_options.num_threads`` defaults to the replica's CPUs.
    options : ServeOptions, optional
    ray_options : RayServeOptions, optional

    Returns
    -------
    ray.serve.Application
        For ``serve.run(app, name=APP_NAME, route_prefix="/")``.

    Raises
    ------
    RayUnavailable
        ray[serve] is not installed.
    """
    _require_ray()
    from ray import serve

    ray_options = ray_options or RayServeOptions()
    load = dict(load or {})
    so = dict(load.get("session_options") or {})
    if so.get("num_threads") is None:
        so["num_threads"] = max(1, int(ray_options.num_cpus_per_replica))
    load["session_options"] = so
    opts = dataclasses.asdict(options or ServeOptions())
    cls = serve.ingress()(EngineReplica)
    dep = serve.deployment(cls, **ray_options.deployment_options(load.get("max_batch", 16)))
    return dep.bind(str(model_path), load, opts)


def build_app(args: dict):
    """Application builder for a Serve config file (``import_path:
    olv_runtime.server.ray_serve:build_app``; docs/serving.md).

    Parameters
    ----------
    args : dict
        ``model`` (required: the model path on every node); optional ``replicas``,
        ``num_cpus_per_replica``, ``max_ongoing_requests``, ``min_replicas``, ``max_replicas``
        (:class:`RayServeOptions`); ``served_model_name``, ``max_batch``, ``kv_cache_tokens``,
        ``kv_dtype``, ``max_tokens_per_step``, ``threads``, ``quantize_activations`` (the
        engine); ``api_key``, ``max_waiting``, ``max_body_bytes``, ``shutdown_timeout``
        (:class:`~olv_runtime.server.app.ServeOptions`).

    Raises
    ------
    InvalidArgument
        ``model`` missing, an unknown key (named), or a value out of range.
    RayUnavailable
        ray[serve] is not installed.
    """
    ray_keys = ("replicas", "num_cpus_per_replica", "max_ongoing_requests", "min_replicas",
                "max_replicas")
    load_keys = {"served_model_name": "model_name", "max_batch": "max_batch",
                 "kv_cache_tokens": "kv_cache_tokens", "kv_dtype": "kv_dtype",
                 "max_tokens_per_step": "max_tokens_per_step"}
    session_keys = {"threads": "num_threads", "quantize_activations": "quantize_activations"}
    option_keys = tuple(f.name for f in dataclasses.fields(ServeOptions))
    known = {"model", *ray_keys, *load_keys, *session_keys, *option_keys}
    unknown = sorted(set(args) - known)
    if unknown:
        raise InvalidArgument(f"olv Serve application: unknown args {unknown}; expected some of "
                              f"{sorted(known)}")
    if "model" not in args:
        raise InvalidArgument("olv Serve application: args need 'model' (the model's path on "
                              "every node)")
    load = {v: args[k] for k, v in load_keys.items() if k in args}
    load["session_options"] = {v: args[k] for k, v in session_keys.items() if k in args}
    return deployment(args["model"], load=load,
                      options=ServeOptions(**{k: args[k] for k in option_keys if k in args}),
                      ray_options=RayServeOptions(**{k: args[k] for k in ray_keys if k in args}))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def connect(ray_address: str | None, *, host: str = "127.0.0.1",
            ray_options: RayServeOptions | None = None) -> bool:
    """Connect to the Ray cluster at ``ray_address``, or start a local one (no dashboard; on
    127.0.0.1 when ``host`` is a loopback address).

    Parameters
    ----------
    ray_address : str or None
        ``HOST:PORT`` of a cluster's head (``ray start --head`` prints it), ``auto``, or None for
        a local Ray started here.
    host : str
        The address the HTTP proxy binds.
    ray_options : RayServeOptions, optional
        Checked against this machine's CPUs when Ray is started here.

    Returns
    -------
    bool
        True when Ray was started here (the caller shuts it down).

    Raises
    ------
    RayUnavailable
        ray[serve] is not installed; ``ray_address`` malformed, unreachable, or no Ray cluster
        there that lets this machine join.
    InvalidArgument
        A local Ray has too few CPUs for the fixed replica count (needed vs this machine's).
    """
    _require_ray()
    import ray

    if ray_address is None:
        ro = ray_options or RayServeOptions()
        need = ro.replicas * ro.num_cpus_per_replica
        have = os.cpu_count() or 1
        if not ro.autoscaling and need > have:
            raise InvalidArgument(
                f"{ro.replicas} replicas x {ro.num_cpus_per_replica} CPUs need {need:g} CPUs; "
                f"this machine has {have} (use --num-cpus-per-replica, or --ray-address for a "
                "cluster)")
        kw = {"_node_ip_address": "127.0.0.1"} if _is_loopback(host) else {}
        ray.init(address="local", include_dashboard=False, log_to_driver=False, **kw)
        return True
    if ray_address != "auto" and not ray_address.startswith("ray://"):
        h, sep, p = ray_address.rpartition(":")
        if not sep or not p.isdigit() or not h:
            raise RayUnavailable(f"--ray-address: expected HOST:PORT (e.g. 10.0.0.1:6379), "
                                 f"'auto' or ray://HOST:PORT, got {ray_address!r}")
        try:
            with socket.create_connection((h.strip("[]"), int(p)), timeout=CONNECT_SECONDS):
                pass
        except OSError as exc:
            raise RayUnavailable(
                f"--ray-address {ray_address}: unreachable ({exc.strerror or exc}); start the "
                f"head with 'ray start --head --port {p}' or check the address") from None
    try:
        ray.init(address=ray_address, log_to_driver=False)
    except (ConnectionError, TimeoutError, RuntimeError) as exc:
        # RuntimeError: e.g. the cluster wants an authentication token this machine lacks
        raise RayUnavailable(
            f"--ray-address {ray_address}: cannot join the Ray cluster: {str(exc)[:300]} (a "
            "cluster with token authentication, Ray's default, needs RAY_AUTH_MODE=token and its "
            "token in ~/.ray/auth_token or RAY_AUTH_TOKEN here: docs/serving.md)") from None
    return False


def serve_on_ray(model_path, *, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None, load: dict | None = None,
                 options: ServeOptions | None = None,
                 ray_options: RayServeOptions | None = None, log_level: str = "info") -> int:
    """Deploy the model on Ray Serve behind its HTTP proxy on ``host:port`` and wait for
    SIGINT / SIGTERM; then delete the application (and stop Ray when it was started here).

    Parameters
    ----------
    model_path : path
    host, port : the HTTP proxy's address (127.0.0.1 unless told otherwise)
    ray_address : str or None
        :func:`connect`'s.
    load, options, ray_options
        :func:`deployment`'s.
    log_level : str
        The Serve application's log level (``debug`` ... ``critical``).

    Returns
    -------
    int
        0 after a signal; 1 when the deployment failed (the replicas could not start).

    Raises
    ------
    RayUnavailable, InvalidArgument
        :func:`connect`'s and :func:`deployment`'s.
    ProxyUnavailable
        The HTTP proxy cannot listen on ``host:port``.
    """
    app = deployment(model_path, load=load, options=options, ray_options=ray_options)
    started = connect(ray_address, host=host, ray_options=ray_options)
    import ray
    from ray import serve

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM,
                                                                      signal.SIGINT)}
    status = 0
    try:
        try:
            serve.start(http_options={"host": host, "port": port})
        except RuntimeError as exc:  # ray.exceptions.RayTaskError(RuntimeError) of the proxy
            cause = str(exc).strip().splitlines()[-1][:300]
            raise ProxyUnavailable(f"Ray Serve's HTTP proxy cannot start on {host}:{port} "
                                   f"({cause}); is the port in use?") from None
        try:
            serve.run(app, name=APP_NAME, route_prefix="/",
                      logging_config={"log_level": log_level.upper()})
        except RuntimeError as exc:
            log.error("olv serve: the deployment failed: %s", exc)
            status = 1
        else:
            log.warning("olv serve: %s is serving on http://%s:%d", APP_NAME, host, port)
            while not stop.wait(0.5):
                pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        try:
            if started:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            if started:
                ray.shutdown()
    return status
