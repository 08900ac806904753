"""Token generation over a converted causal LM: prefill, then one decode call per token.

The KV cache is carried by the model's persistent bindings (:func:`olv_runtime.make_state`);
each call feeds only ``input_ids``. A :class:`~olv_runtime.State` passed to :func:`generate`
is continued: only the tokens its KV cache does not hold yet are fed (the previous call's last
token, then the new prompt), so a second turn of a conversation costs its new tokens only
(``GenerationStats.prefill_tokens``). Stopping: ``max_new_tokens``, eos ids (several; by default
none in the API, ``eos_token_id="auto"`` reads ``generation_config.json``), stop strings on the
decoded text. Selection: :mod:`olv_runtime.sampling` (the transformers logits processors'
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
from olv_runtime.kernels.precompile import kernel_seconds
from olv_runtime.sampling import (SamplingParams, TokenLogprob, check_finite, select_token,
                                  token_logprob)
from olv_runtime.session import InferenceSession, SessionOptions
from olv_runtime.state import empty_cache, make_state


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
    """What :func:`generate` returns with ``return_result=True``.

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
        The state (the one passed in, or a new one with ``return_state=True``); open.
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
    :func:`olv_runtime.sampling.select_token` for every option).

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
    from olv_runtime.io import Model

    m = model.model if isinstance(model, InferenceSession) else model
    path = m.path if isinstance(m, Model) else (pathlib.Path(m) if isinstance(m, (str, pathlib.Path)) else None)
    if path is not None:
        from olv_runtime.sidecars import sidecar_path

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


def _check_eos(eos_token_id, vocab) -> set[int]:
    """eos ids given as an int or a sequence of ints, each in ``[0, vocab)``; InvalidArgument
    naming the bad entry otherwise."""
    if eos_token_id is None:
        return set()
    scalar = np.isscalar(eos_token_id) or (isinstance(eos_token_id, np.ndarray)
                                           and eos_token_id.ndim == 0)
    try:
        vals = [eos_token_id] if scalar else list(eos_token_id)
    except TypeError:
        raise InvalidArgument(f"eos_token_id must be an int, a list of ints, 'auto' or None, "
                              f"got {eos_token_id!r}") from None
    out = set()
    for v in vals:
        if isinstance(v, np.ndarray) and v.ndim == 0:
            v = v[()]
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise InvalidArgument(f"eos_token_id entries must be integer token ids, got {v!r} "
                                  f"in {eos_token_id!r}")
        if v < 0 or (vocab is not None and v >= int(vocab)):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise InvalidArgument(f"eos_token_id entries must be token ids in {limit}, got {v}")
        out.add(int(v))
    return out


def check_seed(seed) -> int | None:
    """A sampling seed: None or an int in [0, 2**128) (numpy's SeedSequence takes non-negative
    integers); InvalidArgument otherwise."""
    if seed is None:
        return None
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise InvalidArgument(f"seed must be None or an integer >= 0, got {seed!r}")
    if not 0 <= int(seed) < 2**128:
        raise InvalidArgument(f"seed must be an integer in [0, 2**128), got {seed}")
    return int(seed)


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
):
    """Generate tokens after a prompt (batch 1), optionally continuing a state.

    Parameters
    ----------
    model : Model, ModelProto, path, InferenceSession or None
        A converted causal LM (``input_ids`` input, ``logits`` output, KV cache bound by
        persistent_bindings). Pass an InferenceSession to reuse it across calls. May be None
        when ``state`` is given (its session is used).
    prompt_ids : sequence of int
        Token ids to append (at least one, unless a continued state has a pending token).
    max_new_tokens : int
        Number of tokens to generate (fewer when an eos id or a stop string appears, or when
        the sequence reaches ``context_limit``: finish reason ``"length"``, as llama.cpp).
    temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, penalty_last_n
        Selection controls, :class:`olv_runtime.sampling.SamplingParams` (transformers'
        definitions). Temperature 0 is greedy. The penalties see the whole sequence (a
        continued state's history, the prompt and the generated tokens).
    seed : int, optional
        Seeds the sampling generator. A continued state keeps its generator when ``seed`` is
        None, so a continuation draws what one uninterrupted call would have drawn.
    eos_token_id : int, list of int, "auto" or None
        Stop after emitting one of these; ``"auto"``: :func:`eos_token_ids` of the model.
    stop : str or list of str, optional
        Stop strings, matched on the decoded continuation (needs ``tokenizer``); the text
        returned stops before the match.
    tokenizer : tokenizers.Tokenizer, optional
        For ``stop``, ``text_callback`` and ``GenerationResult.text``.
    skip_special_tokens : bool
        Leave special tokens (``<|im_end|>``, eos, ...) out of the decoded text (the default,
        as ``olv generate`` prints it; False keeps them, as ``--special``):
        ``tokenizers.Tokenizer.decode``'s flag; stop strings match the text without them.
        The ids always include them.
    logprobs, top_logprobs : bool, int
        Record each token's log-probability and the ``top_logprobs`` best alternatives
        (:func:`olv_runtime.sampling.token_logprob`, raw logits).
    callback : callable, optional
        Called with each new token id as soon as it is chosen.
    text_callback : callable, optional
        Called with each piece of final text (see :class:`TextStream`; needs ``tokenizer``).
        An exception raised by ``callback`` or ``text_callback`` propagates out of
        ``generate`` unchanged and ends the generation. The state is not rolled back: it stays
        consistent and keeps every token chosen so far, the token just passed to the callback
        included (it is the pending last entry of ``state.tokens``; its KV is computed by the
        next call), exactly as after a KeyboardInterrupt, so ``generate([], n, state=state)``
        continues where the callback stopped. A state made by this call (``state=None``) is
        closed.
    stats : GenerationStats, optional
        Filled with token counts and timings.
    state : State, optional
        Continue this state (made by an earlier ``generate(..., return_state=True)``,
        :func:`olv_runtime.load_state`, or a fresh :func:`make_state` with an empty cache). It is
        left open and holds the sequence afterwards (``state.tokens``; the last generated token
        is pending: its KV is computed at the start of the next call).
    return_state : bool
        Return ``(ids, state)`` (a new open state when none was passed).
    return_result : bool
        Return a :class:`GenerationResult`.
    context_limit : "model", int or None
        Positions the whole sequence may use (:func:`context_limit_of`): by default the
        model's ``max_position_embeddings``. A prompt that does not fit (with the tokens a
        continued state holds, and room for one new token when ``max_new_tokens > 0``) is
        refused before any prefill; generation stops when the sequence reaches it. An int
        allows more (RoPE scaling); None turns the check off.

    Returns
    -------
    numpy.ndarray or (numpy.ndarray, State) or GenerationResult
        int64 ``[n_new]``: the generated ids (prompt excluded).

    Raises
    ------
    ContextLengthError
        The prompt does not fit the context (see ``context_limit``); raised before the state
        is touched.
    InvalidArgument
        Empty prompt with nothing pending, non-integer or out-of-vocabulary ids (only
        ``[0, vocab)``, unlike ``State.run``, which follows ONNX Gather and counts negative ids
        from the end), bad sampling values, a seed that is not None or an integer >= 0, stop
        strings without a tokenizer, a tokenizer without ``decode``, a ``callback`` /
        ``text_callback`` that is not callable, eos ids that are not integers in
        ``[0, vocab)``, ``top_logprobs`` above the vocabulary size, a ``state`` that is not a
        State or ``stats`` that is not a GenerationStats, a model without
        ``input_ids``/``logits``, a state of another session. Every argument is checked before
        the state is touched.
    StateError
        A state whose KV cache length disagrees with its token history (it was run outside
        generate), or a closed state.
    KeyboardInterrupt
        Re-raised after the state was left consistent (unless ``return_result``, which reports
        ``finish_reason="interrupted"``).
    """
    ids = np.asarray(prompt_ids)
    if ids.size == 0 and ids.dtype.kind == "f":
        ids = ids.astype(np.int64)
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) \
            or max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty,
                            presence_penalty, frequency_penalty, penalty_last_n)
    seed = check_seed(seed)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidArgument(f"stop strings must be non-empty strings, got {stops!r}")
    if (stops or text_callback is not None) and tokenizer is None:
        raise InvalidArgument("stop strings and text_callback need a tokenizer (tokenizers.Tokenizer)")
    if not isinstance(top_logprobs, (int, np.integer)) or isinstance(top_logprobs, bool) \
            or top_logprobs < 0:
        raise InvalidArgument(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
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
        from olv_runtime.state.state import State

        if not isinstance(state, State):
            raise InvalidArgument(f"state must be a State (make_state, load_state, or generate "
                                  f"with return_state=True) or None, got {type(state).__name__}")

    if state is not None:
        if state.closed:
            raise StateError("generate: the state is closed")
        if model is not None and isinstance(model, InferenceSession) and model is not state.session:
            raise InvalidArgument("generate: the state belongs to another InferenceSession")
        session = state.session
    else:
        if model is None:
            raise InvalidArgument("generate needs a model (or a state)")
        session = model if isinstance(model, InferenceSession) else InferenceSession(model, session_options)
    vocab = session.get_modelmeta().get("olv.vocab_size")
    limit = context_limit_of(session, context_limit)
    held_tokens = len(state.tokens) if state is not None else 0
    if limit is not None:  # before the ids are read or copied: a 10M-token prompt stops here
        total = held_tokens + int(ids.size)
        room = 1 if max_new_tokens > 0 else 0
        if total + room > limit:
            held = f" after the {held_tokens} tokens the state holds" if held_tokens else ""
            source = ("the model's max_position_embeddings" if context_limit == "model"
                      else "context_limit")
            raise ContextLengthError(
                f"the prompt of {int(ids.size)} tokens{held} does not fit the context of {limit} "
                f"positions ({source})"
                + (f" with room for a new token (at most {limit - held_tokens - room} prompt "
                   "tokens)" if room else "")
                + "; shorten it, or pass context_limit=N (olv --context-limit N) for a model "
                  "whose RoPE scaling allows more, or None to turn the check off")
    pending = list(state.tokens[state.cached_tokens:]) if state is not None else []
    _check_ids(ids, vocab, "prompt_ids", allow_empty=bool(pending))
    in_names = [a.name for a in session.get_inputs()]
    out_names = [a.name for a in session.get_outputs()]
    if "input_ids" not in in_names or "logits" not in out_names:
        raise InvalidArgument(
            f"generate needs a model with an 'input_ids' input and a 'logits' output; inputs are "
            f"{in_names}, outputs {out_names}"
        )
    if isinstance(eos_token_id, str):
        if eos_token_id != "auto":
            raise InvalidArgument(f"eos_token_id must be an int, a list of ints, 'auto' or None, "
                                  f"got {eos_token_id!r}")
        eos = set(eos_token_ids(session))
    else:
        eos = _check_eos(eos_token_id, vocab)
    if vocab is not None and top_logprobs > int(vocab):
        raise InvalidArgument(f"top_logprobs must be at most the vocabulary size {vocab}, got "
                              f"{top_logprobs}")
    if state is not None:
        held = _kv_length(state)
        if held is not None and held != state.cached_tokens:
            raise StateError(
                f"generate: the state's KV cache holds {held} positions but its token history "
                f"records {state.cached_tokens} (was it run outside generate?)")
        if seed is not None or state.rng is None:
            state.rng = np.random.default_rng(seed)
        rng = state.rng
    else:
        rng = np.random.default_rng(seed)

    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = int(ids.size)
    stats.new_tokens = stats.prefill_tokens = 0
    stats.cached_tokens = state.cached_tokens if state is not None else 0
    stats.prefill_seconds = stats.decode_seconds = 0.0
    stats.prefill_compile_seconds = stats.decode_compile_seconds = 0.0
    stream = (TextStream(tokenizer, stops, skip_special_tokens=bool(skip_special_tokens))
              if tokenizer is not None else None)
    out: list[int] = []
    lps: list[TokenLogprob] | None = [] if logprobs else None
    reason = "length"

    own_state = state is None
    if own_state:
        _check_decodable(session)
        state = make_state(session, empty_cache(session))
        state.rng = rng
    history = list(state.tokens) + [int(t) for t in ids.tolist()]
    feed = pending + [int(t) for t in ids.tolist()]
    closed_ok = False
    t0 = t1 = None
    k0 = k1 = 0.0
    try:
        if max_new_tokens == 0:
            state.tokens = history
            closed_ok = True
        else:
            t0 = time.perf_counter()
            k0 = kernel_seconds()  # compile / cache-load / worker time, excluded from the rates
            step_ids = np.asarray(feed, np.int64).reshape(1, -1)
            # only the last row of the prompt's logits is read (the lm_head of the other
            # positions is not computed, as in llama.cpp)
            logits = state.run({"input_ids": step_ids}, last_only=_LOGITS,
                               outputs=_LOGITS)["logits"]
            state.tokens, state.cached_tokens = list(history), len(history)
            stats.prefill_tokens = len(feed)
            step = np.empty((1, 1), np.int64)
            # greedy without penalties: select_token's argmax, without its dispatch per token
            argmax_only = params.greedy and not params.penalised
            while True:
                row = logits[0, -1]
                if argmax_only:
                    tok = int(row.argmax())
                    if not math.isfinite(row[tok]):  # argmax finds a NaN first: O(1) check
                        check_finite(row, tok)
                else:
                    tok = select_token(row, history, params, rng)
                if lps is not None:
                    lps.append(token_logprob(row, tok, top_logprobs))
                out.append(tok)
                history.append(tok)
                state.tokens.append(tok)  # pending: its KV is computed by the next run
                stats.new_tokens = len(out)
                if t1 is None:
                    t1, k1 = time.perf_counter(), kernel_seconds()
                    stats.prefill_compile_seconds = k1 - k0
                    stats.prefill_seconds = t1 - t0 - stats.prefill_compile_seconds
                if callback is not None:
                    callback(tok)
                if stream is not None:
                    piece = stream.push(tok)
                    if piece and text_callback is not None:
                        text_callback(piece)
                    if stream.stopped is not None:
                        reason = "stop"
                        break
                if tok in eos:
                    reason = "eos"
                    break
                if len(out) >= max_new_tokens:
                    break
                if limit is not None and len(history) >= limit:
                    break  # the next token's position would be past the context: "length"
                step[0, 0] = tok
                session.recycle(logits)  # consumed: its buffer serves the next call
                logits = state.run({"input_ids": step}, outputs=_LOGITS)["logits"]
                state.cached_tokens += 1
            stats.decode_compile_seconds = kernel_seconds() - k1
            stats.decode_seconds = time.perf_counter() - t1 - stats.decode_compile_seconds
            closed_ok = True
    except KeyboardInterrupt:
        reason = "interrupted"
        if t1 is not None:  # the rate so far stays reportable
            stats.decode_compile_seconds = kernel_seconds() - k1
            stats.decode_seconds = time.perf_counter() - t1 - stats.decode_compile_seconds
        elif t0 is not None:
            stats.prefill_compile_seconds = kernel_seconds() - k0
            stats.prefill_seconds = time.perf_counter() - t0 - stats.prefill_compile_seconds
        if not return_result:
            raise
        closed_ok = True
    finally:
        if own_state and not (return_state and closed_ok):
            state.close()
    if stream is not None and text_callback is not None and reason != "stop":
        rest = stream.flush()
        if rest:
            text_callback(rest)
    result_ids = np.asarray(out, np.int64)
    keep = state if (return_state or not own_state) else None
    if return_result:
        text = None
        if stream is not None:
            text = stream.text
        return GenerationResult(result_ids, text, reason, stream.stopped if stream else None,
                                lps, keep, stats)
    if return_state:
        return result_ids, state
    return result_ids
