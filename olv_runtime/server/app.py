"""The OpenAI-compatible HTTP application (Starlette) over one :class:`~olv_runtime.Engine`.

Routes: ``GET /health`` (503 while the model loads or the server drains, then 200),
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
server-sent events ``data: {...}\\n\\n`` ending with ``data: [DONE]``, or whole), ``GET /metrics``.
Every error is an OpenAI error object with its status (:mod:`olv_runtime.server.protocol`).

One engine serves every request: its loop runs in its own thread (:meth:`Engine.start`); each
request is one engine request whose outputs reach the handler through an asyncio queue
(:meth:`Engine.astream`). A client that disconnects cancels its request (:meth:`Engine.cancel`:
its blocks are free at the next step); a reaper forgets abandoned requests once they end.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from olv_runtime.errors import ContextLengthError, InvalidArgument
from olv_runtime.generation.chat import ChatTemplateError, apply_chat_template
from olv_runtime.generation.settings import GenerationConfig
from olv_runtime.server.metrics import CONTENT_TYPE, Metrics
from olv_runtime.server.protocol import (
    ApiError,
    ParsedRequest,
    chunk,
    error_body,
    full_response,
    new_id,
    openai_finish_reason,
    parse_chat,
    parse_completion,
    usage,
)

__all__ = ["ServeOptions", "Served", "create_app"]

log = logging.getLogger("olv_runtime.server")

#: completions without max_tokens generate this many tokens (OpenAI's default)
COMPLETION_DEFAULT_TOKENS = 16


@dataclasses.dataclass
class ServeOptions:
    """Settings of the HTTP layer.

    Attributes
    ----------
    api_key : str or None
        When set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
    max_waiting : int
        Requests waiting for admission at most; one more gets 429 with ``Retry-After``.
    max_body_bytes : int
        Larger request bodies get 413.
    shutdown_timeout : float
        Seconds in-flight requests may take to finish once shutdown starts (then cancelled).
    """

    api_key: str | None = None
    max_waiting: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 10.0


@dataclasses.dataclass
class Served:
    """What the server serves (made by the loader, :func:`olv_runtime.server.load_served`).

    Attributes
    ----------
    engine : Engine
        Made with the tokenizer (text outputs and stop strings).
    model_name : str
        The name ``/v1/models`` lists and requests must use (or omit).
    tokenizer : tokenizers.Tokenizer or None
        Without one, completions take token ids only and chat is refused.
    chat_template : str or None
    special_tokens : dict
        Template variables (``bos_token``, ``eos_token``, ...).
    grammar : GrammarCompiler or None
        Structured output (llguidance); None refuses ``response_format`` JSON.
    """

    engine: object
    model_name: str
    tokenizer: object = None
    chat_template: str | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)
    grammar: object = None


class ServerState:
    """The application's state: the loaded model (None while loading), draining, the reaper."""

    def __init__(self, loader: Callable[[], Served], options: ServeOptions,
                 on_load_error: Callable[[BaseException], object] | None = None):
        self.loader = loader
        self.options = options
        self.on_load_error = on_load_error
        self.served: Served | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.abandoned: set[int] = set()
        self.metrics = Metrics(lambda: self.served.engine if self.served else None)
        self.loaded = threading.Event()

    def load(self) -> None:
        try:
            served = self.loader()
            served.engine.start()
            self.served = served
            log.info("olv serve: model %s loaded", served.model_name)
        except BaseException as exc:
            log.exception("olv serve: loading failed")
            self.load_error = exc
            if self.on_load_error is not None:
                self.on_load_error(exc)
        finally:
            self.loaded.set()

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on; in-flight ones go on, and those still running
        after 80 % of ``shutdown_timeout`` are cancelled: they end properly (a finish reason
        "length", ``[DONE]``) before the server stops waiting for them."""
        if self.draining:
            return
        self.draining = True
        timer = threading.Timer(0.8 * self.options.shutdown_timeout, self.cancel_all)
        timer.daemon = True
        timer.start()

    def cancel_all(self) -> None:
        """Cancel every request of the engine (shutdown)."""
        if self.served is not None:
            eng = self.served.engine
            for rid in list(eng.requests):
                eng.cancel(rid)

    def reap(self) -> None:
        """Forget abandoned (cancelled) requests that have ended."""
        if self.served is None:
            return
        eng = self.served.engine
        for rid in list(self.abandoned):
            req = eng.requests.get(rid)
            if req is None:
                self.abandoned.discard(rid)
            elif req.finished:
                with contextlib.suppress(InvalidArgument):
                    eng.result(rid)
                self.abandoned.discard(rid)

    def abandon(self, rid: int, timing=None) -> None:
        """Cancel a request nobody reads any more (client gone, handler cancelled)."""
        eng = self.served.engine
        eng.cancel(rid)
        self.abandoned.add(rid)
        if timing is not None:
            timing.end("cancelled")


def _error(exc: ApiError, metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.http_errors.labels(str(exc.status)).inc()
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code),
                        status_code=exc.status, headers=exc.headers)


def _gate(st: ServerState, request: Request, v1: bool = True) -> Served:
    """Shutdown, loading and the API key, in that order."""
    if st.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable",
                       code="shutting_down")
    if v1 and st.options.api_key is not None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), st.options.api_key.encode()):
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer <key>)",
                           "authentication_error", code="invalid_api_key")
    if st.served is None:
        if st.load_error is not None:
            raise ApiError(500, f"the model failed to load: {st.load_error}", "server_error",
                           code="load_failed")
        raise ApiError(503, "the model is loading", "service_unavailable", code="loading",
                       headers={"Retry-After": "1"})
    return st.served


async def _json_body(request: Request, limit: int):
    cl = request.headers.get("content-length", "")
    if cl.isdigit() and int(cl) > limit:
        raise ApiError(413, f"the request body has {cl} bytes; at most {limit} are accepted",
                       code="body_too_large")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
    try:
        text = bytes(buf).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 (byte {exc.start})",
                       code="invalid_json") from None

    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}",
                       code="invalid_json") from None


def _prompt_ids(served: Served, req: ParsedRequest) -> list:
    tok = served.tokenizer
    if req.kind == "chat":
        if tok is None or served.chat_template is None:
            raise ApiError(400, "this model has no chat template and tokenizer: use "
                                "/v1/completions", param="messages", code="no_chat_template")
        try:
            text = apply_chat_template(req.messages, served.chat_template,
                                       add_generation_prompt=True,
                                       special_tokens=served.special_tokens)
        except (ChatTemplateError, InvalidArgument) as exc:
            raise ApiError(400, f"messages: the chat template failed: {exc}", param="messages",
                           code="chat_template_error") from None
        ids = tok.encode(text, add_special_tokens=False).ids
    elif req.prompt_ids is not None:
        return req.prompt_ids
    else:
        if tok is None:
            raise ApiError(400, "prompt: this model has no tokenizer.json; send token ids",
                           param="prompt", code="no_tokenizer")
        ids = tok.encode(req.prompt_text).ids
    if not ids:
        raise ApiError(400, "the prompt encodes to zero tokens", param=
                       "messages" if req.kind == "chat" else "prompt", code="empty_prompt")
    return ids


def _config(served: Served, req: ParsedRequest, n_prompt: int) -> GenerationConfig:
    eng = served.engine
    max_tokens = req.max_tokens
    if max_tokens is None:
        if req.kind == "completion":
            max_tokens = COMPLETION_DEFAULT_TOKENS
        else:  # the rest of the context (and of the KV pool)
            room = [c - n_prompt for c in (eng.context,) if c is not None]
            if eng.batched:
                room.append(eng.blocks.n_blocks * eng.block_size - n_prompt)
            max_tokens = max(1, min(room)) if room else 256
    cfg = dict(req.config, max_new_tokens=max_tokens)
    if req.logprobs is not None:
        cfg.update(logprobs=True, top_logprobs=req.logprobs)
    if cfg["stop"] and served.tokenizer is None:
        raise ApiError(400, "stop: stop strings need the model's tokenizer", param="stop")
    try:
        return GenerationConfig(**cfg)
    except InvalidArgument as exc:
        raise ApiError(400, str(exc)) from None


class _Timing:
    """One request's latencies into the metrics."""

    def __init__(self, metrics: Metrics, n_prompt: int, grammar=None):
        self.m, self.n_prompt, self.grammar = metrics, n_prompt, grammar
        self.t0 = self.last = time.perf_counter()
        self.first = True
        self.n = 0
        self.ended = False

    def output(self, out) -> None:
        if not out.token_ids:
            return
        now = time.perf_counter()
        (self.m.ttft if self.first else self.m.itl).observe(now - self.last)
        self.first, self.last = False, now
        self.n += len(out.token_ids)

    def end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.m.e2e.observe(time.perf_counter() - self.t0)
        self.m.prompt_tokens.inc(self.n_prompt)
        self.m.generated_tokens.inc(self.n)
        self.m.requests.labels(reason).inc()
        g = self.grammar
        if g is not None and g.masks:
            self.m.mask.observe(g.mask_seconds / g.masks)


class _EventStream(StreamingResponse):
    """Server-sent events that watch for the client's disconnect whatever the ASGI version, and
    call ``on_close()`` however they end."""

    def __init__(self, content, on_close: Callable[[], object]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def wrap(func):
                    await func()
                    tg.cancel_scope.cancel()

                tg.start_soon(wrap, functools.partial(self.stream_response, send))
                await wrap(functools.partial(self.listen_for_disconnect, receive))
        except OSError:  # the client went away mid-send
            pass
        finally:
            self.on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(st: ServerState, req: ParsedRequest, rid: int, cid: str, timing: _Timing):
    served = st.served
    eng, tok, model = served.engine, served.tokenizer, served.model_name
    created = int(time.time())
    if req.kind == "chat":
        yield _sse(chunk(req, cid, model, created, None, role=True))
    offset = 0
    async for out in eng.astream(rid):
        timing.output(out)
        text = out.text or ""
        if text or (out.logprobs and req.logprobs is not None):
            yield _sse(chunk(req, cid, model, created, text, lps=out.logprobs, tokenizer=tok,
                             offset=offset))
            offset += len(text)
        if not out.finished:
            continue
        res = eng.result(rid)
        timing.end(res.finish_reason)
        if res.finish_reason == "error":
            yield _sse(error_body(f"generation failed: {res.error}", "server_error",
                                  code="generation_error"))
            return
        yield _sse(chunk(req, cid, model, created, None if req.kind == "chat" else "",
                         finish=openai_finish_reason(res.finish_reason)))
        if req.include_usage:
            yield _sse({"id": cid, "object": "chat.completion.chunk" if req.kind == "chat"
                        else "text_completion", "created": created, "model": model,
                        "choices": [], "usage": usage(res.prompt_tokens, int(res.ids.size),
                                                      res.cached_tokens)})
        yield "data: [DONE]\n\n"
        return


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _whole(st: ServerState, request: Request, req: ParsedRequest, rid: int, cid: str,
                 timing: _Timing) -> Response:
    eng = st.served.engine

    async def collect():
        async for out in eng.astream(rid):
            timing.output(out)

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client left (or this handler was cancelled)
            work.cancel()
            st.abandon(rid, timing)
    if not work.done() or work.cancelled():
        return Response(status_code=499)
    work.result()
    res = eng.result(rid)
    timing.end(res.finish_reason)
    if res.finish_reason == "error":
        raise ApiError(500, f"generation failed: {res.error}", "server_error",
                       code="generation_error")
    return JSONResponse(full_response(req, cid, st.served.model_name, res, res.text or "",
                                      st.served.tokenizer))


async def _generate(st: ServerState, request: Request, kind: str) -> Response:
    served = _gate(st, request)
    body = await _json_body(request, st.options.max_body_bytes)
    req = parse_chat(body) if kind == "chat" else parse_completion(body)
    if req.model is not None and req.model != served.model_name:
        raise ApiError(404, f"the model {req.model[:200]!r} does not exist (this server has "
                            f"{served.model_name!r})", "not_found_error", param="model",
                       code="model_not_found")
    ids = await run_in_threadpool(_prompt_ids, served, req)
    cfg = _config(served, req, len(ids))
    proc = None
    if req.structured:
        if served.grammar is None:
            raise ApiError(400, "response_format: structured output needs llguidance and the "
                                "model's tokenizer", param="response_format",
                           code="unsupported_parameter")
        try:
            proc = await run_in_threadpool(served.grammar.processor, req.json_schema)
        except InvalidArgument as exc:
            raise ApiError(400, f"response_format: {exc}", param="response_format") from None
    eng = served.engine
    if eng.stats().waiting >= st.options.max_waiting:
        raise ApiError(429, f"{st.options.max_waiting} requests are already waiting; retry "
                            "later", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"})
    param = "messages" if kind == "chat" else "prompt"
    try:
        rid = eng.add_request(ids, cfg, logits_processor=proc)
    except ContextLengthError as exc:
        raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
    except InvalidArgument as exc:
        raise ApiError(400, str(exc), param=param) from None
    timing = _Timing(st.metrics, len(ids), proc)
    cid = new_id(kind)
    if req.stream:
        def on_close():
            req_ = eng.requests.get(rid)
            if req_ is not None:
                if req_.finished:
                    with contextlib.suppress(InvalidArgument):
                        eng.result(rid)
                else:
                    st.abandon(rid, timing)
        return _EventStream(_events(st, req, rid, cid, timing), on_close)
    try:
        return await _whole(st, request, req, rid, cid, timing)
    except BaseException:
        if rid in eng.requests and not eng.requests[rid].finished:
            st.abandon(rid, timing)
        raise


def create_app(loader: Callable[[], Served], options: ServeOptions | None = None, *,
               on_load_error: Callable[[BaseException], object] | None = None) -> Starlette:
    """The application. ``loader()`` runs in a thread at startup (``/health`` answers 503 until
    it returns); its engine's loop is started, and stopped at shutdown.

    Parameters
    ----------
    loader : callable
        Returns a :class:`Served`.
    options : ServeOptions, optional
    on_load_error : callable, optional
        Called with the exception when ``loader`` fails (the runner stops the server).

    Returns
    -------
    starlette.applications.Starlette
        ``app.state.olv`` is the :class:`ServerState` (``begin_drain()`` for a graceful stop).
    """
    st = ServerState(loader, options or ServeOptions(), on_load_error)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=st.load, name="olv-load", daemon=True).start()
        stop = asyncio.Event()

        async def reaper():
            while not stop.is_set():
                st.reap()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        task = asyncio.ensure_future(reaper())
        try:
            yield
        finally:
            st.draining = True
            stop.set()
            await task
            await run_in_threadpool(st.loaded.wait, 60)
            if st.served is not None:
                st.served.engine.shutdown(st.options.shutdown_timeout)

    def route(fn):
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except ApiError as exc:
                return _error(exc, st.metrics)
        return endpoint

    async def health(request):
        _gate(st, request, v1=False)
        return JSONResponse({"status": "ok"})

    async def models(request):
        served = _gate(st, request)
        return JSONResponse({"object": "list", "data": [
            {"id": served.model_name, "object": "model", "created": 0, "owned_by": "olv"}]})

    async def metrics(request):
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    async def completions(request):
        return await _generate(st, request, "completion")

    async def chat(request):
        return await _generate(st, request, "chat")

    async def http_error(request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code,
                                                                        "invalid_request_error")
        msg = (f"no route {request.method} {request.url.path[:200]}" if exc.status_code in
               (404, 405) else str(exc.detail))
        return _error(ApiError(exc.status_code, msg, kind, code="not_found" if
                               exc.status_code == 404 else None), st.metrics)

    async def server_error(request, exc: Exception):
        log.exception("olv serve: unhandled error")
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"),
                      st.metrics)

    routes = [Route("/health", route(health), methods=["GET"]),
              Route("/v1/models", route(models), methods=["GET"]),
              Route("/metrics", route(metrics), methods=["GET"]),
              Route("/v1/completions", route(completions), methods=["POST"]),
              Route("/v1/chat/completions", route(chat), methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.olv = st
    return app
