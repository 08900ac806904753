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


def _window(history, params: SamplingParams) -> np.ndarray:
    h = np.asarray(history if history is not None else (), dtype=np.int64).reshape(-1)
    if params.penalty_last_n:
        h = h[-params.penalty_last_n:]
    return h


def apply_penalties(logits: np.ndarray, history: Sequence[int] | np.ndarray | None,
                    params: SamplingParams) -> np.ndarray:
    """Repetition, presence and frequency penalties (steps 1-2 of the module docstring).

    Parameters
    ----------
    logits : numpy.ndarray
        ``[vocab]`` scores (any float dtype).
    history : sequence of int
        Token ids seen so far (prompt and generated); ids outside ``[0, vocab)`` are ignored
        (as transformers ignores ids beyond the output vocabulary).
    params : SamplingParams

    Returns
    -------
    numpy.ndarray
        float64 ``[vocab]``, a new array.
    """
    s = np.array(logits, dtype=np.float64).reshape(-1)
    if not params.penalised:
        return s
    h = _window(history, params)
    h = h[(h >= 0) & (h < s.size)]
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

    Raises
    ------
    InvalidArgument
        Sampling without an ``rng``.
    """
    if params.greedy:
        if not params.penalised:
            return int(np.argmax(logits))
        return int(np.argmax(apply_penalties(logits, history, params)))
    if rng is None:
        raise InvalidArgument("sampling with temperature > 0 needs an rng (or a seed)")
    p = probabilities(logits, history, params)
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
    """:class:`TokenLogprob` of ``token_id`` from one row of raw logits ``[vocab]``."""
    s = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = s.max()
    lse = m + np.log(np.exp(s - m).sum())
    top: list[tuple[int, float]] = []
    if top_n:
        n = min(int(top_n), s.size)
        idx = np.argpartition(-s, n - 1)[:n]
        idx = idx[np.lexsort((idx, -s[idx]))]
        top = [(int(i), float(s[i] - lse)) for i in idx]
    return TokenLogprob(int(token_id), float(s[int(token_id)] - lse), top)
