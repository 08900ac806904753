"""The continuous-batching engine (:class:`Engine`): many requests over one session and one KV
block pool, a step at a time; knows nothing of HTTP (the server is built on it)."""
from __future__ import annotations

from olv_runtime.engine.engine import Engine, EngineStats
from olv_runtime.engine.request import FINISH_REASONS, RequestOutput, RequestResult

__all__ = ["FINISH_REASONS", "Engine", "EngineStats", "RequestOutput", "RequestResult"]
