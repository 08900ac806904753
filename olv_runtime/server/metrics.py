"""``GET /metrics``: Prometheus text exposition (prometheus_client), one registry per server.

Request-side figures are observed by the server as responses progress (time to first token,
inter-token latency, end-to-end latency, prompt / generated tokens per request, finish reasons);
engine-side figures are read from :meth:`olv_runtime.engine.Engine.stats` at each scrape
(requests running / waiting, KV blocks used / total, prefix-cache hit tokens, steps and rows: the
mean batch size is ``rate(olv_engine_rows_total) / rate(olv_engine_steps_total)``, and
``olv_engine_batch_rows_max`` the largest step).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine's counters at scrape time (``engine_fn() -> Engine or None``)."""

    def __init__(self, engine_fn):
        self.engine_fn = engine_fn

    def collect(self):
        eng = self.engine_fn()
        if eng is None:
            return
        s = eng.stats()
        for name, doc, v in (
                ("olv_requests_running", "requests in the running set", s.running),
                ("olv_requests_waiting", "requests waiting for admission", s.waiting),
                ("olv_kv_blocks_used", "KV blocks in use", s.blocks_used),
                ("olv_kv_blocks_total", "KV blocks in the pool", s.blocks_total),
                ("olv_engine_batch_rows_max", "most rows run in one step", s.max_rows_in_step)):
            yield GaugeMetricFamily(name, doc, value=v)
        for name, doc, v in (
                ("olv_prefix_cache_hit_tokens", "prompt tokens taken from the prefix cache",
                 s.prefix_hit_tokens),
                ("olv_engine_steps", "engine steps (one forward each)", s.steps),
                ("olv_engine_rows", "rows run over all steps (prompt and decode)", s.rows),
                ("olv_engine_prompt_rows", "prompt tokens computed (recomputation included)",
                 s.prompt_rows),
                ("olv_engine_preemptions", "requests preempted for KV blocks", s.preemptions)):
            yield CounterMetricFamily(name, doc, value=v)


class Metrics:
    """The server's metrics.

    Parameters
    ----------
    engine_fn : callable
        Returns the engine (or None while loading).
    """

    def __init__(self, engine_fn):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("olv_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("olv_inter_token_latency_seconds", "time between tokens",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("olv_e2e_request_latency_seconds", "request latency, arrival to "
                             "last token", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("olv_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generated_tokens = Counter("olv_generation_tokens",
                                        "generated tokens of finished requests", registry=r)
        self.requests = Counter("olv_requests", "finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.mask = Histogram("olv_grammar_mask_seconds", "structured output: mean time to "
                              "compute and apply the token mask, per token of a request",
                              buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                                       5e-3, 1e-2, 2.5e-2), registry=r)
        self.http_errors = Counter("olv_http_errors", "error responses by status", ["status"],
                                   registry=r)
        r.register(_EngineCollector(engine_fn))

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
