"""Token generation over a converted causal LM: prefill, then one decode call per token.

The KV cache is carried by the model's persistent bindings (:func:`olv_runtime.make_state`);
each call feeds only ``input_ids``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from olv_runtime.errors import InvalidArgument
from olv_runtime.session import InferenceSession, SessionOptions
from olv_runtime.state import empty_cache, make_state


@dataclasses.dataclass
class GenerationStats:
    """Timings of one :func:`generate` call.

    Attributes
    ----------
    prompt_tokens, new_tokens : int
    prefill_seconds : float
        Wall time of the prompt call (including the first token's logits).
    decode_seconds : float
        Wall time of the decode calls (one per new token after the first).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def sample_token(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 rng: np.random.Generator | None = None) -> int:
    """Pick the next token id from one row of logits.

    Parameters
    ----------
    logits : numpy.ndarray
        float32 ``[vocab]``.
    temperature : float
        0 → greedy (argmax, lowest id on ties); > 0 → sample from softmax(logits / temperature).
    top_k : int
        Keep only the k most likely tokens (0: all).
    top_p : float
        Nucleus sampling: keep the smallest set whose probability reaches top_p (1.0: all).
    rng : numpy.random.Generator
        Source of randomness for sampling (required when temperature > 0).
    """
    if temperature <= 0.0:
        return int(np.argmax(logits))
    if rng is None:
        raise InvalidArgument("sampling with temperature > 0 needs an rng (or a seed)")
    z = logits.astype(np.float64) / float(temperature)
    order = np.argsort(-z, kind="stable")
    if top_k and top_k > 0:
        order = order[:top_k]
    zs = z[order]
    p = np.exp(zs - zs.max())
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def _check_sampling(max_new_tokens, temperature, top_k, top_p) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not (np.isfinite(temperature) and temperature >= 0):
        raise InvalidArgument(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise InvalidArgument(f"top_k must be an integer >= 0 (0 = all tokens), got {top_k!r}")
    if not (0.0 < top_p <= 1.0):
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p!r}")


def generate(
    model,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    callback: Callable[[int], object] | None = None,
    session_options: SessionOptions | None = None,
    stats: GenerationStats | None = None,
) -> np.ndarray:
    """Generate tokens after a prompt (batch 1).

    Parameters
    ----------
    model : Model, ModelProto, path or InferenceSession
        A converted causal LM (``input_ids`` input, ``logits`` output, KV cache bound by
        persistent_bindings). Pass an InferenceSession to reuse it across calls.
    prompt_ids : sequence of int
        Token ids of the prompt (at least one).
    max_new_tokens : int
        Number of tokens to generate (fewer if ``eos_token_id`` appears).
    temperature, top_k, top_p, seed
        Sampling controls (see :func:`sample_token`); temperature 0 is greedy.
    eos_token_id : int or list of int, optional
        Stop after emitting one of these.
    callback : callable, optional
        Called with each new token id as soon as it is chosen.
    stats : GenerationStats, optional
        Filled with token counts and timings.

    Returns
    -------
    numpy.ndarray
        int64 ``[n_new]``: the generated ids (prompt excluded).

    Raises
    ------
    InvalidArgument
        Empty prompt, non-integer ids, max_new_tokens < 0, a model without ``input_ids``/``logits``.
    """
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidArgument(
            f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {list(ids.shape)}"
        )
    if ids.dtype.kind not in "iu":
        raise InvalidArgument(
            "prompt_ids must be integers that fit in int64 (token ids), got "
            + (f"dtype {ids.dtype}" if ids.dtype.kind != "O" else "values out of the int64 range")
        )
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    session = model if isinstance(model, InferenceSession) else InferenceSession(model, session_options)
    vocab = session.get_modelmeta().get("olv.vocab_size")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab is not None and hi >= int(vocab)):
        bad = lo if lo < 0 else hi
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise InvalidArgument(f"prompt_ids: token ids must be in {limit}, got {bad}")
    in_names = [a.name for a in session.get_inputs()]
    out_names = [a.name for a in session.get_outputs()]
    if "input_ids" not in in_names or "logits" not in out_names:
        raise InvalidArgument(
            f"generate needs a model with an 'input_ids' input and a 'logits' output; inputs are "
            f"{in_names}, outputs {out_names}"
        )
    eos = set() if eos_token_id is None else (
        {int(eos_token_id)} if np.isscalar(eos_token_id) else {int(e) for e in eos_token_id}
    )
    rng = np.random.default_rng(seed) if temperature > 0 else None
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = int(ids.size)
    stats.new_tokens = 0
    out: list[int] = []
    if max_new_tokens == 0:
        return np.zeros(0, np.int64)
    state = make_state(session, empty_cache(session))
    try:
        t0 = time.perf_counter()
        logits = state.run({"input_ids": ids.astype(np.int64).reshape(1, -1)})["logits"]
        tok = sample_token(logits[0, -1], temperature, top_k, top_p, rng)
        stats.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        step_ids = np.empty((1, 1), np.int64)
        while True:
            out.append(tok)
            stats.new_tokens = len(out)
            if callback is not None:
                callback(tok)
            if len(out) >= max_new_tokens or tok in eos:
                break
            step_ids[0, 0] = tok
            session.recycle(logits)  # consumed: its buffer serves the next call (no allocation)
            logits = state.run({"input_ids": step_ids})["logits"]
            tok = sample_token(logits[0, -1], temperature, top_k, top_p, rng)
        stats.decode_seconds = time.perf_counter() - t1
    finally:
        state.close()
    return np.asarray(out, np.int64)
