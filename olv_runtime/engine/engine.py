"""The continuous-batching engine: many sequences, one session, one KV block pool.

``Engine(model)`` owns one :class:`~olv_runtime.InferenceSession`, one
:class:`~olv_runtime.kv.block_pool.KVBlockPool` allocated once at its full size, and a scheduler
(a waiting queue and a running set of at most ``max_batch`` requests). Each :meth:`Engine.step`
runs **one forward for all running requests** (:meth:`InferenceSession.rows_program`): one row
per decoding request plus chunks of prompts, within ``max_tokens_per_step`` rows, so a long prompt
never stalls the others (chunked prefill). Every linear is one GEMM over the step's rows; each
row attends over its own blocks. Where the plan has one fused decoder stack (olv's INT4 Qwen2 /
Llama models, Q4_0 GGUF conversions) the whole step is one compiled call
(:mod:`olv_runtime.kernels.rows_layers`: one parallel region, barriers between the operators, as
``generate``'s one-token step); other plans run the per-operator rows program.

Batch invariance: a row's result depends only on its own sequence (the kernels compute rows
independently; attention reads the row's own blocks; positions come from a per-position table),
so a request's tokens and logprobs are bitwise the same whatever else runs, whenever it joined,
however its prompt was chunked, whether its prefix came from the cache and after a preemption.
Greedy tokens are :func:`olv_runtime.generate`'s (logits within float rounding, <= 1e-5
relative; with the per-operator rows program the prompt's logits are bitwise the prefill's).

Memory is bounded: a request that cannot get blocks waits; when the pool runs out while requests
decode, the newest running request is preempted (its blocks released, its tokens recomputed when
it is admitted again -- from the prefix cache where its full blocks are still there).

A model whose plan the rows program does not cover (an onnxruntime-genai folder, a paged-KV
conversion) runs its requests one by one inside the step, each with its own
:class:`~olv_runtime.State` (:func:`~olv_runtime.generation.generate.prefill` /
:func:`~olv_runtime.generation.generate.decode_step`), with the same results as ``generate``;
the engine says so once (a log warning and :attr:`Engine.fallback_reason`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import collections.abc
import dataclasses
import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from olv_runtime.engine.blocks import BlockManager
from olv_runtime.engine.request import (
    Request,
    RequestOutput,
    RequestResult,
    new_async_queue,
)
from olv_runtime.errors import ContextLengthError, InvalidArgument, StateError
from olv_runtime.executor.session import InferenceSession, SessionOptions
from olv_runtime.generation.generate import (
    _as_ids,
    _check_eos_range,
    _check_ids,
    context_limit_of,
    decode_step,
    eos_token_ids,
    prefill,
)
from olv_runtime.generation.sampling import check_finite, select_token, token_logprob
from olv_runtime.generation.settings import GenerationConfig
from olv_runtime.io import load
from olv_runtime.kv.block_pool import KV_DTYPES, KVBlockPool
from olv_runtime.state import empty_cache, make_state

__all__ = ["Engine", "EngineStats"]

log = logging.getLogger("olv_runtime.engine")

#: Seconds an async stream waits for an output before it checks the background loop still runs.
_ASTREAM_POLL = 0.5


@dataclasses.dataclass
class EngineStats:
    """Counters of an engine since it was made (read with :meth:`Engine.stats`)."""

    steps: int = 0
    rows: int = 0                 # rows run (prompt and decode)
    prompt_rows: int = 0          # prompt tokens computed (recomputation after preemption included)
    decode_rows: int = 0          # decode tokens computed
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0    # prompt tokens taken from the prefix cache
    preemptions: int = 0
    finished: int = 0
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    max_rows_in_step: int = 0


def _session(model, session_options) -> InferenceSession:
    if isinstance(model, InferenceSession):
        return model
    if model is None:
        raise InvalidArgument("Engine needs a model (a path, a Model or an InferenceSession)")
    return InferenceSession(load(model) if not hasattr(model, "graph") else model,
                            session_options)


def _request_id(request_id) -> int:
    """A request id as given to cancel/result/stream: an int (not a bool); InvalidArgument
    otherwise (a float or a bool never stands for a request)."""
    if isinstance(request_id, (bool, np.bool_)) or not isinstance(request_id, (int, np.integer)):
        raise InvalidArgument(f"request_id must be an integer (an id from add_request), got "
                              f"{request_id!r}")
    return int(request_id)


def _positive(name, v, allow_none=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InvalidArgument(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


class Engine:
    """Continuous batching over one session and one KV block pool (see the module docstring).

    Parameters
    ----------
    model : path, Model or InferenceSession
        A converted causal LM, as :func:`olv_runtime.generate` takes.
    max_batch : int
        Running requests at most (each contributes one row per decode step).
    kv_cache_tokens : int, optional
        Tokens the pool holds over all requests (rounded up to whole blocks). Default:
        ``max_batch`` x min(context, 2048).
    block_size : int
        Tokens per block (and the prefix cache's granularity); a multiple of 64 keeps the
        attention tiles of the contiguous kernel (prefill logits bitwise ``generate``'s).
    kv_dtype : str
        Pool storage: "float32", "float16", "int8" or "int4" (int8/int4: a scale per token and
        kv head).
    session_options : SessionOptions, optional
        For the session made from ``model`` (``quantize_activations=True``: int8 mode).
    max_tokens_per_step : int
        Rows per step (decode rows first, then prompt chunks): the chunked-prefill budget.
    tokenizer : tokenizers.Tokenizer, optional
        Enables text outputs and stop strings.
    prefix_caching : bool
        Share full blocks of equal prefixes between requests.

    Raises
    ------
    InvalidArgument
        A setting out of range; a pool that cannot hold one block, or more than the machine's
        memory; a tokenizer without ``decode``.
    """

    def __init__(self, model, *, max_batch: int = 16, kv_cache_tokens: int | None = None,
                 block_size: int = 64, kv_dtype: str = "float32",
                 session_options: SessionOptions | None = None, max_tokens_per_step: int = 512,
                 tokenizer=None, prefix_caching: bool = True):
        self.max_batch = _positive("max_batch", max_batch)
        self.block_size = _positive("block_size", block_size)
        self.max_tokens_per_step = _positive("max_tokens_per_step", max_tokens_per_step)
        kv_cache_tokens = _positive("kv_cache_tokens", kv_cache_tokens, allow_none=True)
        if kv_dtype not in KV_DTYPES:
            raise InvalidArgument(f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise InvalidArgument(
                f"tokenizer must have a decode(ids, skip_special_tokens=...) method "
                f"(tokenizers.Tokenizer), got {type(tokenizer).__name__} {str(tokenizer)[:40]!r}")
        self.session = _session(model, session_options)
        self.tokenizer = tokenizer
        meta = self.session.get_modelmeta()
        self.vocab = int(meta["olv.vocab_size"]) if str(meta.get("olv.vocab_size", "")).isdigit() \
            else None
        self.context = context_limit_of(self.session, "model")
        self.program, self.fallback_reason = self.session.rows_program()
        self.batched = self.program is not None
        # the ids a prompt may hold: the vocabulary, and never beyond the embedding table (a
        # model recording no or a wrong olv.vocab_size must not fail every request of a step)
        rows = self.program.embedding_rows if self.batched else None
        self._id_limit = self.vocab if rows is None else min(rows, self.vocab or rows)
        if kv_cache_tokens is None:
            kv_cache_tokens = self.max_batch * min(self.context or 2048, 2048)
        n_blocks = max(1, -(-kv_cache_tokens // self.block_size))
        self.pool = None
        if self.batched:
            p = self.program
            self.pool = KVBlockPool(p.n_layers, n_blocks, p.n_kv_heads, self.block_size,
                                    p.head_dim, kv_dtype)
        else:
            log.warning("olv engine: this model's plan runs its requests one by one inside each "
                        "step (no batched forward): %s", self.fallback_reason)
        self.blocks = BlockManager(n_blocks, self.block_size, prefix_caching)
        self.kv_dtype = kv_dtype
        self._ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._lock = threading.Lock()          # incoming, cancels, the request registry
        self._step_lock = threading.Lock()     # one step at a time
        self._mask_pool: concurrent.futures.ThreadPoolExecutor | None = None  # _prepare_masks
        self._incoming: collections.deque[Request] = collections.deque()
        self._cancels: set[int] = set()
        self.requests: dict[int, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._stats = EngineStats(blocks_total=n_blocks)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._eos_auto = None
        self._step_thread: int | None = None   # the thread inside step(), while it runs

    # -- settings that may change between steps -------------------------------------------------
    @property
    def max_batch(self) -> int:
        """Running requests at most (settable between steps; an integer >= 1)."""
        return self._max_batch

    @max_batch.setter
    def max_batch(self, value) -> None:
        self._max_batch = _positive("max_batch", value)

    @property
    def max_tokens_per_step(self) -> int:
        """Rows per step (settable between steps; an integer >= 1: 0 would run nothing, for
        ever)."""
        return self._max_tokens_per_step

    @max_tokens_per_step.setter
    def max_tokens_per_step(self, value) -> None:
        self._max_tokens_per_step = _positive("max_tokens_per_step", value)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids, config: GenerationConfig | dict | None = None, *,
                    callback: Callable[[int], object] | None = None,
                    logits_processor: Callable[[list, np.ndarray], object] | None = None) -> int:
        """Queue a request; returns its id. Thread-safe; every argument is checked here and a bad
        one changes nothing.

        Parameters
        ----------
        prompt_ids : sequence of int
            Non-empty, each in ``[0, vocab)``.
        config : GenerationConfig or dict, optional
            The settings of :func:`olv_runtime.generation.generate.generate_result` (a dict is
            passed to ``GenerationConfig(**config)``).
        callback : callable, optional
            ``callback(token_id)`` after each new token; an exception in it ends this request
            alone (finish reason "error").
        logits_processor : callable, optional
            ``logits_processor(token_history, logits_row)`` before each selection:
            ``token_history`` is the request's tokens (prompt then generated, a list of int, not
            to be modified), ``logits_row`` the raw scores ``[vocab]`` float32, changed in place
            (e.g. disallowed ids set to ``-inf``: a grammar's token mask). If the object has an
            ``accept(token_id)`` method it is called with each chosen token. Logprobs stay those
            of the raw logits. An exception in either ends this request alone (finish reason
            "error").

        Raises
        ------
        InvalidArgument
            Empty or out-of-range ids; a config that is not a GenerationConfig/dict or has bad
            fields; eos ids or top_logprobs outside the vocabulary; stop strings without a
            tokenizer; a request needing more KV blocks than the whole pool has.
        ContextLengthError
            Prompt plus ``max_new_tokens`` beyond the model's context (or ``context_limit``).
        """
        req_args = self._checked_request(prompt_ids, config, callback, logits_processor)
        with self._lock:
            rid = next(self._ids)
            req = Request(rid, *req_args, next(self._arrivals), logits_processor)
            self.requests[rid] = req
            self._incoming.append(req)
        self._wake.set()
        return rid

    def _checked_request(self, prompt_ids, config, callback, logits_processor=None) -> tuple:
        """The checks of :meth:`add_request` (nothing changes); the Request's arguments but its
        id and arrival."""
        config = self._config(config)
        ids = _as_ids(prompt_ids)
        _check_ids(ids, self._id_limit, "prompt_ids", allow_empty=False)
        if callback is not None and not callable(callback):
            raise InvalidArgument(f"callback must be callable, got {type(callback).__name__}")
        if logits_processor is not None and not callable(logits_processor):
            raise InvalidArgument(f"logits_processor must be callable, got "
                                  f"{type(logits_processor).__name__}")
        if config.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need the engine's tokenizer (Engine(..., "
                                  "tokenizer=...))")
        if config.eos_token_id == "auto":
            if self._eos_auto is None:
                self._eos_auto = set(eos_token_ids(self.session))
            eos = self._eos_auto
        else:
            eos = _check_eos_range(config.eos_token_id, self.vocab)
        if self.vocab is not None and config.top_logprobs > self.vocab:
            raise InvalidArgument(f"top_logprobs must be at most the vocabulary size "
                                  f"{self.vocab}, got {config.top_logprobs}")
        limit = context_limit_of(self.session, config.context_limit)
        need = int(ids.size) + config.max_new_tokens
        if limit is not None and need > limit:
            raise ContextLengthError(
                f"the prompt of {ids.size} tokens plus max_new_tokens={config.max_new_tokens} "
                f"needs {need} positions, beyond the context of {limit} (shorten the prompt, "
                f"lower max_new_tokens, or pass context_limit)")
        if self.batched:
            blocks = -(-need // self.block_size)
            if blocks > self.blocks.n_blocks:
                raise InvalidArgument(
                    f"the request needs {need} tokens of KV ({blocks} blocks of "
                    f"{self.block_size}), more than the whole pool ({self.blocks.n_blocks} "
                    f"blocks); make the engine with a larger kv_cache_tokens")
        rng = np.random.default_rng(config.seed)
        return ids, config, eos, limit, rng, self.tokenizer, callback

    def _config(self, config) -> GenerationConfig:
        if config is None:
            return GenerationConfig()
        if isinstance(config, dict):
            try:
                return GenerationConfig(**config)
            except TypeError as exc:
                raise InvalidArgument(f"config: {exc}") from None
        if not isinstance(config, GenerationConfig):
            raise InvalidArgument(f"config must be a GenerationConfig, a dict or None, got "
                                  f"{type(config).__name__}")
        return config

    def cancel(self, request_id: int) -> bool:
        """Ask to end a request (finish reason "cancelled"); its blocks are released at the next
        step. Thread-safe. Returns False for an unknown or finished request (InvalidArgument for
        an id that is not an integer)."""
        request_id = _request_id(request_id)
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return False
            req.cancel_asked = True
            self._cancels.add(request_id)
        self._wake.set()
        return True

    def has_unfinished(self) -> bool:
        """Requests waiting or running (or just added)."""
        with self._lock:
            return bool(self._incoming or self.waiting or self.running)

    def stats(self) -> EngineStats:
        """A copy of the counters, with the current queue and pool figures."""
        s = dataclasses.replace(self._stats)
        s.running, s.waiting = len(self.running), len(self.waiting) + len(self._incoming)
        s.blocks_used = self.blocks.used()
        return s

    def result(self, request_id: int) -> RequestResult:
        """The result of a finished request (and forget it).

        Raises
        ------
        InvalidArgument
            Unknown id (or not an integer), or the request has not finished.
        """
        request_id = _request_id(request_id)
        with self._lock:
            req = self.requests.get(request_id)
            if req is None:
                raise InvalidArgument(f"unknown request id {request_id!r}")
            if not req.finished:
                raise InvalidArgument(f"request {request_id} has not finished")
            del self.requests[request_id]
        return req.result()

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, schedule and run one forward for all running requests; returns the outputs of
        this step (new tokens, finished requests), also queued to the requests' streams.

        Raises
        ------
        StateError
            Called from inside a step (a request's callback driving the engine: step, generate
            or a stream would wait for itself for ever).
        """
        self._check_not_in_step("Engine.step")
        with self._step_lock:
            self._step_thread = threading.get_ident()
            outputs: list[tuple[Request, RequestOutput]] = []
            try:
                self._take_incoming(outputs)
                if self.batched:
                    self._step_batched(outputs)
                else:
                    self._step_fallback(outputs)
                self._stats.steps += 1
            finally:  # (an interrupt too: the outputs made so far reach their streams)
                self._step_thread = None
                for req, o in outputs:  # the objects: result() may have forgotten the id
                    req.push(o)
            return [o for _, o in outputs]

    def _check_not_in_step(self, what: str) -> None:
        if self._step_thread == threading.get_ident():
            raise StateError(f"{what} called from inside a step (a request's callback); a "
                             f"callback may add or cancel requests, not drive the engine")

    def _take_incoming(self, outputs) -> None:
        with self._lock:
            while self._incoming:
                self.waiting.append(self._incoming.popleft())
            cancels, self._cancels = self._cancels, set()
        for rid in cancels:
            req = self.requests.get(rid)
            if req is not None and not req.finished:
                self._finish(req, "cancelled", outputs)
        for req in [r for r in self.waiting if r.config.max_new_tokens == 0]:
            self._finish(req, "length", outputs)  # nothing to generate: the prompt is not run

    def _finish(self, req: Request, reason: str, outputs, error=None, out=None) -> None:
        req.finished, req.reason, req.error = True, reason, error
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.release(req.table)
        req.table = []
        if req.state is not None:
            req.state.close()
            req.state = None
        self._stats.finished += 1
        rest = req.stream.flush() if req.stream is not None and reason != "stop" else ""
        if out is None:
            out = RequestOutput(req.id, [], text=rest if req.stream is not None else None)
        elif rest:
            out.text = (out.text or "") + rest
        out.finished, out.finish_reason, out.error = True, reason, error
        outputs.append((req, out))

    def _preempt(self, req: Request) -> None:
        """Release a running request's blocks; it waits (first in line) and recomputes."""
        self.running.remove(req)
        self.blocks.release(req.table)
        req.table = []
        req.computed = 0
        req.preemptions += 1
        self._stats.preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, upto: int) -> int:
        """Give ``req`` blocks for positions ``< upto``; returns the positions covered."""
        bs = self.block_size
        while len(req.table) * bs < upto:
            b = self.blocks.allocate()
            if b is None:
                break
            req.table.append(b)
        return min(upto, len(req.table) * bs)

    def _schedule(self) -> list[tuple[Request, int]]:
        """The rows of this step: ``(request, n)`` -- ``n`` tokens from ``request.computed``."""
        budget = self.max_tokens_per_step
        plan: list[tuple[Request, int]] = []
        # decode rows first (oldest first); out of blocks: preempt the newest running request
        for req in sorted((r for r in self.running if r.pending == 1), key=lambda r: r.arrival):
            if req not in self.running or budget == 0:
                continue
            while self._grow(req, req.computed + 1) < req.computed + 1:
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                plan.append((req, 1))
                budget -= 1
        plan = [(r, n) for r, n in plan if r in self.running]
        # prompt chunks of running requests, then admissions (first come, first served)
        for req in sorted((r for r in self.running if r.pending > 1), key=lambda r: r.arrival):
            if budget == 0:
                break
            n = self._grow(req, req.computed + min(req.pending, budget)) - req.computed
            if n > 0:
                plan.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            req = self.waiting[0]
            hit = self.blocks.match(req.tokens, len(req.tokens) - 1)
            req.table, req.computed = hit, len(hit) * self.block_size
            n = self._grow(req, req.computed + min(req.pending, budget)) - req.computed
            if n <= 0:
                self.blocks.release(req.table)
                req.table, req.computed = [], 0
                break
            self.waiting.popleft()
            if req.first_admission:
                req.cached_tokens = req.computed
                req.first_admission = False
            self._stats.prefix_hit_tokens += req.computed
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        if not plan and self.running:  # every running request is stuck on blocks: free some
            self._preempt(max(self.running, key=lambda r: r.arrival))
        return plan

    def _step_batched(self, outputs) -> None:
        plan = self._schedule()
        if not plan:
            return
        bs = self.block_size
        mb = max(len(req.table) for req, _ in plan)
        tables = np.zeros((len(plan), mb), np.int32)
        # the rows as Python lists, one array each at the end (a decode step's few rows: a
        # dozen numpy calls less per step)
        ids, pos, row_seq, blocks, offsets = [], [], [], [], []
        logit_rows, sampled = [], []
        r = 0
        for s, (req, n) in enumerate(plan):
            c = req.computed
            tab = req.table
            ids += req.tokens[c:c + n]
            span = range(c, c + n)
            pos += span
            row_seq += [s] * n
            blocks += [tab[p // bs] for p in span]  # IndexError, not block 0, if one lacked
            offsets += [p % bs for p in span]
            tables[s, :len(tab)] = tab
            r += n
            if c + n == len(req.tokens):
                logit_rows.append(r - 1)
                sampled.append(req)
        ids, pos, blocks, offsets = (np.array(a, np.int64) for a in (ids, pos, blocks, offsets))
        row_seq = np.array(row_seq, np.int32)
        masks = self._prepare_masks(sampled)  # grammar masks, computed alongside the forward
        try:
            logits = self.program.forward(ids, pos, row_seq, tables, blocks, offsets,
                                          np.asarray(logit_rows, np.int64), self.pool)
        except Exception as exc:  # the step failed as a whole: its requests end with the error
            if masks is not None:
                masks.result()
            log.exception("olv engine: a step failed")
            for req, _ in plan:
                if not req.finished:
                    self._finish(req, "error", outputs, error=exc)
            return
        if masks is not None:
            masks.result()  # (prepare never raises: a failing mask is recomputed by the call)
        st = self._stats
        st.rows += r
        st.max_rows_in_step = max(st.max_rows_in_step, r)
        for req, n in plan:
            old = req.computed
            req.computed += n
            if req.pending == 0 and n == 1 and old >= req.prompt_len:
                st.decode_rows += 1
            else:
                st.prompt_rows += n
            for b in range(old // bs, req.computed // bs):
                self.blocks.register(req.table, b, req.tokens[b * bs:(b + 1) * bs])
        for i, req in enumerate(sampled):
            self._emit(req, logits[i], outputs)

    def _prepare_masks(self, reqs) -> concurrent.futures.Future | None:
        """Start the ``prepare()`` of the logits processors of ``reqs`` that have one (a
        grammar's next-token mask, :class:`~olv_runtime.generation.structured
        .GrammarLogitsProcessor`) on the engine's mask thread, so the masks are computed while
        the forward runs; None when no processor has one. The step waits for it before choosing
        tokens; a processor's state is touched by one thread at a time."""
        procs = [r.logits_processor for r in reqs
                 if callable(getattr(r.logits_processor, "prepare", None))]
        if not procs:
            return None
        if self._mask_pool is None:
            self._mask_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="olv-mask")
        return self._mask_pool.submit(_prepare_all, procs)

    def _emit(self, req: Request, row: np.ndarray, outputs) -> None:
        """Choose the request's next token from ``row``, record it, check its stop conditions."""
        try:
            raw, proc = row, req.logits_processor
            if proc is not None:
                if req.lps is not None:
                    raw = row.copy()  # logprobs are of the raw logits
                proc(req.tokens, row)
            if req.argmax_only:
                tok = int(row.argmax())
                if not math.isfinite(row[tok]):
                    check_finite(row, tok)
            else:
                tok = select_token(row, req.tokens, req.params, req.rng)
            if proc is not None and hasattr(proc, "accept"):
                proc.accept(tok)
            lp = [token_logprob(raw, tok, req.config.top_logprobs)] if req.lps is not None \
                else None
            if lp:
                req.lps.extend(lp)
            req.out.append(tok)
            req.tokens.append(tok)
            self._stats.generated_tokens += 1
            out = RequestOutput(req.id, [tok], logprobs=lp)
            if req.stream is not None:
                out.text = req.stream.push(tok)
            if req.callback is not None:
                req.callback(tok)
        except Exception as exc:  # noqa: BLE001 -- a failing request ends alone
            self._finish(req, "error", outputs, error=exc)
            return
        reason = None
        if req.stream is not None and req.stream.stopped is not None:
            reason = "stop"
        elif tok in req.eos:
            reason = "eos"
        elif len(req.out) >= req.config.max_new_tokens or (
                req.limit is not None and len(req.tokens) >= req.limit):
            reason = "length"
        if reason is None:
            outputs.append((req, out))
        else:
            self._finish(req, reason, outputs, out=out)

    # -- the fallback: requests one by one inside the step --------------------------------------
    def _step_fallback(self, outputs) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.popleft())
        for req in sorted(self.running, key=lambda r: r.arrival):
            try:
                if req.state is None:
                    req.state = make_state(self.session, empty_cache(self.session))
                    logits = prefill(req.state, req.tokens)
                    self._stats.prompt_rows += len(req.tokens)
                else:
                    logits = decode_step(req.state, req.tokens[-1])
                    self._stats.decode_rows += 1
                req.computed = len(req.tokens)
                row = np.array(logits[0, -1])
            except Exception as exc:  # noqa: BLE001 -- this request ends alone
                self._finish(req, "error", outputs, error=exc)
                continue
            self._stats.rows += 1
            self._emit(req, row, outputs)

    # -- driving --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence, configs=None, *, progress=None) -> list[RequestResult]:
        """Run a batch of prompts to the end (vLLM's ``LLM.generate``); results in prompt order.

        ``configs``: one GenerationConfig (or dict) for all, or one per prompt. Every prompt is
        checked before any is queued. ``progress``: optional ``progress(done, total)`` callback.
        """
        self._check_not_in_step("Engine.generate")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, collections.abc.Iterable):
            raise InvalidArgument(f"prompts must be a sequence of prompts (each a sequence of "
                                  f"token ids), got {type(prompts).__name__}")
        if progress is not None and not callable(progress):
            raise InvalidArgument(f"progress must be callable, got {type(progress).__name__}")
        prompts = list(prompts)
        if isinstance(configs, (list, tuple)):
            if len(configs) != len(prompts):
                raise InvalidArgument(f"configs: {len(configs)} for {len(prompts)} prompts")
            cfgs = [self._config(c) for c in configs]
        else:
            cfgs = [self._config(configs)] * len(prompts)
        checked = []
        for i, (p, c) in enumerate(zip(prompts, cfgs)):
            try:
                checked.append(self._checked_request(p, c, None))
            except (InvalidArgument, ContextLengthError) as exc:  # name the prompt
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        with self._lock:  # every prompt checked: all queued at once
            rids = []
            for args in checked:
                rid = next(self._ids)
                req = Request(rid, *args, next(self._arrivals))
                self.requests[rid] = req
                self._incoming.append(req)
                rids.append(rid)
        self._wake.set()
        pending = set(rids)
        while pending:
            if self.running_in_background():
                self._wait_any(pending)
            else:
                self.step()
            done = {rid for rid in pending if self.requests[rid].finished}
            pending -= done
            if progress is not None and done:
                progress(len(rids) - len(pending), len(rids))
        return [self.result(rid) for rid in rids]

    def _wait_any(self, pending) -> None:
        req = self.requests[next(iter(pending))]
        with req.cond:
            if not req.finished:
                req.cond.wait(0.05)

    def _streamed(self, request_id) -> Request:
        """The request a stream reads; InvalidArgument (unknown id) or StateError (its outputs
        were all read already: a second stream would wait for ever)."""
        req = self.requests.get(_request_id(request_id))
        if req is None:
            raise InvalidArgument(f"unknown request id {request_id!r}")
        with req.cond:
            if req.ended and not req.queue:
                raise StateError(f"request {request_id} has finished and its outputs were "
                                 f"already read by a stream; engine.result({request_id}) gives "
                                 f"its result")
        return req

    def stream(self, request_id: int, timeout: float | None = None) -> Iterator[RequestOutput]:
        """The outputs of one request as they come, until it finishes. Without a background
        loop (:meth:`start`), iterating drives :meth:`step` itself.

        Raises
        ------
        InvalidArgument
            Unknown request id; a timeout that is not a number > 0.
        StateError
            The request's outputs were already read to its end (by another stream).
        TimeoutError
            No output for ``timeout`` seconds (with a background loop).
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float, np.integer, np.floating)) or not 0 < timeout < math.inf):
            raise InvalidArgument(f"timeout must be None or a number of seconds > 0, got "
                                  f"{timeout!r}")
        req = self._streamed(request_id)
        while True:
            with req.cond:
                item = req.queue.popleft() if req.queue else None
                if item is None and req.ended:  # another stream took the last output
                    raise StateError(f"request {request_id}: its last output was read by "
                                     f"another stream")
            if item is not None:
                yield item
                if item.finished:
                    return
                continue
            if self.running_in_background():
                with req.cond:
                    if not req.queue and not req.cond.wait(timeout if timeout else 1.0) \
                            and timeout:
                        raise TimeoutError(f"request {request_id}: no output in {timeout} s")
            else:
                self.step()

    async def astream(self, request_id: int):
        """The outputs of one request as an asyncio iterator (needs the background loop,
        :meth:`start`).

        Raises
        ------
        InvalidArgument
            Unknown request id.
        StateError
            The background loop is not running (or stops, :meth:`shutdown`, before the request
            finishes); the request's outputs were already read to its end.
        """
        req = self._streamed(request_id)
        if not self.running_in_background():
            raise StateError("Engine.astream needs the background loop: call engine.start()")
        q = new_async_queue()
        sink = (asyncio.get_running_loop(), q)
        with req.cond:
            for item in req.queue:
                q.put_nowait(item)
            req.queue.clear()
            req.sinks.append(sink)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), _ASTREAM_POLL)
                except TimeoutError:
                    if q.empty() and not self.running_in_background():
                        raise StateError(f"request {request_id}: the engine's background loop "
                                         f"stopped (Engine.shutdown) before the request "
                                         f"finished") from None
                    continue
                yield item
                if item.finished:
                    return
        finally:
            with req.cond:
                if sink in req.sinks:
                    req.sinks.remove(sink)

    def running_in_background(self) -> bool:
        """True while the loop of :meth:`start` runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Engine:
        """Run :meth:`step` in a background thread while there is work (for servers)."""
        if self.running_in_background():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="olv-engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.has_unfinished():
                self.step()
            else:
                self._wake.wait(0.1)
                self._wake.clear()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the background loop (requests still queued stay queued) and the mask thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            if self._thread is not threading.current_thread():  # (a callback in the loop)
                self._thread.join(timeout)
            self._thread = None
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False)
            self._mask_pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False


def _prepare_all(procs) -> None:
    """The mask thread's work: each processor's ``prepare()`` (errors are left to the processor's
    own call in the step, which recomputes and raises them for its request alone)."""
    for p in procs:
        try:
            p.prepare()
        except Exception:  # noqa: BLE001 -- reported by the processor's call
            pass
