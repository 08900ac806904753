"""Restoring a saved generation state and reusing a state's KV prefix (the load side of
:mod:`olv_runtime.state.files`, like llama.cpp's ``--prompt-cache``).

* :func:`load_state` - a :class:`~olv_runtime.state.state.State` from a ``.npz`` state file, after
  checking its header, its arrays and the model digest.
* :func:`trim_state` - keep the longest common prefix of a state's tokens and new prompt ids.
* :func:`check_saveable` - refuse, before any work, a model whose state cannot be saved.
"""
from __future__ import annotations

import json
import pathlib
import zipfile
import zlib

import numpy as np

from olv_runtime.errors import StateFileError
from olv_runtime.executor.session import InferenceSession
from olv_runtime.state.files import FORMAT, VERSION, _tensor_values, model_digest
from olv_runtime.state.state import empty_cache, make_state


def check_saveable(model) -> None:
    """Refuse a model whose state cannot be saved (its bound inputs are not all tensors: a
    paged KV cache), before any work is done.

    Parameters
    ----------
    model : Model, InferenceSession or path

    Raises
    ------
    StateError
        A bound input whose empty value is a struct (``--kv paged*`` models).
    """
    _tensor_values(empty_cache(model), "save_state")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_header(header, path: pathlib.Path, vocab) -> tuple[list[int], int, list[str]]:
    """The header's ``tokens``, ``cached_tokens`` and ``values``, checked (StateFileError naming
    the field, expected vs got)."""
    if not isinstance(header, dict):
        raise StateFileError(f"{path}: the state header is not a JSON object "
                             f"(got {type(header).__name__})")
    missing = [k for k in ("tokens", "cached_tokens", "values") if k not in header]
    if missing:
        raise StateFileError(f"{path}: the state header lacks {missing}")
    tokens, cached, names = header["tokens"], header["cached_tokens"], header["values"]
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise StateFileError(f"{path}: header 'tokens' must be a list of integer token ids, "
                             f"got {str(tokens)[:80]!r}")
    bad = [t for t in tokens if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise StateFileError(f"{path}: header 'tokens' must be token ids in {limit}, "
                             f"got {bad[0]}")
    if not _is_int(cached) or not 0 <= cached <= len(tokens):
        raise StateFileError(
            f"{path}: header 'cached_tokens' must be an integer in [0, len(tokens)] = "
            f"[0, {len(tokens)}], got {cached!r}")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise StateFileError(f"{path}: header 'values' must be a list of value names, "
                             f"got {str(names)[:80]!r}")
    return tokens, cached, names


def _saved_kv_length(initial: dict, path: pathlib.Path) -> int | None:
    """The positions held by the saved KV tensors (``[B, KVH, T, D]``: T), the same in every
    one; None when there is no 4-D tensor."""
    lengths = {n: int(a.shape[2]) for n, a in initial.items() if a.ndim == 4}
    if len(set(lengths.values())) > 1:
        raise StateFileError(f"{path}: the saved KV tensors hold different numbers of positions "
                             f"({lengths})")
    return next(iter(lengths.values()), None)


def load_state(model, path):
    """Restore a state written by :func:`save_state` (or :meth:`State.save`).

    The header is checked against the arrays: ``tokens`` a list of ids in ``[0, vocab)``,
    ``0 <= cached_tokens <= len(tokens)`` and the KV tensors holding exactly ``cached_tokens``
    positions (a file whose history and cache disagree would continue with wrong logits).

    Parameters
    ----------
    model : Model, InferenceSession or path
        The model the file was made with (an existing session is reused).
    path : path-like

    Returns
    -------
    State
        A new open state whose KV cache and ``tokens`` are the saved ones; ``generate(...,
        state=...)`` continues it.

    Raises
    ------
    StateFileError
        Not a readable state file (missing, a directory, truncated or corrupt archive), an
        unsupported version, a header lacking or with malformed ``tokens`` / ``cached_tokens``
        / ``values`` / ``rng``, missing arrays, a KV cache whose length differs from
        ``cached_tokens``, or a file made for another model (the two digests are in the
        message).
    InvalidArgument
        Saved arrays that do not fit the model's bound inputs.
    """
    path = pathlib.Path(path)
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
    try:
        archive = np.load(path, allow_pickle=False)
    except unreadable as exc:
        raise StateFileError(f"{path}: not a readable state file ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise StateFileError(f"{path}: not a state file (a bare .npy array, not an .npz archive)")
    with archive:
        if "__header__" not in archive.files:
            raise StateFileError(f"{path}: not an olv state file (no __header__ entry)")
        try:
            header = json.loads(archive["__header__"].tobytes().decode())
        except unreadable as exc:
            raise StateFileError(f"{path}: malformed state header ({exc})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT \
                or header.get("version") != VERSION:
            got = (header.get("format"), header.get("version")) if isinstance(header, dict) \
                else (None, None)
            raise StateFileError(
                f"{path}: format {got[0]!r} version {got[1]!r}; "
                f"expected {FORMAT!r} version {VERSION}")
        session = model if isinstance(model, InferenceSession) else InferenceSession(model)
        want = model_digest(session)
        if header.get("model_digest") != want:
            raise StateFileError(
                f"{path} was saved for another model: its model digest is "
                f"{header.get('model_digest')}, this model's is {want}")
        vocab = session.get_modelmeta().get("olv.vocab_size")
        tokens, cached, names = _check_header(header, path,
                                              int(vocab) if vocab is not None else None)
        missing = [n for n in names if n not in archive.files]
        if missing:
            raise StateFileError(f"{path}: missing arrays {missing}")
        try:
            initial = {n: archive[n] for n in names}
        except unreadable as exc:
            raise StateFileError(f"{path}: a saved array cannot be read ({exc})") from None
    held = _saved_kv_length(initial, path)
    if held is not None and held != cached:
        raise StateFileError(
            f"{path}: the saved KV cache holds {held} positions but the header's cached_tokens "
            f"is {cached} (of {len(tokens)} tokens); the file is inconsistent")
    rng = None
    if header.get("rng") is not None:
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = header["rng"]
        except (TypeError, ValueError, KeyError) as exc:
            raise StateFileError(f"{path}: header 'rng' is not a PCG64 generator state "
                                 f"({type(exc).__name__}: {exc})") from None
    state = make_state(session, initial)
    state.tokens = list(tokens)
    state.cached_tokens = cached
    state.rng = rng
    return state


def trim_state(state, ids, *, leave_one: bool = True) -> int:
    """Keep the longest prefix of the state's cached tokens that ``ids`` starts with.

    A contiguous KV cache is cut back to that prefix (views, no copy; the next append copies
    the prefix once, :mod:`olv_runtime.kv.contiguous`); any other state kind is emptied when the
    prefix is shorter than what it holds. ``state.tokens`` becomes that prefix.

    Parameters
    ----------
    state : State
    ids : sequence of int
        The token sequence about to be processed.
    leave_one : bool
        Keep at most ``len(ids) - 1`` tokens, so the caller still feeds one (it needs its
        logits).

    Returns
    -------
    int
        The number of leading ``ids`` whose KV is reused; feed ``ids[n:]`` next.
    """
    ids = [int(t) for t in ids]
    limit = min(len(ids) - (1 if leave_one else 0), state.cached_tokens)
    n = 0
    while n < limit and state.tokens[n] == ids[n]:
        n += 1
    if n == state.cached_tokens == len(state.tokens):
        return n
    values = state.values
    if n and all(isinstance(v, np.ndarray) and v.ndim == 4 for v in values.values()):
        state.reset({k: v[:, :, :n] for k, v in values.items()})
    else:
        n = 0
        state.reset(empty_cache(state.session))
    state.tokens, state.cached_tokens = ids[:n], n
    return n
