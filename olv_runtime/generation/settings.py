"""The settings of one generation: how many tokens, how each is selected, when to stop, what to
record (:class:`GenerationConfig`, read by :func:`olv_runtime.generation.generate.generate_result` and built
by the keyword form :func:`olv_runtime.generate`).

Every field is checked where the config is made (``__post_init__``), with the exceptions and
messages :func:`~olv_runtime.generate` raised for the same keyword arguments; what can only be
checked against a model (eos ids and ``top_logprobs`` against its vocabulary size) is checked
by the generate front before the state is touched.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from olv_runtime.errors import InvalidArgument
from olv_runtime.generation.sampling import SamplingParams


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


def _count(name: str, value) -> None:
    """``value`` is an integer >= 0 (not a bool); InvalidArgument naming ``name`` otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{name} must be an integer >= 0, got {value!r}")


def _stop_strings(stop) -> tuple[str, ...]:
    """Stop strings given as one string, a sequence of strings or None, as a tuple of non-empty
    strings; InvalidArgument listing them otherwise."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stops):
        raise InvalidArgument(f"stop strings must be non-empty strings, got {stops!r}")
    return tuple(stops)


def _eos_entries(eos_token_id) -> tuple[int, ...] | str | None:
    """eos ids given as an int, a sequence of ints, ``"auto"`` or None: None, ``"auto"`` or a
    tuple of ints. InvalidArgument naming the bad entry otherwise. Their range (``[0, vocab)``)
    depends on the model: the generate front checks it."""
    if eos_token_id is None:
        return None
    if isinstance(eos_token_id, str):
        if eos_token_id != "auto":
            raise InvalidArgument(f"eos_token_id must be an int, a list of ints, 'auto' or None, "
                                  f"got {eos_token_id!r}")
        return "auto"
    scalar = np.isscalar(eos_token_id) or (isinstance(eos_token_id, np.ndarray)
                                           and eos_token_id.ndim == 0)
    try:
        vals = [eos_token_id] if scalar else list(eos_token_id)
    except TypeError:
        raise InvalidArgument(f"eos_token_id must be an int, a list of ints, 'auto' or None, "
                              f"got {eos_token_id!r}") from None
    out = []
    for v in vals:
        if isinstance(v, np.ndarray) and v.ndim == 0:
            v = v[()]
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise InvalidArgument(f"eos_token_id entries must be integer token ids, got {v!r} "
                                  f"in {eos_token_id!r}")
        out.append(int(v))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Sampling, stopping and output settings of one generation (batch 1).

    Immutable and hashable; ``dataclasses.replace(config, temperature=0.7)`` makes a changed
    copy (checked again); ``GenerationConfig(**dataclasses.asdict(config))`` is ``config``. The defaults are those of :func:`olv_runtime.generate`: 32 tokens,
    greedy, no penalty, no stop condition but the length.

    Attributes
    ----------
    max_new_tokens : int
        Tokens to generate, >= 0 (fewer when an eos id or a stop string appears; 0 feeds nothing
        and records the prompt in a continued state's history).
    temperature : float
        >= 0. 0 is greedy (argmax of the penalised logits, lowest id on ties); > 0 samples from
        ``softmax(scores / temperature)``.
    top_k : int
        >= 0: keep the k highest-scoring tokens (0: all).
    top_p : float
        Nucleus mass in (0, 1] (1: all; transformers' TopPLogitsWarper).
    min_p : float
        In [0, 1]: drop tokens whose probability is below ``min_p`` times the top probability
        (0: off).
    repetition_penalty : float
        > 0 (1: off). Divides a positive / multiplies a negative score of each token id already in
        the history (CTRL paper, transformers' definition).
    presence_penalty, frequency_penalty : float
        Finite; subtracted once per token id present in the history / once per occurrence
        (0: off).
    penalty_last_n : int
        >= 0: the penalties see the last n tokens of the history (0: all of it). The history is
        the whole sequence: a continued state's tokens, the prompt and the generated tokens.
    seed : int or None
        In [0, 2**128): seeds the sampling generator (``numpy.random.default_rng``). None: a
        fresh state draws from an unseeded generator; a continued state keeps its generator, so
        a continuation draws what one uninterrupted call would have drawn.
    eos_token_id : tuple of int, "auto" or None
        Stop after emitting one of these token ids (given as an int or a sequence of ints;
        stored as a tuple). ``"auto"``: :func:`olv_runtime.eos_token_ids` of the model. None:
        no eos. Each id must be in ``[0, vocab)`` of the model it is used with (checked by the
        generate front, which knows the vocabulary).
    stop : tuple of str
        Stop strings (given as a string, a sequence of strings or None; stored as a tuple of
        non-empty strings), matched on the decoded continuation (needs a tokenizer); the text
        returned stops before the match, the ids include the token that completed it.
    skip_special_tokens : bool
        Leave special tokens (``<|im_end|>``, eos, ...) out of the decoded text (the default,
        as ``olv generate`` prints it; False keeps them, as ``--special``):
        ``tokenizers.Tokenizer.decode``'s flag; stop strings match the text without them.
        The ids always include them. Stored as ``bool(value)``.
    logprobs : bool
        Record each generated token's log-probability (raw logits,
        :func:`olv_runtime.generation.sampling.token_logprob`). Stored as ``bool(value)``.
    top_logprobs : int
        >= 0: with ``logprobs``, also record this many best alternatives per token (at most the
        model's vocabulary size, checked by the generate front).
    context_limit : "model", int or None
        Positions the whole sequence may use (prompt, continued state and generated tokens;
        :func:`olv_runtime.generation.generate.context_limit_of`): ``"model"`` (default) the
        model's ``max_position_embeddings``; an int >= 1 allows more (RoPE scaling); None turns
        the check off. A prompt that does not fit is refused before any prefill
        (:class:`~olv_runtime.errors.ContextLengthError`); generation stops at the limit with
        finish reason ``"length"``.
    sampling : SamplingParams
        Derived (a property, not a field): the selection fields above as the
        :class:`~olv_runtime.generation.sampling.SamplingParams` the selection reads.

    Raises
    ------
    InvalidArgument
        A field out of its range or of the wrong type; the message names the field, what it
        must be and the value given (the messages of :func:`olv_runtime.generate`).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 0
    seed: int | None = None
    eos_token_id: tuple[int, ...] | str | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    context_limit: int | str | None = "model"

    def __post_init__(self):
        _count("max_new_tokens", self.max_new_tokens)
        _ = self.sampling  # making the SamplingParams checks the selection fields
        seed = check_seed(self.seed)
        stop = _stop_strings(self.stop)
        _count("top_logprobs", self.top_logprobs)
        limit = self.context_limit
        if not (limit is None or limit == "model" or (
                isinstance(limit, (int, np.integer)) and not isinstance(limit, bool) and limit >= 1)):
            raise InvalidArgument(f"context_limit must be 'model', an integer >= 1 or None, got "
                                  f"{limit!r}")
        eos = _eos_entries(self.eos_token_id)
        setattr_ = object.__setattr__  # frozen: the normalised values are set once, here
        setattr_(self, "seed", seed)
        setattr_(self, "stop", stop)
        setattr_(self, "eos_token_id", eos)
        setattr_(self, "skip_special_tokens", bool(self.skip_special_tokens))
        setattr_(self, "logprobs", bool(self.logprobs))

    @property
    def sampling(self) -> SamplingParams:
        """The selection fields as the :class:`~olv_runtime.generation.sampling.SamplingParams` the
        selection reads (made on each access: read it once per generation)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p,
                              self.repetition_penalty, self.presence_penalty,
                              self.frequency_penalty, self.penalty_last_n)
