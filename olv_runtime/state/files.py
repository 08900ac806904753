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

Loading never trusts the file's sizes (issue 26): numpy's loader is not used. The archive must
be a regular file (opened without blocking: a FIFO is refused) and a zip archive whose members
are stored uncompressed (so no declared size can exceed the file's); each ``.npy`` header is
parsed by :func:`olv_runtime.io.read_npy_header` (numpy's exact form, no recursion) and checked
against the model's bound inputs (dtype, rank, fixed dims, one KV length equal to
``cached_tokens``) before its array is allocated.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
import weakref

import numpy as np

from olv_runtime.errors import OutputError, StateError
from olv_runtime.executor.session import InferenceSession
from olv_runtime.io import Model, _payload_messages, as_model
from olv_runtime.proto import TensorProto

FORMAT = "olv-state"
VERSION = 1
#: Largest ``__header__`` member accepted (its JSON: token ids, rng, value names), bytes.
HEADER_MAX_BYTES = 64 << 20
#: Most members an archive may list (save_state writes one per bound input plus the header).
MEMBERS_MAX = 4096
_READ_CHUNK = 1 << 24
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
