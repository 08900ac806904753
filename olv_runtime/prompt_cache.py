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

import numpy as np

from olv_runtime.errors import StateError, StateFileError
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
    """
    if state.closed:
        raise StateError("save_state: the state is closed")
    values = state.values
    arrays = {}
    for name, v in values.items():
        if not isinstance(v, np.ndarray):
            raise StateError(
                f"save_state: retained value {name!r} is a {type(v).__name__} (a paged KV cache "
                "struct); only tensor state values (--kv contiguous) can be saved")
        arrays[name] = np.ascontiguousarray(v)
    header = {
        "format": FORMAT, "version": VERSION, "model_digest": model_digest(state.session),
        "tokens": [int(t) for t in state.tokens], "cached_tokens": int(state.cached_tokens),
        "rng": state.rng.bit_generator.state if state.rng is not None else None,
        "values": list(values),
    }
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def load_state(model, path):
    """Restore a state written by :func:`save_state` (or :meth:`State.save`).

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
        Not a state file, an unsupported version, missing arrays, or a file made for another
        model (the two digests are in the message).
    InvalidArgument
        Saved arrays that do not fit the model's bound inputs.
    """
    from olv_runtime.session import InferenceSession
    from olv_runtime.state import make_state

    path = pathlib.Path(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise StateFileError(f"{path}: not a readable state file ({exc})") from None
    with archive:
        if "__header__" not in archive.files:
            raise StateFileError(f"{path}: not an olv state file (no __header__ entry)")
        try:
            header = json.loads(archive["__header__"].tobytes().decode())
        except ValueError as exc:
            raise StateFileError(f"{path}: malformed state header ({exc})") from None
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise StateFileError(
                f"{path}: format {header.get('format')!r} version {header.get('version')!r}; "
                f"expected {FORMAT!r} version {VERSION}")
        session = model if isinstance(model, InferenceSession) else InferenceSession(model)
        want = model_digest(session)
        if header.get("model_digest") != want:
            raise StateFileError(
                f"{path} was saved for another model: its model digest is "
                f"{header.get('model_digest')}, this model's is {want}")
        missing = [n for n in header["values"] if n not in archive.files]
        if missing:
            raise StateFileError(f"{path}: missing arrays {missing}")
        initial = {n: archive[n] for n in header["values"]}
    state = make_state(session, initial)
    state.tokens = [int(t) for t in header["tokens"]]
    state.cached_tokens = int(header["cached_tokens"])
    if header.get("rng") is not None:
        rng = np.random.default_rng()
        rng.bit_generator.state = header["rng"]
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
