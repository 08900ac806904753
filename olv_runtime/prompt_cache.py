"""Saving and restoring a generation state (a prompt cache, like llama.cpp's ``--prompt-cache``).

A state file is a numpy ``.npz`` archive (``allow_pickle=False``) holding

* ``__header__``: UTF-8 JSON — ``format`` ("olv-state"), ``version`` (1), ``model_digest``
  (:func:`model_digest` of the model it was made with), ``tokens`` / ``cached_tokens``
  (:attr:`State.tokens`, :attr:`State.cached_tokens`), ``rng`` (the PCG64 state of the sampling
  generator, or null) and ``values`` (the bound input names, in binding order);
* one array per persistently bound input (the retained KV cache tensors ``[B, KVH, T, D]``,
  exactly the retained values).

Only tensor state values are supported (the contiguous KV cache); a paged cache (struct
values) is refused with a clear error. Files are written to a temporary name and renamed, so a
failed save leaves an existing file as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
import weakref
import zipfile
import zlib

import numpy as np

from olv_runtime.errors import OutputError, StateError, StateFileError
from olv_runtime.io import Model, _payload_messages
from olv_runtime.proto import TensorProto

FORMAT = "olv-state"
VERSION = 1
_digests: "weakref.WeakKeyDictionary[Model, str]" = weakref.WeakKeyDictionary()


def model_digest(model) -> str:
    """SHA-256 (hex) identifying a model's content: graph, metadata and every payload byte.

    Hashes the opsets, metadata_props, inputs / outputs / bindings, each node (op, domain,
    inputs, outputs, attributes) and each initializer (its message without the external-data
    location, then its payload bytes). Two conversions of different checkpoints (or weight
    formats, or KV kinds) differ; copying or renaming the model files keeps the digest. The
    whole ModelProto is never serialized (``model_serializations`` stays 0). Cached per loaded
    :class:`Model`.

    Parameters
    ----------
    model : Model, InferenceSession or path

    Returns
    -------
    str
        64 hex digits.
    """
    from olv_runtime.io import as_model
    from olv_runtime.session import InferenceSession

    m = model.model if isinstance(model, InferenceSession) else as_model(model)
    cached = _digests.get(m)
    if cached is not None:
        return cached
    m.check_external_files()  # hashes mapped payloads next: PayloadError, not SIGBUS
    h = hashlib.sha256()
    p, g = m.proto, m.proto.graph

    def put(*parts):
        for part in parts:
            b = part if isinstance(part, (bytes, bytearray, memoryview)) else str(part).encode()
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)

    put("opsets", *(f"{o.domain}:{o.version}" for o in p.opset_import))
    put("meta", *(f"{e.key}={e.value}" for e in p.metadata_props))
    for vi in list(g.input) + list(g.output):
        put("vi", vi.SerializeToString())
    for b in g.persistent_bindings:
        put("binding", b.input_name, b.output_name)
    for st in p.struct_types:
        put("struct", st.SerializeToString())
    for node in g.node:
        put("node", node.domain, node.op_type, *node.input, "->", *node.output)
        for a in node.attribute:
            put(a.SerializeToString())
    for msg in _payload_messages(p):
        if msg.data_location == TensorProto.EXTERNAL:
            bare = type(msg)()
            bare.CopyFrom(msg)
            del bare.external_data[:]
            put("init", bare.SerializeToString())
            h.update(m.payload(msg))
        else:
            put("init", msg.SerializeToString())
    digest = h.hexdigest()
    _digests[m] = digest
    return digest


def check_state_path(path) -> pathlib.Path:
    """Refuse a state file path that cannot be written, before any work is done.

    Parameters
    ----------
    path : path-like
        The ``.npz`` file to write (created or replaced).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    OutputError
        An existing directory or non-regular file, or a parent that is not an existing writable
        directory (state files are written beside their final name and renamed; no directory
        is created). The message names ``path``.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write state file {str(path)!r}: it is an existing directory; "
                          f"pass a file path such as {str(path / 'state.npz')!r}")
    if path.exists() and not path.is_file():
        raise OutputError(f"cannot write state file {str(path)!r}: it exists and is not a "
                          "regular file")
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write state file {str(path)!r}: its directory "
                          f"{str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write state file {str(path)!r}: its directory "
                          f"{str(parent)!r} is not writable")
    return path


def _tensor_values(values, what: str) -> dict:
    """The retained values as arrays; StateError for a struct value (paged KV cache), which the
    state file format does not store."""
    for name, v in values.items():
        if not isinstance(v, np.ndarray):
            raise StateError(
                f"{what}: retained value {name!r} is a {type(v).__name__} (a paged KV cache "
                "struct); only tensor state values (--kv contiguous) can be saved")
    return dict(values)


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
    from olv_runtime.state import empty_cache

    _tensor_values(empty_cache(model), "save_state")


def save_state(state, path) -> pathlib.Path:
    """Write a state (its KV cache and token bookkeeping) to ``path`` (``.npz``).

    Parameters
    ----------
    state : State
        Open; its retained values must be tensors (contiguous KV cache).
    path : path-like

    Returns
    -------
    pathlib.Path

    Raises
    ------
    StateError
        Closed state; struct (paged KV) values, which this format does not store.
    OutputError
        ``path`` cannot be written (see :func:`check_state_path`; also a write that fails,
        e.g. a full disk). The message names ``path``, not the temporary file.
    """
    if state.closed:
        raise StateError("save_state: the state is closed")
    values = state.values
    arrays = {name: np.ascontiguousarray(v)
              for name, v in _tensor_values(values, "save_state").items()}
    path = check_state_path(path)
    header = {
        "format": FORMAT, "version": VERSION, "model_digest": model_digest(state.session),
        "tokens": [int(t) for t in state.tokens], "cached_tokens": int(state.cached_tokens),
        "rng": state.rng.bit_generator.state if state.rng is not None else None,
        "values": list(values),
    }
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write state file {str(path)!r}: {exc.strerror or exc}") \
            from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise OutputError(
                f"cannot write state file {str(path)!r}: {exc.strerror or exc}") from None
        raise
    return path


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
    from olv_runtime.session import InferenceSession
    from olv_runtime.state import make_state

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
    the prefix once, :mod:`olv_runtime.state.kv`); any other state kind is emptied when the
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
    from olv_runtime.state import empty_cache

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
