"""Token generation over a converted causal LM: prefill, then one decode call per token.

Split as gpt-fast splits it: :func:`prefill` (the prompt in one call, returning the last
position's logits), :func:`decode_step` (one token in, its logits out; the loop uses the same
feed), the loop (:func:`_decode_loop`: select, record, stop, feed), and the front
:func:`generate_result` taking a :class:`~olv_runtime.GenerationConfig` and returning a
:class:`GenerationResult`. :func:`generate` is the keyword compatibility form (same arguments
and return shapes as before the config existed).

The KV cache is carried by the model's persistent bindings (:func:`olv_runtime.make_state`);
each call feeds only ``input_ids``. A :class:`~olv_runtime.State` passed to :func:`generate`
is continued: only the tokens its KV cache does not hold yet are fed (the previous call's last
token, then the new prompt), so a second turn of a conversation costs its new tokens only
(``GenerationStats.prefill_tokens``). Stopping: ``max_new_tokens``, eos ids (several; by default
none in the API, ``eos_token_id="auto"`` reads ``generation_config.json``), stop strings on the
decoded text. Selection: :mod:`olv_runtime.generation.sampling` (the transformers logits processors'
definitions).
"""
from __future__ import annotations

import collections.abc as _abc
import dataclasses
import json
import math
import pathlib
import time
from typing import Callable, Sequence

import numpy as np

from olv_runtime.errors import ContextLengthError, InvalidArgument, StateError
from olv_runtime.executor.session import InferenceSession, SessionOptions
from olv_runtime.generation.sampling import (
    SamplingParams,
    TokenLogprob,
    check_finite,
    select_token,
    token_logprob,
)
from olv_runtime.generation.settings import GenerationConfig, check_seed  # noqa: F401
from olv_runtime.generation.structured import GrammarCompiler
from olv_runtime.io import Model
from olv_runtime.io.sidecars import sidecar_path
from olv_runtime.kernels.precompile import kernel_seconds
from olv_runtime.state import State, empty_cache, make_state

#: The output generate reads (one tuple object: a state's steady decode calls pass the same).
_LOGITS = ("logits",)


@dataclasses.dataclass
class GenerationStats:
    """Token counts and timings of one :func:`generate` call.

    The seconds of each phase exclude the time this call spent preparing compiled kernels --
    numba compiling or loading them from its disk cache, and waiting for the compile worker
    that builds the decode step (:func:`olv_runtime.kernels.precompile.kernel_seconds`, measured
    on the calling thread) -- so the rates are those of the kernels running; that time is
    reported beside them (``prefill_compile_seconds``, ``decode_compile_seconds``). On a warm
    numba cache in a process that has run the model before both are 0.

    Attributes
    ----------
    prompt_tokens : int
        Length of ``prompt_ids`` (the new prompt of this call).
    prefill_tokens : int
        Tokens fed in the prompt call (the counter of continuation cost): the tokens of a
        continued state's sequence its KV cache did not hold yet, plus ``prompt_tokens``.
    cached_tokens : int
        Tokens whose KV cache was reused from the state (0 for a fresh state).
    new_tokens : int
        Tokens generated.
    prefill_seconds : float
        Wall time of the prompt call (including the first token's logits), minus
        ``prefill_compile_seconds``.
    decode_seconds : float
        Wall time of the decode calls (one per new token after the first), minus
        ``decode_compile_seconds``.
    prefill_compile_seconds : float
        Seconds the prompt call spent compiling or loading kernels.
    decode_compile_seconds : float
        Seconds the decode calls spent compiling or loading kernels, or waiting for the compile
        worker (on a cold cache: the first decode step, whose compiled program a worker process
        builds while the prefill runs).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    prefill_compile_seconds: float = 0.0
    decode_compile_seconds: float = 0.0

    @property
    def compile_seconds(self) -> float:
        """Seconds this call spent compiling or loading kernels, or waiting for them (both
        phases)."""
        return self.prefill_compile_seconds + self.decode_compile_seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate_result` returns (and :func:`generate` with ``return_result=True``).

    Attributes
    ----------
    ids : numpy.ndarray
        int64 ``[n_new]`` generated ids (with the eos id or the token completing a stop string,
        when generation stopped on one).
    text : str or None
        The decoded continuation (needs ``tokenizer``), cut before a matched stop string. Special
        tokens -- an eos such as ``<|endoftext|>`` included -- are left out by default, as
        ``olv generate`` prints it; ``skip_special_tokens=False`` keeps them (``--special``).
    finish_reason : {"length", "eos", "stop", "interrupted"}
        ``"interrupted"``: a KeyboardInterrupt stopped the loop (the state stays consistent).
    stop_string : str or None
        The stop string matched.
    logprobs : list of TokenLogprob or None
        One per generated token when ``logprobs=True`` (see :class:`TokenLogprob`).
    state : State or None
        The state (the one passed in, or a new one with ``keep_state=True`` /
        ``return_state=True``); open.
    stats : GenerationStats
    """

    ids: np.ndarray
    text: str | None
    finish_reason: str
    stop_string: str | None
    logprobs: list[TokenLogprob] | None
    state: object | None
    stats: GenerationStats


def sample_token(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 rng: np.random.Generator | None = None) -> int:
    """Pick the next token id from one row of logits (no penalties; see
    :func:`olv_runtime.generation.sampling.select_token` for every option).

    Parameters
    ----------
    logits : numpy.ndarray
        float32 ``[vocab]``.
    temperature : float
        0 → greedy (argmax, lowest id on ties); > 0 → sample from softmax(logits / temperature).
    top_k : int
        Keep only the k most likely tokens (0: all).
    top_p : float
        Nucleus sampling (transformers' TopPLogitsWarper definition; 1.0: all).
    rng : numpy.random.Generator
        Source of randomness for sampling (required when temperature > 0).
    """
    return select_token(logits, None, SamplingParams(float(temperature), int(top_k), float(top_p)),
                        rng)


def context_limit_of(session, context_limit="model") -> int | None:
    """The number of positions a sequence may use (prompt, continued state and generated
    tokens together).

    Parameters
    ----------
    session : InferenceSession
    context_limit : "model", int or None
        ``"model"``: the model's ``max_position_embeddings`` (metadata
        ``olv.max_position_embeddings``; no limit when the model does not record one, e.g. an
        onnxruntime-genai folder); an int >= 1: that many positions (a model whose RoPE
        scaling allows more than it was trained on); None: no limit (the explicit opt-out).

    Raises
    ------
    InvalidArgument
        Any other value.
    """
    if context_limit is None:
        return None
    if isinstance(context_limit, str):
        if context_limit != "model":
            raise InvalidArgument(f"context_limit must be 'model', an integer >= 1 or None, got "
                                  f"{context_limit!r}")
        text = session.get_modelmeta().get("olv.max_position_embeddings", "")
        return int(text) if text.isdigit() and int(text) > 0 else None
    if isinstance(context_limit, bool) or not isinstance(context_limit, (int, np.integer)) \
            or context_limit < 1:
        raise InvalidArgument(f"context_limit must be 'model', an integer >= 1 or None, got "
                              f"{context_limit!r}")
    return int(context_limit)


def _check_context(session, ids: np.ndarray, config: GenerationConfig, state) -> GenerationConfig:
    """Refuse a prompt that does not fit the context (before its ids are read: a 10M-token prompt
    stops here); returns ``config`` with ``max_new_tokens`` capped so generation stops at the
    limit (finish reason "length", as llama.cpp)."""
    limit = context_limit_of(session, config.context_limit)
    if limit is None:
        return config
    held_tokens = len(state.tokens) if state is not None else 0
    total = held_tokens + int(ids.size)
    room = 1 if config.max_new_tokens > 0 else 0
    if total + room > limit:
        held = f" after the {held_tokens} tokens the state holds" if held_tokens else ""
        source = ("the model's max_position_embeddings" if config.context_limit == "model"
                  else "context_limit")
        raise ContextLengthError(
            f"the prompt of {int(ids.size)} tokens{held} does not fit the context of {limit} "
            f"positions ({source})"
            + (f" with room for a new token (at most {limit - held_tokens - room} prompt "
               "tokens)" if room else "")
            + "; shorten it, or pass context_limit=N (olv --context-limit N) for a model "
              "whose RoPE scaling allows more, or None to turn the check off")
    if config.max_new_tokens > limit - total:
        config = dataclasses.replace(config, max_new_tokens=limit - total)
    return config


def eos_token_ids(model) -> list[int]:
    """The eos token ids of a converted model.

    ``eos_token_id`` of ``generation_config.json`` beside the model file (an int or a list, as
    Hugging Face writes it); else the model's ``olv.eos_token_id`` metadata; else ``[]``.

    Parameters
    ----------
    model : Model, InferenceSession or path

    Raises
    ------
    InvalidArgument
        A generation_config.json that is not JSON or whose eos_token_id is not int / list of int.
    """
    m = model.model if isinstance(model, InferenceSession) else model
    path = m.path if isinstance(m, Model) else (pathlib.Path(m) if isinstance(m, (str, pathlib.Path)) else None)
    if path is not None:
        # the model's own generation_config.json (digest recorded at conversion), not another
        # model's left in the same folder (SidecarError)
        cfg = sidecar_path(m if isinstance(m, Model) else path, "generation_config.json")
        if cfg is not None:
            try:
                eos = json.loads(cfg.read_text()).get("eos_token_id")
            except (ValueError, AttributeError) as exc:
                raise InvalidArgument(f"{cfg}: not a JSON object ({exc})") from None
            if eos is not None:
                vals = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
                    raise InvalidArgument(
                        f"{cfg}: eos_token_id must be an int or a list of ints, got {eos!r}")
                return [int(v) for v in vals]
    meta = m.metadata() if isinstance(m, Model) else {}
    if "olv.eos_token_id" in meta:
        return [int(meta["olv.eos_token_id"])]
    return []


class TextStream:
    """Incremental detokenization with stop strings (shared by :func:`generate` and the CLI).

    ``push(token_id)`` returns the text that became final: the decoded continuation minus a
    trailing incomplete UTF-8 character and minus a trailing part that could still grow into a
    stop string. When a stop string appears, ``stopped`` names it and ``text`` is cut before it.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
    stop : sequence of str
        Stop strings (non-empty).
    skip_special_tokens : bool
        Passed to ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop]
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""         # the full decoded text so far (cut at a stop string)
        self.emitted = 0       # characters of self.text already returned by push/flush
        self.stopped: str | None = None

    def push(self, token_id: int) -> str:
        if self.stopped is not None:
            return ""
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        hold = 1 if text.endswith("\ufffd") else 0
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [(text.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.stopped, self.text = s, text[:i]
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out
            for s in self.stop:  # hold back a suffix that is a prefix of a stop string
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
        self.text = text
        end = max(self.emitted, len(text) - hold)
        out = text[self.emitted:end]
        self.emitted = end
        return out

    def flush(self) -> str:
        """The text still held back (at the end of generation)."""
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


def _check_ids(ids: np.ndarray, vocab, what: str, allow_empty: bool) -> None:
    if ids.ndim != 1 or (ids.size == 0 and not allow_empty):
        raise InvalidArgument(
            f"{what} must be a non-empty 1-D sequence of token ids, got shape {list(ids.shape)}"
        )
    if ids.size and ids.dtype.kind not in "iu":
        raise InvalidArgument(
            f"{what} must be integers that fit in int64 (token ids), got "
            + (f"dtype {ids.dtype}" if ids.dtype.kind != "O" else "values out of the int64 range")
        )
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (vocab is not None and hi >= int(vocab)):
            bad = lo if lo < 0 else hi
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise InvalidArgument(f"{what}: token ids must be in {limit}, got {bad}")


def _kv_length(state) -> int | None:
    """Positions held by the state's KV cache: the sequence axis of a contiguous cache
    (``[B, KVH, T, D]``), the ``length`` field of a paged cache struct (``PagedKVCache``); None
    for other state kinds (nothing to check against)."""
    first = next(iter(state.values.values()), None)
    if isinstance(first, np.ndarray):
        return int(first.shape[2]) if first.ndim == 4 else None
    length = first.get("length") if isinstance(first, _abc.Mapping) else None
    if isinstance(length, np.ndarray) and length.size == 1 and length.dtype.kind in "iu":
        return int(length.reshape(()))
    return None


def _check_decodable(session) -> None:
    """A model whose graph wants more than ``input_ids`` but binds nothing persistently (a plain
    ONNX export with ``past_*``/``present_*``) cannot be decoded by ``generate``: say so."""
    g = session.model.proto.graph
    bound = {b.input_name for b in g.persistent_bindings}
    extra = [vi.name for vi in g.input if vi.name != "input_ids" and vi.name not in bound]
    if extra and not bound:
        raise StateError(
            f"the model declares no persistent_bindings, so generate cannot carry its KV cache: "
            f"graph inputs {extra[:4]}{' ...' if len(extra) > 4 else ''} would have to be fed "
            "by the caller. Run it with InferenceSession.run (feeding past_* from present_*), "
            "or use an olv-converted model or an onnxruntime-genai folder")


def _check_eos_range(eos: tuple[int, ...] | None, vocab) -> set[int]:
    """The eos ids of a :class:`GenerationConfig` as a set, each in ``[0, vocab)`` (``>= 0``
    when the model does not record its vocabulary size); InvalidArgument naming the bad entry
    otherwise."""
    out = set()
    for v in eos or ():
        if v < 0 or (vocab is not None and v >= int(vocab)):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise InvalidArgument(f"eos_token_id entries must be token ids in {limit}, got {v}")
        out.add(v)
    return out


def _as_ids(prompt_ids) -> np.ndarray:
    """``prompt_ids`` as an array (an empty list, which numpy makes float64, as int64);
    InvalidArgument for nested sequences of unequal lengths (numpy refuses them)."""
    try:
        ids = np.asarray(prompt_ids)
    except ValueError as exc:
        raise InvalidArgument(f"prompt_ids must be a 1-D sequence of token ids, got a ragged "
                              f"nested sequence ({str(exc)[:80]})") from None
    if ids.size == 0 and ids.dtype.kind == "f":
        ids = ids.astype(np.int64)
    return ids


def _check_state_arg(state, who: str) -> None:
    """``state`` is an open State; InvalidArgument (another type) or StateError (closed)."""
    if not isinstance(state, State):
        raise InvalidArgument(f"state must be a State (make_state, load_state, or generate "
                              f"with return_state=True) or None, got {type(state).__name__}"
                              if who == "generate" else
                              f"{who}: state must be a State (make_state, load_state), got "
                              f"{type(state).__name__}")
    if state.closed:
        raise StateError(f"{who}: the state is closed")


def _check_kv_agrees(state, who: str) -> None:
    """The state's KV cache holds as many positions as its history records as cached."""
    held = _kv_length(state)
    if held is not None and held != state.cached_tokens:
        raise StateError(
            f"{who}: the state's KV cache holds {held} positions but its token history "
            f"records {state.cached_tokens} (was it run outside generate?)")


def _check_lm(session) -> None:
    """The model has an ``input_ids`` input and a ``logits`` output."""
    in_names = [a.name for a in session.get_inputs()]
    out_names = [a.name for a in session.get_outputs()]
    if "input_ids" not in in_names or "logits" not in out_names:
        raise InvalidArgument(
            f"generate needs a model with an 'input_ids' input and a 'logits' output; inputs are "
            f"{in_names}, outputs {out_names}"
        )


def _check_callers(config: GenerationConfig, tokenizer, callback, text_callback, stats,
                   state) -> None:
    """The arguments of a generation that are not settings (checked before any model work)."""
    if (config.stop or text_callback is not None) and tokenizer is None:
        raise InvalidArgument("stop strings and text_callback need a tokenizer (tokenizers.Tokenizer)")
    for name, fn in (("callback", callback), ("text_callback", text_callback)):
        if fn is not None and not callable(fn):
            raise InvalidArgument(f"{name} must be callable or None, got {type(fn).__name__} "
                                  f"{fn!r}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise InvalidArgument(
            f"tokenizer must have a decode(ids, skip_special_tokens=...) method "
            f"(tokenizers.Tokenizer), got {type(tokenizer).__name__} {str(tokenizer)[:40]!r}")
    if stats is not None and not isinstance(stats, GenerationStats):
        raise InvalidArgument(f"stats must be a GenerationStats or None, got "
                              f"{type(stats).__name__}")
    if state is not None:
        _check_state_arg(state, "generate")


def _session_for(model, state, session_options) -> InferenceSession:
    """The session a generation runs on: the state's, else ``model``'s (one is made for a model
    that is not a session)."""
    if state is not None:
        if model is not None and isinstance(model, InferenceSession) and model is not state.session:
            raise InvalidArgument("generate: the state belongs to another InferenceSession")
        return state.session
    if model is None:
        raise InvalidArgument("generate needs a model (or a state)")
    return model if isinstance(model, InferenceSession) else InferenceSession(model, session_options)


def _check_against_model(session, ids: np.ndarray, config: GenerationConfig, state) -> set[int]:
    """The checks that need the model (vocabulary size, input and output names, a continued
    state's KV length); returns the eos ids as a set."""
    vocab = session.get_modelmeta().get("olv.vocab_size")
    pending = state is not None and len(state.tokens) > state.cached_tokens
    _check_ids(ids, vocab, "prompt_ids", allow_empty=pending)
    _check_lm(session)
    if config.eos_token_id == "auto":
        eos = set(eos_token_ids(session))
    else:
        eos = _check_eos_range(config.eos_token_id, vocab)
    if vocab is not None and config.top_logprobs > int(vocab):
        raise InvalidArgument(f"top_logprobs must be at most the vocabulary size {vocab}, got "
                              f"{config.top_logprobs}")
    if state is not None:
        _check_kv_agrees(state, "generate")
    return eos


def _generator(state, seed: int | None) -> np.random.Generator:
    """The sampling generator: a continued state keeps its own unless ``seed`` is given."""
    if state is None:
        return np.random.default_rng(seed)
    if seed is not None or state.rng is None:
        state.rng = np.random.default_rng(seed)
    return state.rng


class _PhaseClock:
    """Wall time and kernel-preparation time (:func:`kernel_seconds`) of the prefill (from
    :meth:`start` to the first token) and of the decode (from the first token to :meth:`stop`),
    written to a :class:`GenerationStats`."""

    __slots__ = ("t0", "k0", "t1", "k1")

    def __init__(self):
        self.t0 = self.t1 = None
        self.k0 = self.k1 = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.k0 = kernel_seconds()  # compile / cache-load / worker time, excluded from the rates

    def first_token(self, stats: GenerationStats) -> float:
        """The first token is chosen: the prefill phase ends."""
        self.t1, self.k1 = time.perf_counter(), kernel_seconds()
        stats.prefill_compile_seconds = self.k1 - self.k0
        stats.prefill_seconds = self.t1 - self.t0 - stats.prefill_compile_seconds
        return self.t1

    def stop(self, stats: GenerationStats) -> None:
        """Generation ended (or was interrupted): the phase under way ends (none before
        :meth:`start`)."""
        if self.t1 is not None:
            stats.decode_compile_seconds = kernel_seconds() - self.k1
            stats.decode_seconds = time.perf_counter() - self.t1 - stats.decode_compile_seconds
        elif self.t0 is not None:
            stats.prefill_compile_seconds = kernel_seconds() - self.k0
            stats.prefill_seconds = time.perf_counter() - self.t0 - stats.prefill_compile_seconds


def _run_prompt(state, feed: list[int], history: list[int]) -> np.ndarray:
    """Feed ``feed`` (the state's pending tokens and the prompt) in one call; the state's history
    becomes ``history``, all of it cached. Returns the logits of the last position."""
    step_ids = np.asarray(feed, np.int64).reshape(1, -1)
    # only the last row of the prompt's logits is read (the lm_head of the other positions is
    # not computed, as in llama.cpp)
    logits = state.run({"input_ids": step_ids}, last_only=_LOGITS, outputs=_LOGITS)["logits"]
    state.tokens, state.cached_tokens = list(history), len(history)
    return logits


def _feed_token(state, step: np.ndarray, tok: int) -> np.ndarray:
    """Feed ``tok``, the pending last entry of ``state.tokens``, through the reused int64
    ``[1, 1]`` buffer ``step`` (the same feed every call: the state's steady decode path);
    returns its logits ``[1, 1, vocab]``."""
    step[0, 0] = tok
    logits = state.run({"input_ids": step}, outputs=_LOGITS)["logits"]
    state.cached_tokens += 1
    return logits


def prefill(state, prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Feed a state's pending tokens and ``prompt_ids`` in one call (the prompt phase of
    :func:`generate_result`, gpt-fast's ``prefill``).

    Parameters
    ----------
    state : State
        Open; its KV cache holds ``state.cached_tokens`` positions. Its pending tokens (the
        entries of ``state.tokens`` not cached yet, e.g. the last token a generate chose) are fed
        first. Afterwards ``state.tokens`` ends with ``prompt_ids``, all of it cached.
    prompt_ids : sequence of int
        Token ids in ``[0, vocab)``; may be empty when the state has a pending token.

    Returns
    -------
    numpy.ndarray
        float32 logits of the last position fed: ``[1, 1, vocab]`` when the lm_head is a fused
        linear step (only its last row is computed), else ``[1, n, vocab]``; ``logits[0, -1]`` is
        the row the next token is chosen from.

    Raises
    ------
    InvalidArgument
        ``state`` not a State; ids that are not integers in ``[0, vocab)``, or none to feed; a
        model without ``input_ids``/``logits``.
    StateError
        A closed state, or one whose KV cache length disagrees with its token history.
    """
    _check_state_arg(state, "prefill")
    session = state.session
    ids = _as_ids(prompt_ids)
    pending = list(state.tokens[state.cached_tokens:])
    _check_ids(ids, session.get_modelmeta().get("olv.vocab_size"), "prompt_ids",
               allow_empty=bool(pending))
    _check_lm(session)
    _check_kv_agrees(state, "prefill")
    new = [int(t) for t in ids.tolist()]
    return _run_prompt(state, pending + new, list(state.tokens) + new)


def decode_step(state, token: int) -> np.ndarray:
    """Feed one token (gpt-fast's ``decode_one_token``): it is appended to ``state.tokens`` and
    its KV computed. If the call fails (or is interrupted) the token stays pending: the state is
    as :func:`generate` leaves it, and ``prefill(state, [])`` feeds it.

    Parameters
    ----------
    state : State
        Open, with no pending token (after :func:`generate`, feed the pending one with
        ``prefill(state, [])`` first).
    token : int
        In ``[0, vocab)``.

    Returns
    -------
    numpy.ndarray
        float32 logits ``[1, 1, vocab]`` of the position fed (a new array: the caller owns it).

    Raises
    ------
    InvalidArgument
        ``state`` not a State; ``token`` not an integer in ``[0, vocab)``.
    StateError
        A closed state, or one with pending tokens.
    """
    _check_state_arg(state, "decode_step")
    if len(state.tokens) != state.cached_tokens:
        raise StateError(f"decode_step: the state has {len(state.tokens) - state.cached_tokens} "
                         f"pending token(s) (chosen, not fed yet): feed them with "
                         f"prefill(state, []) first")
    vocab = state.session.get_modelmeta().get("olv.vocab_size")
    if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) \
            or token < 0 or (vocab is not None and token >= int(vocab)):
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise InvalidArgument(f"decode_step: token must be an integer token id in {limit}, got "
                              f"{token!r}")
    state.tokens.append(int(token))
    return _feed_token(state, np.empty((1, 1), np.int64), int(token))


def _decode_loop(state, logits: np.ndarray, history: list[int], config: GenerationConfig,
                 eos: set[int], rng, out: list[int], lps: list | None, callback,
                 stream: TextStream | None, text_callback, stats: GenerationStats,
                 clock: _PhaseClock, processor=None) -> str:
    """Choose a token from ``logits``, record it, feed it; until a stop condition. Returns the
    finish reason ("stop", "eos" or "length"). Each chosen token is appended to ``out``,
    ``history`` and ``state.tokens`` (pending until fed) before the callbacks see it."""
    session = state.session
    params, top_n, max_new = config.sampling, config.top_logprobs, config.max_new_tokens
    step = np.empty((1, 1), np.int64)
    # greedy without penalties: select_token's argmax, without its dispatch per token
    argmax_only = params.greedy and not params.penalised
    t1 = None
    while True:
        row = raw = logits[0, -1]
        if processor is not None:  # structured output: the grammar's mask on a copy of the row
            row = np.array(raw)
            processor(history, row)
        if argmax_only:
            tok = int(row.argmax())
            if not math.isfinite(row[tok]):  # argmax finds a NaN first: O(1) check
                check_finite(row, tok)
        else:
            tok = select_token(row, history, params, rng)
        if processor is not None:
            processor.accept(tok)
        if lps is not None:  # the model's log-probability (the raw logits, mask or not)
            lps.append(token_logprob(raw, tok, top_n))
        out.append(tok)
        history.append(tok)
        state.tokens.append(tok)  # pending: its KV is computed by the next run
        stats.new_tokens = len(out)
        if t1 is None:
            t1 = clock.first_token(stats)
        if callback is not None:
            callback(tok)
        if stream is not None:
            piece = stream.push(tok)
            if piece and text_callback is not None:
                text_callback(piece)
            if stream.stopped is not None:
                return "stop"
        if tok in eos:
            return "eos"
        if len(out) >= max_new:
            return "length"
        session.recycle(logits)  # consumed: its buffer serves the next call
        logits = _feed_token(state, step, tok)


def _run(state, own_state: bool, ids: np.ndarray, config: GenerationConfig, eos: set[int], rng,
         out: list[int], lps: list | None, callback, stream: TextStream | None, text_callback,
         stats: GenerationStats, keep_state: bool, raise_interrupt: bool,
         processor=None) -> str:
    """Prefill and decode loop on ``state``, with the timings and the KeyboardInterrupt rules;
    returns the finish reason. A state made by the caller for this call (``own_state``) is
    closed unless it is kept and generation ended normally."""
    new = [int(t) for t in ids.tolist()]
    pending = list(state.tokens[state.cached_tokens:])
    history = list(state.tokens) + new
    clock = _PhaseClock()
    reason = "length"
    closed_ok = False
    try:
        if config.max_new_tokens == 0:
            state.tokens = history
        else:
            clock.start()
            logits = _run_prompt(state, pending + new, history)
            stats.prefill_tokens = len(pending) + len(new)
            reason = _decode_loop(state, logits, history, config, eos, rng, out, lps, callback,
                                  stream, text_callback, stats, clock, processor)
            clock.stop(stats)
        closed_ok = True
    except KeyboardInterrupt:
        reason = "interrupted"
        clock.stop(stats)  # the rate so far stays reportable
        if raise_interrupt:
            raise
        closed_ok = True
    finally:
        if own_state and not (keep_state and closed_ok):
            state.close()
    return reason


def _grammar(session, json_schema, tokenizer, eos: set[int]):
    """The structured-output processor of ``json_schema`` (None: none): a JSON Schema dict, or
    ``True`` for any JSON object (OpenAI's ``json_object``); InvalidArgument without a tokenizer
    or an eos id (the grammar ends with one), or for a schema llguidance cannot compile."""
    if json_schema is None or json_schema is False:
        return None
    if tokenizer is None:
        raise InvalidArgument("json_schema needs the model's tokenizer (tokenizer=...)")
    if not eos:
        raise InvalidArgument("json_schema needs eos ids (eos_token_id='auto' or ids): the "
                              "grammar ends with one")
    vocab = session.get_modelmeta().get("olv.vocab_size")
    vocab = int(vocab) if vocab is not None else tokenizer.get_vocab_size(with_added_tokens=True)
    compiler = GrammarCompiler(tokenizer, vocab, sorted(eos))
    return compiler.processor(None if json_schema is True else json_schema)


def _generate(model, prompt_ids, config: GenerationConfig, *, tokenizer, callback, text_callback,
              session_options, stats, state, keep_state: bool,
              raise_interrupt: bool, json_schema=None) -> GenerationResult:
    """:func:`generate_result`, and :func:`generate` with ``raise_interrupt`` (its KeyboardInterrupt
    rule without ``return_result``). Every argument is checked before the state is touched."""
    ids = _as_ids(prompt_ids)
    _check_callers(config, tokenizer, callback, text_callback, stats, state)
    session = _session_for(model, state, session_options)
    config = _check_context(session, ids, config, state)
    eos = _check_against_model(session, ids, config, state)
    processor = _grammar(session, json_schema, tokenizer, eos)
    rng = _generator(state, config.seed)

    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = int(ids.size)
    stats.new_tokens = stats.prefill_tokens = 0
    stats.cached_tokens = state.cached_tokens if state is not None else 0
    stats.prefill_seconds = stats.decode_seconds = 0.0
    stats.prefill_compile_seconds = stats.decode_compile_seconds = 0.0
    stream = (TextStream(tokenizer, config.stop, skip_special_tokens=config.skip_special_tokens)
              if tokenizer is not None else None)
    out: list[int] = []
    lps: list[TokenLogprob] | None = [] if config.logprobs else None

    own_state = state is None
    if own_state:
        _check_decodable(session)
        state = make_state(session, empty_cache(session))
        state.rng = rng
    reason = _run(state, own_state, ids, config, eos, rng, out, lps, callback, stream,
                  text_callback, stats, keep_state, raise_interrupt, processor)
    if stream is not None and text_callback is not None and reason != "stop":
        rest = stream.flush()
        if rest:
            text_callback(rest)
    return GenerationResult(np.asarray(out, np.int64), stream.text if stream else None, reason,
                            stream.stopped if stream else None, lps,
                            state if (keep_state or not own_state) else None, stats)


def generate_result(
    model,
    prompt_ids: Sequence[int] | np.ndarray,
    config: GenerationConfig | None = None,
    *,
    tokenizer=None,
    callback: Callable[[int], object] | None = None,
    text_callback: Callable[[str], object] | None = None,
    state=None,
    keep_state: bool = False,
    stats: GenerationStats | None = None,
    session_options: SessionOptions | None = None,
    json_schema=None,
) -> GenerationResult:
    """Generate tokens after a prompt (batch 1) with the settings of ``config``; the entry point
    of new code, with one return type (:func:`generate` is the keyword compatibility form).

    A separate name rather than ``generate(..., config=...)``: the settings live in one place (no
    keyword that could disagree with the config), the return type does not depend on flags, and
    :func:`generate`'s signature stays exactly as before. The work is :func:`prefill`, then one
    decode step (:func:`decode_step`'s feed) per token after the first, as gpt-fast splits it.

    Parameters
    ----------
    model : Model, ModelProto, path, InferenceSession or None
        A converted causal LM (``input_ids`` input, ``logits`` output, KV cache bound by
        persistent_bindings). Pass an InferenceSession to reuse it across calls. May be None
        when ``state`` is given (its session is used).
    prompt_ids : sequence of int
        Token ids to append (at least one, unless a continued state has a pending token).
    config : GenerationConfig, optional
        Sampling, stopping and output settings (default: ``GenerationConfig()``, 32 greedy
        tokens).
    tokenizer : tokenizers.Tokenizer, optional
        For ``config.stop``, ``text_callback`` and ``GenerationResult.text``.
    callback : callable, optional
        Called with each new token id as soon as it is chosen.
    text_callback : callable, optional
        Called with each piece of final text (see :class:`TextStream`; needs ``tokenizer``).
        An exception raised by ``callback`` or ``text_callback`` propagates unchanged and ends
        the generation. The state is not rolled back: it keeps every token chosen so far, the
        token just passed to the callback included (the pending last entry of ``state.tokens``;
        its KV is computed by the next call), so a call with ``prompt_ids=[]`` continues where
        the callback stopped. A state made by this call is closed.
    state : State, optional
        Continue this state (from :func:`olv_runtime.make_state` with an empty cache,
        :func:`olv_runtime.load_state` or an earlier generation). Only the tokens its KV cache
        does not hold yet are fed. It is left open and holds the sequence afterwards (the last
        generated token pending). None: a new state, closed at the end unless ``keep_state``.
    keep_state : bool
        Keep a state made by this call open and return it in ``GenerationResult.state``.
    stats : GenerationStats, optional
        Filled with token counts and timings (also in ``GenerationResult.stats``).
    session_options : SessionOptions, optional
        For the session made when ``model`` is not an InferenceSession.
    json_schema : dict or True, optional
        Structured output: every token is chosen among those a JSON value matching this JSON
        Schema allows next (``True``: any JSON object), through llguidance
        (:mod:`olv_runtime.generation.structured`; the ``serve`` extra); the generation ends
        with an eos id once the value is complete. Needs ``tokenizer`` and eos ids. Logprobs
        stay the model's (the raw logits).

    Returns
    -------
    GenerationResult
        ``ids`` int64 ``[n_new]`` (prompt excluded), ``finish_reason`` ("length", "eos",
        "stop", "interrupted" after a KeyboardInterrupt, which is not re-raised), ``state``: the
        state passed, the kept one, or None.

    Raises
    ------
    ContextLengthError
        The prompt does not fit ``config.context_limit`` (before the state is touched).
    InvalidArgument
        Empty prompt with nothing pending, non-integer or out-of-vocabulary ids (only
        ``[0, vocab)``), ``config`` not a GenerationConfig, eos ids or ``top_logprobs`` beyond
        the vocabulary, stop strings or ``text_callback`` without a tokenizer, a tokenizer
        without ``decode``, a callback that is not callable, a ``state`` that is not a State,
        ``stats`` that is not a GenerationStats, a model without ``input_ids``/``logits``, a
        state of another session. Every argument is checked before the state is touched.
    StateError
        A closed state, or one whose KV cache length disagrees with its token history.
    """
    if config is None:
        config = GenerationConfig()
    elif not isinstance(config, GenerationConfig):
        raise InvalidArgument(f"config must be a GenerationConfig or None, got "
                              f"{type(config).__name__}")
    return _generate(model, prompt_ids, config, tokenizer=tokenizer, callback=callback,
                     text_callback=text_callback, session_options=session_options, stats=stats,
                     state=state, keep_state=bool(keep_state), raise_interrupt=False,
                     json_schema=json_schema)


def generate(
    model,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    penalty_last_n: int = 0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | str | None = None,
    stop: str | Sequence[str] | None = None,
    tokenizer=None,
    skip_special_tokens: bool = True,
    logprobs: bool = False,
    top_logprobs: int = 0,
    callback: Callable[[int], object] | None = None,
    text_callback: Callable[[str], object] | None = None,
    session_options: SessionOptions | None = None,
    stats: GenerationStats | None = None,
    state=None,
    return_state: bool = False,
    return_result: bool = False,
    context_limit: int | str | None = "model",
    json_schema=None,
):
    """Generate tokens after a prompt (batch 1), optionally continuing a state: the keyword
    compatibility form.

    Kept so that code written before :class:`GenerationConfig` keeps working unchanged (same
    arguments, checks, results and return shapes); it builds a :class:`GenerationConfig` from
    its setting keywords and runs :func:`generate_result`. New code: ``generate_result(model,
    prompt_ids, GenerationConfig(...))``, which always returns a :class:`GenerationResult`.

    Parameters
    ----------
    model : Model, ModelProto, path, InferenceSession or None
        As :func:`generate_result` (None when ``state`` is given).
    prompt_ids : sequence of int
        Token ids to append (at least one, unless a continued state has a pending token).
    max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, penalty_last_n, seed, eos_token_id, stop, skip_special_tokens, logprobs, top_logprobs, context_limit
        The fields of :class:`GenerationConfig` (same names, defaults, meaning and checks):
        length, selection (transformers' definitions; temperature 0 is greedy; penalties see
        the whole sequence), sampling seed (a continued state keeps its generator when None),
        eos ids (``"auto"``: :func:`eos_token_ids` of the model), stop strings (need
        ``tokenizer``), decoded-text and log-probability options.
    tokenizer, callback, text_callback, stats, session_options
        As :func:`generate_result`; an exception raised by a callback propagates unchanged and
        the state keeps every token chosen so far (the last one pending), so ``generate([], n,
        state=state)`` continues where the callback stopped.
    state : State, optional
        Continue this state (made by an earlier ``generate(..., return_state=True)``,
        :func:`olv_runtime.load_state`, or a fresh :func:`make_state` with an empty cache). It is
        left open and holds the sequence afterwards (``state.tokens``; the last generated token
        is pending: its KV is computed at the start of the next call).
    return_state : bool
        Return ``(ids, state)`` (a new open state when none was passed).
    return_result : bool
        Return a :class:`GenerationResult` (with both flags, its ``state`` is the open state).
    json_schema : dict or True, optional
        Structured output, as :func:`generate_result` (needs ``tokenizer``).

    Returns
    -------
    numpy.ndarray or (numpy.ndarray, State) or GenerationResult
        int64 ``[n_new]``: the generated ids (prompt excluded).

    Raises
    ------
    ContextLengthError
        The prompt does not fit the context (``context_limit``: by default the model's
        ``max_position_embeddings``); raised before the state is touched.
    InvalidArgument
        As :func:`generate_result` and :class:`GenerationConfig` (a bad setting, id, callback,
        tokenizer, state or stats; every argument is checked before the state is touched).
        Ids must be in ``[0, vocab)``, unlike ``State.run``, which follows ONNX Gather and
        counts negative ids from the end.
    StateError
        A state whose KV cache length disagrees with its token history (it was run outside
        generate), or a closed state.
    KeyboardInterrupt
        Re-raised after the state was left consistent (unless ``return_result``, which reports
        ``finish_reason="interrupted"``).
    """
    config = GenerationConfig(
        max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, penalty_last_n, seed, eos_token_id, stop, skip_special_tokens,
        logprobs, top_logprobs, context_limit)
    res = _generate(model, prompt_ids, config, tokenizer=tokenizer, callback=callback,
                    text_callback=text_callback, session_options=session_options, stats=stats,
                    state=state, keep_state=return_state, raise_interrupt=not return_result,
                    json_schema=json_schema)
    if return_result:
        return res
    if return_state:
        return res.ids, res.state
    return res.ids
