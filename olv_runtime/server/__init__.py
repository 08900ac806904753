"""The OpenAI-compatible HTTP server on the batching engine (``olv serve``): Starlette + uvicorn,
server-sent events, Prometheus metrics, structured output. Knows nothing of kernels: it talks to
:class:`olv_runtime.Engine` only. Needs the ``serve`` extra (``pip install 'olv_runtime[serve]'``);
``import olv_runtime`` never imports it."""
from __future__ import annotations

from olv_runtime.server.app import Served, ServeOptions, create_app
from olv_runtime.server.run import load_served, serve

__all__ = ["ServeOptions", "Served", "create_app", "load_served", "serve"]
