"""Restoring a saved generation state and reusing a state's KV prefix (the load side of
:mod:`olv_runtime.state.files`, like llama.cpp's ``--prompt-cache``).

* :func:`load_state` - a :class:`~olv_runtime.state.state.State` from a ``.npz`` state file, after
  checking, before anything is inflated or allocated, each member's compressed and declared sizes
  and its ``.npy`` header against what the model expects, then the model digest.
* :func:`trim_state` - keep the longest common prefix of a state's tokens and new prompt ids.
* :func:`check_saveable` - refuse, before any work, a model whose state cannot be saved.
"""
from __future__ import annotations

import json
import os
import pathlib
import stat
import zipfile
import zlib

import numpy as np

from olv_runtime.errors import InvalidArgument, StateError, StateFileError
from olv_runtime.executor.session import InferenceSession
from olv_runtime.io import read_npy_header
from olv_runtime.state.files import (
    FORMAT,
    HEADER_MAX_BYTES,
    MEMBERS_MAX,
    VERSION,
    _READ_CHUNK,
    _tensor_values,
    model_digest,
)
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


def _saved_kv_length(shapes: dict, path: pathlib.Path) -> int | None:
    """The positions held by the saved KV tensors (name -> shape ``[B, KVH, T, D]``: T), the
    same in every one; None when there is no 4-D tensor."""
    lengths = {n: int(s[2]) for n, s in shapes.items() if len(s) == 4}
    if len(set(lengths.values())) > 1:
        raise StateFileError(f"{path}: the saved KV tensors hold different numbers of positions "
                             f"({lengths})")
    return next(iter(lengths.values()), None)


def _open_archive(path: pathlib.Path) -> tuple:
    """``(zipfile.ZipFile, size)`` of a state file, checked before anything is inflated: a
    regular file (opened without blocking, so a FIFO is refused, never waited on) that starts
    as a zip archive does, with at most :data:`MEMBERS_MAX` members."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise StateFileError(f"{path}: not a readable state file ({exc.strerror or exc})") \
            from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
            raise StateFileError(f"{path}: not a readable state file (it is {kind})")
    except BaseException:
        os.close(fd)
        raise
    fh = os.fdopen(fd, "rb")
    try:
        magic = fh.read(6)
        if magic == b"\x93NUMPY":
            raise StateFileError(
                f"{path}: not a state file (a bare .npy array, not an .npz archive)")
        if magic[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
            raise StateFileError(
                f"{path}: not a state file: not a readable state file written by save_state "
                f"(not a zip archive; first bytes {magic[:4]!r})")
        fh.seek(0)
        try:
            zf = zipfile.ZipFile(fh)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error,
                NotImplementedError) as exc:
            raise StateFileError(f"{path}: not a readable state file (corrupt zip archive: "
                                 f"{exc})") from None
    except BaseException:
        fh.close()
        raise
    if len(zf.infolist()) > MEMBERS_MAX:
        zf.close()
        raise StateFileError(f"{path}: the archive lists {len(zf.infolist())} members; a state "
                             f"file has at most {MEMBERS_MAX}")
    return zf, st.st_size


def _member(zf: zipfile.ZipFile, name: str, path: pathlib.Path, size: int, limit: int):
    """Open member ``name`` (``name.npy``) and read its ``.npy`` header, checking the zip
    entry before a byte is inflated: stored uncompressed (save_state never compresses, so every
    declared size is bounded by the file's), its declared size within ``limit`` and the file,
    and equal to the header plus the data the header declares. Returns ``(stream, dtype,
    shape, nbytes)``."""
    try:
        info = zf.getinfo(name + ".npy")
    except KeyError:
        raise StateFileError(f"{path}: missing array {name!r}") from None
    what = f"{path}: member {info.filename!r}"
    if info.compress_type != zipfile.ZIP_STORED:
        raise StateFileError(
            f"{what} is compressed (zip method {info.compress_type}); state files store their "
            "arrays uncompressed (save_state), a compressed member is not inflated")
    if info.compress_size != info.file_size or info.file_size > size:
        raise StateFileError(
            f"{what} declares {info.file_size} bytes ({info.compress_size} stored) in a file of "
            f"{size} bytes")
    if info.file_size > limit:
        raise StateFileError(f"{what} declares {info.file_size} bytes; at most {limit} expected")
    try:
        fh = zf.open(info)
        dtype, shape, nbytes = read_npy_header(fh, what, StateFileError)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        if isinstance(exc, StateFileError):
            raise
        raise StateFileError(f"{what} cannot be read ({exc})") from None
    if fh.tell() + nbytes != info.file_size:
        raise StateFileError(
            f"{what}: its .npy header declares {shape} {dtype} ({nbytes} bytes of data), the "
            f"member holds {info.file_size - fh.tell()} bytes of data")
    return fh, dtype, shape, nbytes


def _read_data(fh, dtype, shape, nbytes: int, what: str) -> np.ndarray:
    """The member's data into one array allocated at its checked size (bounded chunks; the
    zip CRC is checked at the end)."""
    arr = np.empty(shape, dtype)
    view = memoryview(arr.reshape(-1).view(np.uint8)) if nbytes else memoryview(b"")
    pos = 0
    try:
        while pos < nbytes:
            chunk = fh.read(min(_READ_CHUNK, nbytes - pos))
            if not chunk:
                raise StateFileError(f"{what}: truncated ({pos} of {nbytes} bytes)")
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        if nbytes == 0:
            fh.read(1)  # reach the end: the CRC check
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        if isinstance(exc, StateFileError):
            raise
        raise StateFileError(f"{what}: a saved array cannot be read ({exc})") from None
    return arr


def _check_rng(rng, path: pathlib.Path) -> None:
    """The header's ``rng``: numpy's PCG64 state dict, every integer in its range (checked
    before numpy sees it: a value such as ``2**300`` is an error here, not an OverflowError)."""
    def bad(why):
        return StateFileError(f"{path}: header 'rng' is not a PCG64 generator state ({why})")

    if not isinstance(rng, dict) or rng.get("bit_generator") != "PCG64":
        raise bad(f"bit_generator {rng.get('bit_generator') if isinstance(rng, dict) else rng!r}"
                  [:120])
    if set(rng) != {"bit_generator", "state", "has_uint32", "uinteger"}:
        raise bad(f"keys {sorted(rng)[:8]}, expected bit_generator, state, has_uint32, "
                  "uinteger")
    st = rng["state"]
    if not isinstance(st, dict) or set(st) != {"state", "inc"}:
        raise bad("'state' must be an object with 'state' and 'inc'")
    for key, v, hi in (("state.state", st["state"], 1 << 128), ("state.inc", st["inc"], 1 << 128),
                       ("has_uint32", rng["has_uint32"], 2), ("uinteger", rng["uinteger"], 1 << 32)):
        if not _is_int(v) or not 0 <= v < hi:
            raise bad(f"{key} must be an integer in [0, 2**{hi.bit_length() - 1}), got "
                      f"{str(v)[:40]}")


def _expected_arrays(session, names: list, cached: int, path: pathlib.Path) -> dict:
    """name -> (dtype, ndim, {axis: size}) each saved array must have, from the model's empty
    cache: the element type, the rank, every fixed dim after the batch dim (the sequence dims,
    symbolic, are checked against ``cached`` by the caller)."""
    try:
        empty = empty_cache(session)
    except (InvalidArgument, StateError) as exc:
        raise StateFileError(f"{path}: the model's state cannot be restored ({exc})") from None
    unknown = [n for n in names if n not in empty]
    if unknown or len(set(names)) != len(names) or set(names) != set(empty):
        raise StateFileError(
            f"{path}: the saved values are {names[:8]}, the model binds {sorted(empty)[:8]}")
    out = {}
    for n in names:
        e = empty[n]
        if not isinstance(e, np.ndarray):
            raise StateFileError(f"{path}: the model's value {n!r} is a struct (a paged KV "
                                 "cache); state files store tensors only")
        fixed = {i: int(d) for i, d in enumerate(e.shape) if i > 0 and d}
        out[n] = (e.dtype, e.ndim, fixed)
    return out


def load_state(model, path):
    """Restore a state written by :func:`save_state` (or :meth:`State.save`).

    The file is checked before anything in it is inflated or allocated: a regular file (a FIFO
    is refused, never waited on) and a zip archive; each member stored uncompressed with
    declared sizes bounded by the file's; the ``__header__`` member at most
    :data:`HEADER_MAX_BYTES`; every ``.npy`` header parsed without numpy's parser and checked
    against what the model expects (dtype, rank, every fixed dim, ``cached_tokens`` positions)
    before its array is allocated. The header is checked against the arrays: ``tokens`` a list
    of ids in ``[0, vocab)``, ``0 <= cached_tokens <= len(tokens)`` and the KV tensors holding
    exactly ``cached_tokens`` positions (a file whose history and cache disagree would continue
    with wrong logits); ``rng`` a PCG64 state with every integer in range.

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
        Not a state file (not a zip archive, a bare ``.npy``), not a readable one (missing, a
        directory or FIFO, truncated or corrupt archive, a compressed member or declared sizes
        beyond the file, a ``.npy`` header not of numpy's form), an unsupported version, a
        header lacking or with malformed ``tokens`` / ``cached_tokens`` / ``values`` / ``rng``
        (nesting too deep included), missing arrays or arrays whose dtype or shape the model
        does not expect, a KV cache whose length differs from ``cached_tokens``, or a file made
        for another model (the two digests are in the message).
    InvalidArgument
        Saved arrays that do not fit the model's bound inputs.
    """
    path = pathlib.Path(path)
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, RecursionError)
    zf, size = _open_archive(path)
    with zf:
        fh, dtype, shape, nbytes = _member(zf, "__header__", path, size, HEADER_MAX_BYTES)
        if dtype != np.uint8 or len(shape) != 1:
            raise StateFileError(f"{path}: the __header__ member is {dtype}{list(shape)}, "
                                 "expected a 1-D uint8 array (UTF-8 JSON)")
        raw = _read_data(fh, dtype, shape, nbytes, f"{path}: member '__header__.npy'")
        try:
            header = json.loads(raw.tobytes().decode())
        except unreadable as exc:
            raise StateFileError(f"{path}: malformed state header "
                                 f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT \
                or header.get("version") != VERSION:
            got = (header.get("format"), header.get("version")) if isinstance(header, dict) \
                else (None, None)
            raise StateFileError(
                f"{path}: format {str(got[0])[:80]!r} version {str(got[1])[:80]!r}; "
                f"expected {FORMAT!r} version {VERSION}")
        session = model if isinstance(model, InferenceSession) else InferenceSession(model)
        want = model_digest(session)
        if header.get("model_digest") != want:
            raise StateFileError(
                f"{path} was saved for another model: its model digest is "
                f"{str(header.get('model_digest'))[:80]}, this model's is {want}")
        vocab = session.get_modelmeta().get("olv.vocab_size")
        tokens, cached, names = _check_header(header, path,
                                              int(vocab) if vocab is not None else None)
        if header.get("rng") is not None:
            _check_rng(header["rng"], path)
        expect = _expected_arrays(session, names, cached, path)
        members = {}
        for n in names:
            fh, dtype, shape, nbytes = _member(zf, n, path, size, size)
            edt, endim, fixed = expect[n]
            bad = [i for i, d in fixed.items() if i < len(shape) and shape[i] != d]
            if dtype != edt or len(shape) != endim or bad or (endim and shape[0] < 1):
                want_shape = ["B"] + [fixed.get(i, "T") for i in range(1, endim)] if endim \
                    else []
                raise StateFileError(
                    f"{path}: saved array {n!r} is {dtype}{list(shape)}; the model expects "
                    f"{edt}{want_shape} (B >= 1 sequences, T positions)")
            members[n] = (fh, dtype, shape, nbytes)
        batches = {n: m[2][0] for n, m in members.items() if m[2]}
        if len(set(batches.values())) > 1:
            raise StateFileError(f"{path}: the saved arrays have different batch sizes "
                                 f"({batches})")
        held = _saved_kv_length({n: m[2] for n, m in members.items()}, path)
        if held is not None and held != cached:
            raise StateFileError(
                f"{path}: the saved KV cache holds {held} positions but the header's "
                f"cached_tokens is {cached} (of {len(tokens)} tokens); the file is inconsistent")
        initial = {n: _read_data(*m, f"{path}: member {n + '.npy'!r}")
                   for n, m in members.items()}
    rng = None
    if header.get("rng") is not None:
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = header["rng"]
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
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
