"""Next-token selection: penalties, temperature, top-k, top-p, min-p, sampling and logprobs.

The definitions are those of the Hugging Face transformers logits processors of the same names
(``transformers.generation.logits_process``), applied in the order ``GenerationMixin`` applies
them when sampling:

1. ``RepetitionPenaltyLogitsProcessor`` — each token id present in the history (prompt included)
   once: ``s < 0 ? s * penalty : s / penalty``;
2. presence / frequency penalties (OpenAI API and llama.cpp ``penalty_present`` /
   ``penalty_freq``; transformers has no processor for them): ``s - frequency * count -
   presence * (count > 0)`` over the same history;
3. ``TemperatureLogitsWarper``: ``s / temperature``;
4. ``TopKLogitsWarper``: tokens scoring below the k-th largest score are removed (ties kept);
5. ``TopPLogitsWarper``: scores sorted ascending, tokens whose cumulative probability is
   ``<= 1 - top_p`` removed, the most likely token always kept;
6. ``MinPLogitsWarper``: tokens with probability ``< min_p * max probability`` removed.

Removed tokens get ``-inf``. Probabilities are ``softmax`` of the processed scores. Greedy
decoding (temperature 0) takes the argmax of the penalised scores (steps 1-2), as transformers
does with ``do_sample=False``. Arithmetic is float64.

Inputs are checked, not coerced: logits are one row ``[vocab]`` of real numbers with a finite
maximum and no NaN or +inf (-inf entries are masked tokens); token ids (``token_logprob``'s
``token_id``, the penalties' history) are integers in ``[0, vocab)``. Violations raise
:class:`~olv_runtime.errors.InvalidArgument`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from olv_runtime.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling controls of :func:`generate` (defaults: greedy, no penalty, no filter).

    Attributes
    ----------
    temperature : float
        0 → greedy (argmax, lowest id on ties); > 0 → sample from softmax(scores / temperature).
    top_k : int
        Keep the k highest-scoring tokens (0: all).
    top_p : float
        Nucleus mass in (0, 1] (1: all).
    min_p : float
        In [0, 1]: drop tokens whose probability is below ``min_p`` times the top probability
        (0: off).
    repetition_penalty : float
        > 0; 1 is off. Above 1 penalises tokens already in the history (CTRL paper, as
        transformers).
    presence_penalty, frequency_penalty : float
        Subtracted once per present token / once per occurrence (0: off; may be negative).
    penalty_last_n : int
        The penalties look at the last n tokens of the history (0: the whole history,
        transformers' behaviour; llama.cpp defaults to 64).

    Raises
    ------
    InvalidArgument
        A value out of its range (the message names the field, the range and the value).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 0

    def __post_init__(self):
        def num(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(v):
                raise InvalidArgument(f"{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise InvalidArgument(f"{name} must be an integer >= 0, got {v!r}")

        if num("temperature") < 0:
            raise InvalidArgument(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        integer("top_k")
        integer("penalty_last_n")
        if not 0.0 < num("top_p") <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= num("min_p") <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if num("repetition_penalty") <= 0:
            raise InvalidArgument(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        num("presence_penalty")
        num("frequency_penalty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _row(logits) -> np.ndarray:
    """One row of logits ``[vocab]`` (1-D, non-empty, real numbers); InvalidArgument naming
    the shape or dtype otherwise. No copy."""
    a = np.asarray(logits)
    if a.ndim != 1 or a.size == 0:
        raise InvalidArgument(f"logits must be one row [vocab] (1-D, non-empty), got shape "
                              f"{list(a.shape)}")
    if a.dtype.kind not in "fiu":
        raise InvalidArgument(f"logits must be real numbers, got dtype {a.dtype}")
    return a


def check_finite(a: np.ndarray, top: int) -> None:
    """``top`` is ``argmax(a)``: numpy's argmax returns the first NaN when there is one, so a
    finite ``a[top]`` proves the row has no NaN, no +inf and a finite maximum (O(1) after the
    argmax the caller needs anyway). InvalidArgument naming what was found otherwise."""
    if np.isfinite(a[top]):
        return
    nan = np.flatnonzero(np.isnan(a))
    pinf = np.flatnonzero(np.isposinf(a))
    if nan.size:
        what = f"{nan.size} NaN (first at index {int(nan[0])})"
    elif pinf.size:
        what = f"{pinf.size} +inf (first at index {int(pinf[0])})"
    else:
        what = "every entry -inf"
    raise InvalidArgument(f"non-finite logits: {what} in a row of {a.size}; the model's output "
                          "is not a distribution")


def _window(history, params: SamplingParams, vocab: int) -> np.ndarray:
    h = np.asarray(history if history is not None else (), dtype=None).reshape(-1)
    if h.size and h.dtype.kind not in "iu":
        raise InvalidArgument(f"history must be integer token ids, got dtype {h.dtype}")
    h = h.astype(np.int64, copy=False)
    if params.penalty_last_n:
        h = h[-params.penalty_last_n:]
    if h.size:
        lo, hi = int(h.min()), int(h.max())
        if lo < 0 or hi >= vocab:
            raise InvalidArgument(f"history: token ids must be in [0, {vocab}) (the logits' "
                                  f"vocabulary), got {lo if lo < 0 else hi}")
    return h


def apply_penalties(logits: np.ndarray, history: Sequence[int] | np.ndarray | None,
                    params: SamplingParams) -> np.ndarray:
    """Repetition, presence and frequency penalties (steps 1-2 of the module docstring).

    Parameters
    ----------
    logits : numpy.ndarray
        ``[vocab]`` scores (any float dtype).
    history : sequence of int
        Token ids seen so far (prompt and generated), in ``[0, vocab)`` (the ids the penalties
        look at: the last ``penalty_last_n``, or all).
    params : SamplingParams

    Returns
    -------
    numpy.ndarray
        float64 ``[vocab]``, a new array.

    Raises
    ------
    InvalidArgument
        Logits that are not one row; a history id outside ``[0, vocab)`` or not an integer
        (with penalties on).
    """
    s = np.array(_row(logits), dtype=np.float64)
    if not params.penalised:
        return s
    h = _window(history, params, s.size)
    if h.size == 0:
        return s
    ids, counts = np.unique(h, return_counts=True)
    if params.repetition_penalty != 1.0:
        v = s[ids]
        s[ids] = np.where(v < 0, v * params.repetition_penalty, v / params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        s[ids] -= counts * params.frequency_penalty + params.presence_penalty
    return s


def _softmax(s: np.ndarray) -> np.ndarray:
    m = np.max(s)
    e = np.exp(s - m)
    return e / e.sum()


def process_logits(logits: np.ndarray, history: Sequence[int] | np.ndarray | None,
                   params: SamplingParams) -> np.ndarray:
    """The processed scores of one row of logits (steps 1-6; removed tokens are ``-inf``).

    With ``temperature == 0`` only the penalties apply (greedy decoding takes their argmax).

    Parameters
    ----------
    logits : numpy.ndarray
        ``[vocab]`` scores.
    history : sequence of int, optional
        Token ids seen so far (for the penalties).
    params : SamplingParams

    Returns
    -------
    numpy.ndarray
        float64 ``[vocab]``.
    """
    s = apply_penalties(logits, history, params)
    check_finite(s, int(np.argmax(s)))
    if params.greedy:
        return s
    if params.temperature != 1.0:
        s /= params.temperature
    if params.top_k and params.top_k < s.size:
        kth = np.partition(s, s.size - params.top_k)[s.size - params.top_k]
        s[s < kth] = -np.inf
    if params.top_p < 1.0:
        order = np.argsort(s, kind="stable")  # ascending
        cum = np.cumsum(_softmax(s[order]))
        remove = cum <= (1.0 - params.top_p)
        remove[-1] = False
        s[order[remove]] = -np.inf
    if params.min_p > 0.0:
        p = _softmax(s)
        drop = p < params.min_p * p.max()
        drop[int(np.argmax(p))] = False
        s[drop] = -np.inf
    return s


def probabilities(logits: np.ndarray, history: Sequence[int] | np.ndarray | None,
                  params: SamplingParams) -> np.ndarray:
    """The distribution the next token is drawn from: softmax of :func:`process_logits`.

    Returns
    -------
    numpy.ndarray
        float64 ``[vocab]``, summing to 1, zeros on removed tokens. For greedy parameters the
        softmax of the penalised scores (temperature 1).
    """
    return _softmax(process_logits(logits, history, params))


def select_token(logits: np.ndarray, history: Sequence[int] | np.ndarray | None,
                 params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """Choose the next token id.

    Greedy (temperature 0): argmax of the penalised scores, lowest id on ties. Otherwise one
    draw from :func:`probabilities` with ``rng``.

    Parameters
    ----------
    logits : numpy.ndarray
        One row ``[vocab]`` of raw scores.
    history : sequence of int, optional
        Token ids seen so far, in ``[0, vocab)`` (for the penalties).
    params : SamplingParams
    rng : numpy.random.Generator, optional
        Required when sampling (temperature > 0).

    Raises
    ------
    InvalidArgument
        Sampling without an ``rng``; logits that are not one row ``[vocab]``; non-finite
        logits (a NaN, a +inf, or every entry -inf); history ids outside ``[0, vocab)``.
    """
    a = _row(logits)
    top = int(np.argmax(a))
    check_finite(a, top)
    if params.greedy:
        if not params.penalised:
            return top
        return int(np.argmax(apply_penalties(a, history, params)))
    if rng is None:
        raise InvalidArgument("sampling with temperature > 0 needs an rng (or a seed)")
    p = probabilities(a, history, params)
    keep = np.flatnonzero(p)
    q = p[keep]
    return int(keep[rng.choice(keep.size, p=q / q.sum())])


@dataclasses.dataclass
class TokenLogprob:
    """Log-probability of one generated token under the model.

    Attributes
    ----------
    token_id : int
    logprob : float
        Natural log of the token's probability in ``log_softmax(logits)`` of the raw model
        logits (before penalties and filters; the OpenAI API / vLLM convention).
    top : list of (int, float)
        The ``top_logprobs`` most likely (token id, logprob) pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: np.ndarray, token_id: int, top_n: int = 0) -> TokenLogprob:
    """:class:`TokenLogprob` of ``token_id`` from one row of raw logits ``[vocab]``.

    Parameters
    ----------
    logits : numpy.ndarray
        One row ``[vocab]`` of raw scores.
    token_id : int
        In ``[0, vocab)`` (no counting from the end).
    top_n : int
        How many best alternatives to list (>= 0; at most ``vocab`` are listed).

    Raises
    ------
    InvalidArgument
        Logits that are not one row or not finite (a NaN, a +inf, every entry -inf); a
        ``token_id`` that is not an integer in ``[0, vocab)``; a negative ``top_n``.
    """
    a = _row(logits)
    if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)) \
            or not 0 <= token_id < a.size:
        raise InvalidArgument(f"token_id must be an integer in [0, {a.size}) (the logits' "
                              f"vocabulary), got {token_id!r}")
    if isinstance(top_n, (bool, np.bool_)) or not isinstance(top_n, (int, np.integer)) \
            or top_n < 0:
        raise InvalidArgument(f"top_n must be an integer >= 0, got {top_n!r}")
    s = a.astype(np.float64)
    top = int(np.argmax(s))
    check_finite(s, top)
    m = s[top]
    lse = m + np.log(np.exp(s - m).sum())
    top: list[tuple[int, float]] = []
    if top_n:
        n = min(int(top_n), s.size)
        idx = np.argpartition(-s, n - 1)[:n]
        idx = idx[np.lexsort((idx, -s[idx]))]
        top = [(int(i), float(s[i] - lse)) for i in idx]
    return TokenLogprob(int(token_id), float(s[int(token_id)] - lse), top)
