"""A request of the batching engine: its settings, its tokens, its blocks and its outputs.

:class:`RequestOutput` is what :meth:`olv_runtime.engine.Engine.step` returns and what a request's
stream yields: the tokens a step added to one request (and its text, with a tokenizer), or its end
(``finished`` with ``finish_reason``). :class:`RequestResult` is a whole request's result
(:meth:`Engine.generate`).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading

import numpy as np

from olv_runtime.generation.generate import TextStream
from olv_runtime.generation.sampling import TokenLogprob
from olv_runtime.generation.settings import GenerationConfig

__all__ = ["FINISH_REASONS", "RequestOutput", "RequestResult"]

#: Why a request ends: an eos id, a stop string, its max_new_tokens or the context ("length"),
#: ``Engine.cancel`` ("cancelled"), or an exception in its callback or its step ("error").
FINISH_REASONS = ("eos", "stop", "length", "cancelled", "error")


@dataclasses.dataclass
class RequestOutput:
    """What one engine step added to one request.

    Attributes
    ----------
    request_id : int
    token_ids : list of int
        The new tokens (0 or 1 per step; empty for an output that only ends the request).
    text : str or None
        The text that became final with them (with a tokenizer; stop strings cut it).
    logprobs : list of TokenLogprob or None
        One per new token when the request's config asks for logprobs.
    finished : bool
    finish_reason : str or None
        One of :data:`FINISH_REASONS` once finished.
    error : BaseException or None
        The exception that ended the request (finish reason "error").
    """

    request_id: int
    token_ids: list
    text: str | None = None
    logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None


@dataclasses.dataclass
class RequestResult:
    """A whole request (:meth:`Engine.generate`, :meth:`Engine.result`).

    Attributes
    ----------
    request_id : int
    ids : numpy.ndarray of int64
        The generated ids (the prompt not included), as :class:`GenerationResult.ids`.
    text : str or None
        Their text, with a tokenizer.
    finish_reason : str
    logprobs : list of TokenLogprob or None
    prompt_tokens : int
    cached_tokens : int
        Prompt tokens whose KV came from the prefix cache (first admission).
    preemptions : int
        Times the request was preempted and recomputed.
    error : BaseException or None
    """

    request_id: int
    ids: np.ndarray
    text: str | None
    finish_reason: str
    logprobs: list | None
    prompt_tokens: int
    cached_tokens: int
    preemptions: int
    error: BaseException | None = None


class Request:
    """The engine's record of one request (internal; read through outputs and results).

    ``tokens`` is the prompt followed by the generated ids; ``computed`` counts the leading
    tokens whose KV is in the request's blocks (``table``); the tokens after them are computed by
    the next steps (a prompt chunk, or the one token chosen last).
    """

    def __init__(self, rid: int, prompt: np.ndarray, config: GenerationConfig, eos: set,
                 limit: int | None, rng, tokenizer, callback, arrival: int,
                 logits_processor=None):
        self.id = rid
        self.prompt_len = int(prompt.size)
        self.tokens: list[int] = [int(t) for t in prompt.tolist()]
        self.config = config
        self.params = config.sampling
        self.argmax_only = self.params.greedy and not self.params.penalised
        self.eos = eos
        self.limit = limit
        self.rng = rng
        self.callback = callback
        self.logits_processor = logits_processor
        self.arrival = arrival
        self.out: list[int] = []
        self.lps: list[TokenLogprob] | None = [] if config.logprobs else None
        self.stream = (TextStream(tokenizer, config.stop,
                                  skip_special_tokens=config.skip_special_tokens)
                       if tokenizer is not None else None)
        self.table: list[int] = []
        self.computed = 0
        self.cached_tokens = 0
        self.first_admission = True
        self.preemptions = 0
        self.state = None           # fallback path: the request's own State
        self.finished = False
        self.cancel_asked = False
        self.ended = False          # its finishing output was queued to its streams
        self.reason: str | None = None
        self.error: BaseException | None = None
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.sinks: list = []      # (event loop, asyncio.Queue) of async streams

    @property
    def pending(self) -> int:
        """Tokens still to compute before the next token can be chosen."""
        return len(self.tokens) - self.computed

    def push(self, out: RequestOutput) -> None:
        """Queue an output for the request's streams: the async streams' queues when there are
        any (each output is read once), else the queue a sync stream reads."""
        with self.cond:
            if not self.sinks:
                self.queue.append(out)
            self.ended = self.ended or out.finished
            sinks = list(self.sinks)
            self.cond.notify_all()
        dead = []
        for sink in sinks:
            try:
                sink[0].call_soon_threadsafe(sink[1].put_nowait, out)
            except RuntimeError:  # the stream's loop is closed: nobody is listening there
                dead.append(sink)
        if dead:  # forget those streams; with none left, the output waits for a sync stream
            with self.cond:
                self.sinks = [x for x in self.sinks if x not in dead]
                if not self.sinks:
                    self.queue.append(out)
                self.cond.notify_all()

    def result(self) -> RequestResult:
        text = self.stream.text if self.stream is not None else None
        return RequestResult(self.id, np.asarray(self.out, np.int64), text, self.reason or "",
                             self.lps, self.prompt_len, self.cached_tokens, self.preemptions,
                             self.error)


def new_async_queue() -> asyncio.Queue:
    """An asyncio queue of the running loop (for a request's async stream)."""
    return asyncio.Queue()
