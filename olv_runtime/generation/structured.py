"""Structured output: a grammar's token mask applied to the logits before each selection (the
engine computes each step's masks on a thread of its own while the forward runs: ``prepare()``).

:class:`GrammarCompiler` turns a JSON schema (or "any JSON object") into a per-request
:class:`GrammarLogitsProcessor` through llguidance (https://github.com/guidance-ai/llguidance,
an optional package: ``pip install llguidance``, the ``serve`` extra). The processor is the
``logits_processor`` of :meth:`olv_runtime.engine.Engine.add_request`: called with the request's
token history and its logits row ``[vocab]`` float32, it sets every id the grammar does not allow
next to ``-inf`` (llguidance's ``LLMatcher.compute_bitmask``: one bit per token, little-endian
words); ``accept(token_id)`` advances the grammar. Once the grammar is complete, only the
tokenizer's eos ids are allowed, so the request ends with finish reason ``"eos"``.

JSON is generated without optional whitespace by default (``whitespace_flexible: false``): the
output is compact, and a model cannot fill its budget with blanks; a schema's own ``x-guidance``
options override it (llguidance's JSON compile options).
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from olv_runtime.errors import InvalidArgument, OlvError

__all__ = ["JSON_DEFAULTS", "GrammarCompiler", "GrammarError", "GrammarLogitsProcessor"]

#: llguidance JSON compile options applied before a schema's own ``x-guidance``
JSON_DEFAULTS = {"whitespace_flexible": False}

#: a schema is refused beyond this size (characters of its JSON text)
MAX_SCHEMA_CHARS = 200_000


class GrammarError(OlvError, RuntimeError):
    """The grammar refused a chosen token, or failed while computing its mask (its message is
    llguidance's)."""


class GrammarLogitsProcessor:
    """One request's grammar state (an llguidance ``LLMatcher``) as an engine logits processor.

    Parameters
    ----------
    matcher : llguidance.LLMatcher
        Fresh (nothing consumed yet).
    vocab : int
        The model's vocabulary (logits row length); ids at and beyond the tokenizer's
        vocabulary are never allowed.

    Attributes
    ----------
    mask_seconds : float
        Time spent computing and applying masks (for the mask cost per token).
    masks : int
        Masks applied.
    """

    def __init__(self, matcher, vocab: int):
        self.matcher = matcher
        self.vocab = int(vocab)
        self.mask_seconds = 0.0
        self.masks = 0
        self._ready = None  # the next mask, made by prepare() for the current grammar state

    def allowed(self) -> np.ndarray:
        """The ids the grammar allows next: bool ``[vocab]``.

        Raises
        ------
        GrammarError
            The matcher is in its error state.
        """
        if self.matcher.is_error():
            raise GrammarError(f"grammar: {self.matcher.get_error()}")
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        ok = np.unpackbits(bits, bitorder="little").view(bool)
        out = np.zeros(self.vocab, bool)
        n = min(self.vocab, ok.size)
        out[:n] = ok[:n]
        return out

    def prepare(self) -> None:
        """Compute the next mask now (the engine calls it on its mask thread while the forward
        runs); the next call uses it. Errors are left to that call."""
        t0 = time.perf_counter()
        self._ready = None
        self._ready = ~self.allowed()
        self.mask_seconds += time.perf_counter() - t0

    def __call__(self, history: Sequence[int], row: np.ndarray) -> None:
        """Set the ids the grammar does not allow next to ``-inf`` in ``row`` (``[vocab]``
        float32, in place): the mask :meth:`prepare` made, else computed now. GrammarError when
        the grammar is in error."""
        t0 = time.perf_counter()
        banned, self._ready = self._ready, None
        if banned is None:
            banned = ~self.allowed()
        row[banned[:row.shape[0]]] = -np.inf
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1

    def accept(self, token_id: int) -> None:
        """Advance the grammar by the chosen token (GrammarError when it refuses it)."""
        self._ready = None
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"grammar refused token {token_id}: {self.matcher.get_error()}")


class GrammarCompiler:
    """Makes :class:`GrammarLogitsProcessor` objects for one tokenizer and model.

    Parameters
    ----------
    tokenizer : tokenizers.Tokenizer
        The model's tokenizer (``tokenizer.json``).
    vocab : int
        The model's vocabulary size (logits row length), >= the tokenizer's.
    eos_ids : sequence of int
        The ids that end a generation (the engine's eos ids), allowed once the grammar is
        complete; at least one.

    The llguidance tokenizer is built at the first :meth:`processor` call (about a second for a
    150k vocabulary) and shared by all requests. Thread-safe.

    Raises
    ------
    InvalidArgument
        No eos id, or an eos id outside ``[0, vocab)``.
    """

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]):
        eos = sorted({int(e) for e in eos_ids})
        if not eos:
            raise InvalidArgument("structured output needs at least one eos id (the grammar ends "
                                  "with it)")
        if any(not 0 <= e < vocab for e in eos):
            raise InvalidArgument(f"eos ids {eos} outside the vocabulary [0, {vocab})")
        self.tokenizer = tokenizer
        self.vocab = int(vocab)
        self.eos_ids = eos
        self._ll = None
        self._lock = threading.Lock()

    def _lltokenizer(self):
        import llguidance

        with self._lock:
            if self._ll is None:
                n = max(self.vocab, self.tokenizer.get_vocab_size(with_added_tokens=True))
                self._ll = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=n,
                                                  eos_token=self.eos_ids)
            return self._ll

    def processor(self, json_schema: Mapping | bool | None = None) -> GrammarLogitsProcessor:
        """A fresh processor for one request: output a JSON value matching ``json_schema``
        (a JSON Schema as a dict; None: any JSON object, OpenAI's ``json_object``).

        Raises
        ------
        InvalidArgument
            A schema that is not a dict, is larger than :data:`MAX_SCHEMA_CHARS`, or that
            llguidance cannot compile (its message: an unknown type, an unsupported keyword,
            a bad pattern, ...).
        """
        import llguidance

        schema = {"type": "object"} if json_schema is None else json_schema
        if not isinstance(schema, Mapping):
            raise InvalidArgument(f"the JSON schema must be an object, got "
                                  f"{type(schema).__name__}")
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidArgument(f"the JSON schema is not plain JSON: {exc}") from None
        if len(text) > MAX_SCHEMA_CHARS:
            raise InvalidArgument(f"the JSON schema has {len(text)} characters; at most "
                                  f"{MAX_SCHEMA_CHARS} are accepted")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
        except ValueError as exc:
            raise InvalidArgument(f"the JSON schema cannot be compiled: {exc}") from None
        ll = self._lltokenizer()
        err = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if err and not err.startswith("WARNING"):
            raise InvalidArgument(f"the JSON schema cannot be compiled: {err}")
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        return GrammarLogitsProcessor(matcher, self.vocab)
