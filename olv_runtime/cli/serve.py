"""``olv serve``: an OpenAI-compatible HTTP server on the batching engine (``olv serve --help``;
README "Serving"). Needs the ``serve`` extra: ``pip install 'olv_runtime[serve]'``."""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

from olv_runtime.cli.common import CliError, _non_negative, _positive, _session_options
from olv_runtime.lazy import lazy_module

# starlette, uvicorn and prometheus_client only for this command (an optional extra)
server = lazy_module("olv_runtime.server")
# --replicas: Ray Serve (the ray extra; ray itself is imported by that module's functions)
ray_serve = lazy_module("olv_runtime.server.ray_serve")

SERVE_PACKAGES = ("starlette", "uvicorn", "prometheus_client", "anyio")


def _port(text: str) -> int:
    v = _positive(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {v}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= v <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 86400], got {text}")
    return v


def _cpus(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of CPUs, got {text!r}") from None
    if not 0 < v <= 4096:
        raise argparse.ArgumentTypeError(f"expected CPUs in (0, 4096], got {text}")
    return v


RAY_ONLY = ("ray_address", "num_cpus_per_replica", "max_ongoing_requests", "min_replicas",
            "max_replicas")


def _serve_replicas(args, path, options) -> int:
    """``--replicas N``: the deployment on Ray Serve (olv_runtime.server.ray_serve); its
    RayUnavailable / InvalidArgument reach main() as usage errors."""
    ray_options = ray_serve.RayServeOptions(
        replicas=args.replicas, num_cpus_per_replica=args.num_cpus_per_replica or 1.0,
        max_ongoing_requests=args.max_ongoing_requests, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas)
    load = {"model_name": args.served_model_name, "max_batch": args.max_batch,
            "kv_cache_tokens": args.kv_cache_tokens, "kv_dtype": args.kv_dtype,
            "max_tokens_per_step": args.max_tokens_per_step,
            "session_options": {"num_threads": args.threads,
                                "quantize_activations": args.quantize_activations}}
    print(f"olv serve: {args.replicas} replicas on Ray Serve, http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    return ray_serve.serve_on_ray(str(path.resolve()), host=args.host, port=args.port,
                                  ray_address=args.ray_address, load=load, options=options,
                                  ray_options=ray_options, log_level=args.log_level)


def cmd_serve(args) -> int:
    if args.replicas is None:
        given = [f"--{k.replace('_', '-')}" for k in RAY_ONLY if getattr(args, k) is not None]
        if given:
            raise CliError(f"{', '.join(given)} need --replicas N (the Ray Serve mode)")
    missing = [p for p in SERVE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise CliError(f"olv serve needs {', '.join(missing)}: pip install "
                       "'olv_runtime[serve]'")
    path = pathlib.Path(args.model)
    if not path.exists():
        raise CliError(f"{args.model}: no such model file")
    opts = _session_options(args)
    options = server.ServeOptions(api_key=args.api_key, max_waiting=args.max_waiting,
                                  max_body_bytes=args.max_body_bytes,
                                  shutdown_timeout=args.shutdown_timeout)
    if args.replicas is not None:
        return _serve_replicas(args, path, options)

    def loader():
        return server.load_served(path, model_name=args.served_model_name,
                                  max_batch=args.max_batch,
                                  kv_cache_tokens=args.kv_cache_tokens, kv_dtype=args.kv_dtype,
                                  session_options=opts,
                                  max_tokens_per_step=args.max_tokens_per_step)

    print(f"olv serve: http://{args.host}:{args.port} (GET /health answers 200 once {path.name} "
          f"is loaded)", file=sys.stderr, flush=True)
    return server.serve(loader, host=args.host, port=args.port, options=options,
                        log_level=args.log_level)


def add_serve_parser(sub, add_run_opts) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, "
                                     "streaming, structured output, /metrics)",
                       description=__doc__.split("\n\n")[0])
    s.add_argument("model", help="converted .onnx model (tokenizer.json and the chat template "
                                 "beside it are used)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="port (default: 8000)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: the file name)")
    s.add_argument("--max-batch", type=_positive, default=16,
                   help="requests decoded together at most (default: 16)")
    s.add_argument("--kv-cache-tokens", type=_positive, default=None, metavar="T",
                   help="KV pool size in tokens over all requests (default: max-batch x "
                        "min(context, 2048))")
    s.add_argument("--kv-dtype", choices=["float32", "float16", "int8"], default="float32",
                   help="KV pool storage (default: float32)")
    s.add_argument("--max-tokens-per-step", type=_positive, default=512,
                   help="rows per engine step: the chunked-prefill budget (default: 512)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise)")
    s.add_argument("--max-waiting", type=_non_negative, default=64,
                   help="requests waiting for admission at most; more get 429 (default: 64)")
    s.add_argument("--max-body-bytes", type=_positive, default=4 * 1024 * 1024,
                   help="larger request bodies get 413 (default: 4 MiB)")
    s.add_argument("--shutdown-timeout", type=_seconds, default=10.0, metavar="S",
                   help="on SIGTERM / Ctrl-C, in-flight requests may finish for S seconds, "
                        "then are cancelled (default: 10)")
    s.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                   default="info", help="uvicorn's log level; with --replicas, the Serve "
                        "application's (default: info)")
    r = s.add_argument_group("scale-out on Ray Serve (the ray extra: pip install "
                             "'olv_runtime[serve,ray]'; docs/serving.md)")
    r.add_argument("--replicas", type=_positive, default=None, metavar="N",
                   help="serve N engine replicas behind Ray Serve's HTTP proxy on --host:--port "
                        "(default: one process, no Ray)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="HOST:PORT of a running Ray cluster's head, or 'auto' (default: start a "
                        "local Ray)")
    r.add_argument("--num-cpus-per-replica", type=_cpus, default=None, metavar="C",
                   help="CPUs Ray reserves per replica; the engine's default --threads "
                        "(default: 1)")
    r.add_argument("--max-ongoing-requests", type=_positive, default=None, metavar="K",
                   help="requests one replica is handed at a time; more wait in Serve's queue "
                        "(default: --max-batch)")
    r.add_argument("--min-replicas", type=_non_negative, default=None, metavar="N",
                   help="autoscaling: replicas at least (default with --max-replicas: 1)")
    r.add_argument("--max-replicas", type=_positive, default=None, metavar="N",
                   help="autoscaling: replicas at most (default with --min-replicas: "
                        "--replicas)")
    add_run_opts(s)
    s.set_defaults(func=cmd_serve)
