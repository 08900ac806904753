"""Persisted prepacked weights: seed 004 ``CompiledTensorProto`` / ``DeviceProto``.

A compiled entry is a cache of the packed form a session would build from one graph
initializer (the INT4 row-group layouts of :mod:`olv_runtime.kernels`), never a new semantics:
the graph keeps referencing the initializer, which stays the portable fallback. Three parts:

* :func:`check_compiled` - the checker rules of seed 004 "Validation" (structural, independent of
  the hardware): unique device descriptors and valid indices, unique
  ``(source_name, device, physical type)`` keys, source initializers that exist, non-empty digest
  and algorithm (and a digest of the algorithm's length), exact structured values (a type_ref or
  an inline concrete declaration, never an unconstrained category) whose payload is a whole,
  positive number of records, unique metadata keys. Violations raise
  :class:`~olv_runtime.errors.CompiledTensorError` at session creation (and in ``olv inspect``).
* :class:`CompiledEntries` - the loading rules of seed 004, applied per entry when a session
  prepacks a weight: the source resolves to exactly one initializer; the device is this CPU
  (``type cpu``, :func:`~olv_runtime.kernels.layouts.cpu_architecture`, ``runtime olv_runtime``,
  ``runtime_version`` = :data:`~olv_runtime.kernels.layouts.PACKED_LAYOUT_VERSION`); the physical
  type is a layout this runtime knows and the one the session would build; the fields have the
  shapes and dtypes that layout has for the source's ``[N, K]``; the external payload lies inside
  its file; the digest of the compiled bytes and the source digest match. Any failure is a
  cache miss: the session repacks from the source, counts ``compiled_misses`` and logs the entry
  and the reason at DEBUG level on the ``olv_runtime.compiled`` logger. A miss never changes
  results (the packed form is rebuilt from the same source by the same prepacker).
* :func:`compile_model` (``olv compile``) - writes a model with a device entry for this CPU and
  one entry per prepacked initializer, whose payloads live in one external file
  (``<model>.compiled``) that sessions memory-map (private, copy-on-write: pages are shared
  with the page cache and never written).

Canonical source content and digests
------------------------------------
``source_digest`` = blake2b with a 32-byte digest (``digest_algorithm = "blake2b-256"``, Python's
``hashlib``) over the canonical form of the initializer, which covers its element type, its
dimensions and its content but not its name, external-data location or storage method
(``raw_data``, typed fields, external file give one digest):

* header ``b"olv-canonical/1\\0"``, then little-endian integers;
* dense ``TensorProto``: ``u32 0``, ``i32 elem_type``, ``u32 rank``, ``i64 dims...``, the
  row-major little-endian element bytes (``u64 length`` first);
* affine ``EncodedValueProto``: ``u32 1``, the logical ``elem_type``/rank/dims, ``i32
  storage_type``, ``i64 axis`` (-1 when per-tensor), ``u64 block_size`` (0 when absent), the scale
  as a dense tensor, ``u8 has_zero_point`` and the zero point (unpacked to one byte per value) as
  a dense tensor, then the packed code bytes;
* struct ``EncodedValueProto``: ``u32 2``, the logical type (rank ``u32 0xFFFFFFFF`` when absent),
  the resolved declaration serialized deterministically, then the payload bytes.
* a dense integer initializer that the graph makes a quantized weight of (the ``x`` of a
  ``DequantizeLinear``, the ``B`` of a ``com.microsoft::MatMulNBits``; olv_runtime.recognize):
  ``u32 3``, ``u64 length`` and the operator form as text (op and the attributes that give the
  codes their meaning, e.g. ``DequantizeLinear axis=1 block_size=32 output_dtype=0``), then for
  each input of the weight (codes, scale, zero point) ``u8 0`` when absent, else ``u8 1`` and its
  dense form as above (sub-byte codes as their packed bytes, LSB first). The digest thus covers
  the scale and zero-point initializers too: the packed form depends on them, so changing any of
  them is a digest mismatch (a miss), never a stale hit. ``source_name`` is the codes
  initializer. All parts are views of the model's payloads, so the verified-digest cache below
  applies to them as to any other source.

Deferring the digest comparison (seed 004 "Digest comparison ... may be deferred until load
time"): hashing every source byte at each session creation would read (and make resident) the
very pages a compiled entry exists to avoid, and costs ~0.3 s on a 0.5B model. A successful
comparison is therefore remembered in a per-user cache (``$OLV_CACHE_DIR``, else
``$XDG_CACHE_HOME/olv_runtime``, else ``~/.cache/olv_runtime``; one empty file per verified key).
The key hashes the algorithm, the expected digest, every inline byte of the canonical form, and,
for each part that lies in an external file, the file's real path, device, inode, size,
modification and status-change times (nanoseconds) and the byte range. A changed, replaced,
copied, truncated or rewritten file gets a new key and is hashed in full again (ctime cannot be
set back by a user). Trade-off, stated plainly: a file modified in place while keeping size,
inode, mtime *and* ctime (only possible with root access to the clock or the raw device) would
not be re-hashed. ``OLV_VERIFY_DIGESTS=full`` disables the cache (every load hashes everything);
``compile_model`` records the keys of what it wrote, so the first load is already cheap. The
digest of the compiled bytes (entry metadata ``olv.payload_digest``) is verified the same way.

What the digests protect against, and what not
----------------------------------------------
``olv.payload_digest`` covers a header (``b"olv-payload/2\0"``), the entry's ``source_name``,
``source_digest`` and value ``name``, then the compiled field bytes (:func:`payload_parts`). A
compiled entry is thereby bound to the source it was made from: an entry whose payload was made
for another weight of the same shape (``source_name`` / ``source_digest`` swapped between the
k_proj and v_proj entries of a layer, an entry copied from another model) is a miss, never a hit
with the wrong weights. Together with ``source_digest`` this detects accidental corruption
(a bit flip, truncation, a stale ``.compiled`` file after the source changed, mixed-up entries).
It is **not** an authenticity check: nothing is secret, so whoever can edit the ``.onnx`` can
recompute every digest -- and could as well change the source weights themselves, which are the
model. Trust a compiled model exactly as far as you trust its ``.onnx`` file. Entries written
before version 2 of this cover (``runtime_version`` ``"2"``) are misses by the device's
``runtime_version`` (:data:`~olv_runtime.kernels.layouts.PACKED_LAYOUT_VERSION` ``"3"``).

Source: seed 004 "CompiledTensorProto" (stable contract, DeviceProto, loading rules,
validation); seed 000 "Payload and lifetime contract" (external data).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
import os
import pathlib
import struct
import tempfile
from typing import Any, Iterable

import numpy as np

from olv_runtime.errors import CompiledTensorError, OlvError, OutputError
from olv_runtime.io import Model, as_model, same_file
from olv_runtime.proto import (
    CompiledTensorProto,
    DeviceProto,
    EncodedValueProto,
    ModelProto,
    StructTypeProto,
    TensorProto,
)

log = logging.getLogger("olv_runtime.compiled")

RUNTIME = "olv_runtime"
DEVICE_TYPE = "cpu"
DEFAULT_DIGEST_ALGORITHM = "blake2b-256"
#: digest_algorithm name -> digest size in bytes (hashlib.blake2b with that digest_size).
DIGEST_ALGORITHMS = {"blake2b-256": 32}
#: Entry metadata key: hex digest (entry's digest_algorithm) of the compiled field bytes.
PAYLOAD_DIGEST_KEY = "olv.payload_digest"
_ALIGN = 64
_CANON = b"olv-canonical/1\0"
#: Header of what ``olv.payload_digest`` covers (:func:`payload_parts`). Version 1 (no header)
#: covered the compiled bytes alone; 2 adds the entry's source name, source digest and name.
_PAYLOAD = b"olv-payload/2\0"

__all__ = ["check_compiled", "CompiledEntries", "compile_model", "source_digest",
           "canonical_parts", "this_device", "DEFAULT_DIGEST_ALGORITHM"]


class _HugePageWriter:
    """A file writer that issues only whole 2 MiB writes at 2 MiB-aligned offsets (and the tail
    at close): the page cache then holds the written file in 2 MiB folios, which a session maps
    with 2 MiB pages (fewer TLB misses and page-boundary stops in the per-token weight stream;
    see :mod:`olv_runtime.kernels.arena`). Measured here: a file written in 2 MiB pieces was
    mapped with 2 MiB pages throughout, one written in 1 MiB pieces with none."""

    def __init__(self, raw):
        from olv_runtime.kernels.arena import HUGE_PAGE

        self._raw = raw
        self._size = HUGE_PAGE
        self._buf = bytearray()

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        self._buf += mv
        if len(self._buf) >= self._size:
            whole = len(self._buf) // self._size * self._size
            view = memoryview(self._buf)
            pos = 0
            while pos < whole:
                pos += self._raw.write(view[pos:whole])
            view.release()
            del self._buf[:whole]
        return n

    def close(self) -> None:
        try:
            view = memoryview(self._buf)
            pos = 0
            while pos < len(view):
                pos += self._raw.write(view[pos:])
            view.release()
        finally:
            self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _hasher(algorithm: str):
    size = DIGEST_ALGORITHMS[algorithm]
    return hashlib.blake2b(digest_size=size)


# ------------------------------------------------------------------------------------------------
# canonical source content
# ------------------------------------------------------------------------------------------------
def _find_initializer(proto: ModelProto, name: str) -> list:
    g = proto.graph
    found = [t for t in g.initializer if t.name == name]
    found += [e for e in g.encoded_initializer if e.name == name]
    found += [s for s in g.sparse_initializer if s.values.name == name]
    return found


def _dense_parts(t_type: int, dims, data) -> list:
    dims = [int(d) for d in dims]
    head = struct.pack("<IiI", 0, int(t_type), len(dims)) + struct.pack(f"<{len(dims)}q", *dims)
    arr = np.ascontiguousarray(data)
    return [head + struct.pack("<Q", arr.nbytes), arr.reshape(-1).view(np.uint8)]


def source_name_of(value) -> str:
    """The initializer a compiled entry of ``value`` (a linear weight) names as ``source_name``:
    the codes initializer of a recognized DequantizeLinear / MatMulNBits weight, else the
    value's own name (an encoded initializer)."""
    from olv_runtime.recognize import SOURCE_ATTR

    return getattr(value, SOURCE_ATTR, None) or value.name


def _affine_parts(value, scale_type: int, zp_type: int) -> list:
    head = struct.pack("<IiI", 1, int(value.elem_type), len(value.shape))
    head += struct.pack(f"<{len(value.shape)}q", *value.shape)
    head += struct.pack("<iqQ", int(value.storage_type),
                        -1 if value.axis is None else int(value.axis),
                        0 if value.block_size is None else int(value.block_size))
    parts = [head]
    scale = value.scale
    parts += _dense_parts(scale_type, scale.shape, scale)
    if value.zero_point is None:
        parts.append(b"\0")
    else:
        zp = np.ascontiguousarray(value.zero_point)
        parts.append(b"\1")
        parts += _dense_parts(zp_type, zp.shape, zp)
    parts += [struct.pack("<Q", value.codes.size), value.codes]
    return parts


def canonical_parts(model: Model, name: str, value=None) -> list:
    """The canonical form of initializer ``name`` (see the module docstring) as a list of parts:
    ``bytes`` (small headers, built here) and ``uint8`` arrays (views of the model's payloads:
    nothing is read until the parts are hashed).

    Parameters
    ----------
    model : Model
    name : str
        A dense or encoded initializer of the root graph.
    value : AffineValue or StructValue, optional
        Its validated runtime view (avoids resolving it again).

    Raises
    ------
    CompiledTensorError
        ``name`` is not exactly one dense or encoded initializer.
    """
    from olv_runtime.recognize import FORM_ATTR, INPUTS_ATTR, SOURCE_ATTR
    from olv_runtime.values import SUBBYTE, AffineValue, tensor_from_proto

    index = getattr(model, "_initializer_index", None)
    if index is None:  # name -> messages, built once per model (sources are looked up by name)
        index = {}
        g = model.proto.graph
        for msg in list(g.initializer) + list(g.encoded_initializer):
            index.setdefault(msg.name, []).append(msg)
        for sp in g.sparse_initializer:
            index.setdefault(sp.values.name, []).append(sp)
        model._initializer_index = index
    found = index.get(name, [])
    if len(found) != 1:
        raise CompiledTensorError(
            f"compiled tensor source {name!r}: resolves to {len(found)} initializers, expected "
            "exactly one dense or encoded initializer of the root graph"
        )
    msg = found[0]
    if (isinstance(msg, TensorProto) and isinstance(value, AffineValue)
            and getattr(value, SOURCE_ATTR, None) == name):
        # a weight the graph makes of this initializer and its scale / zero-point initializers
        form = getattr(value, FORM_ATTR)
        parts = [_CANON, struct.pack("<IQ", 3, len(form)), form]
        for iname in getattr(value, INPUTS_ATTR):
            got = index.get(iname, []) if iname else None
            if got is None:
                parts.append(b"\0")
                continue
            if len(got) != 1 or not isinstance(got[0], TensorProto):
                raise CompiledTensorError(
                    f"compiled tensor source {name!r}: input {iname!r} of its quantized weight is "
                    "not exactly one dense initializer of the root graph")
            t = got[0]
            stored = t.data_location == TensorProto.EXTERNAL or t.HasField("raw_data")
            if t.data_type in SUBBYTE:
                if not stored:
                    raise CompiledTensorError(
                        f"compiled tensor source {name!r}: sub-byte initializer {iname!r} is not "
                        "stored as raw bytes (no canonical form)")
                arr = model.payload(t)  # packed codes, LSB first: the canonical content
            else:
                arr = tensor_from_proto(t, model.payload(t) if stored else None)
            parts.append(b"\1")
            parts += _dense_parts(t.data_type, t.dims, arr)
        return parts
    if isinstance(msg, TensorProto):
        payload = None
        if msg.data_location == TensorProto.EXTERNAL or msg.HasField("raw_data"):
            payload = model.payload(msg)
        arr = tensor_from_proto(msg, payload)
        return [_CANON] + _dense_parts(msg.data_type, msg.dims, arr)
    if not isinstance(msg, EncodedValueProto):
        raise CompiledTensorError(f"compiled tensor source {name!r}: sparse initializers are not "
                                  "supported sources")
    want_affine = msg.WhichOneof("layout") == "affine"
    if (value is None or isinstance(value, AffineValue) != want_affine
            or not want_affine and not hasattr(value, "root")):
        # the validated view of the initializer itself (a GGUF Q4_0 struct source reaches the
        # linear as an AffineValue repacked from it: the digest stays that of the source)
        from olv_runtime.structs import resolve

        value = resolve(model).values[name]
    if isinstance(value, AffineValue):
        return [_CANON] + _affine_parts(value, int(msg.affine.scale.data_type),
                                        int(msg.affine.zero_point.data_type))
    # struct-typed
    decl = value.root.declaration
    if value.logical is not None:
        et, dims = value.logical
        head = struct.pack("<IiI", 2, int(et), len(dims)) + struct.pack(f"<{len(dims)}q", *dims)
    else:
        head = struct.pack("<IiI", 2, 0, 0xFFFFFFFF)
    d = decl.SerializeToString(deterministic=True)
    return [_CANON, head, struct.pack("<Q", len(d)), d, struct.pack("<Q", value.payload.size),
            value.payload]


def _hash_parts(parts: Iterable, algorithm: str) -> tuple[bytes, int]:
    h = _hasher(algorithm)
    n = 0
    for p in parts:
        if isinstance(p, (bytes, bytearray)):
            h.update(p)
        else:
            mv = memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8))
            step = 1 << 24
            for i in range(0, len(mv), step):  # bounded chunks
                h.update(mv[i:i + step])
            n += len(mv)
    return h.digest(), n


def payload_parts(source_name: str, source_digest: bytes, value_name: str, parts: list) -> list:
    """What an entry's ``olv.payload_digest`` covers: the header :data:`_PAYLOAD` (format
    version), the entry's ``source_name``, its ``source_digest`` and its value's ``name`` (each
    as ``u64 length`` + bytes), then the compiled field bytes (``parts``).

    The entry's identity is folded in so that an entry made for one weight is a miss for any
    other, even one of the same shape whose ``source_name`` / ``source_digest`` were swapped
    in (issue 26): the payload digest then no longer matches. Not a signature: whoever edits
    the ``.onnx`` can rewrite every digest (and the weights themselves)."""
    def field(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    head = (_PAYLOAD + field(source_name.encode("utf-8", "surrogatepass"))
            + field(bytes(source_digest)) + field(value_name.encode("utf-8", "surrogatepass")))
    return [head] + list(parts)


def source_digest(model, name: str, algorithm: str = DEFAULT_DIGEST_ALGORITHM) -> bytes:
    """The seed 004 ``source_digest`` of initializer ``name`` (canonical form, module docstring).

    Parameters
    ----------
    model : Model, ModelProto or path
    name : str
    algorithm : str
        A key of :data:`DIGEST_ALGORITHMS` (``"blake2b-256"``).

    Returns
    -------
    bytes
        ``DIGEST_ALGORITHMS[algorithm]`` bytes.

    Raises
    ------
    CompiledTensorError
        Unknown algorithm, or ``name`` not exactly one initializer.
    """
    if algorithm not in DIGEST_ALGORITHMS:
        raise CompiledTensorError(
            f"digest algorithm {algorithm!r} is not supported; supported: {sorted(DIGEST_ALGORITHMS)}"
        )
    return _hash_parts(canonical_parts(as_model(model), name), algorithm)[0]


# ------------------------------------------------------------------------------------------------
# deferred digest verification (see the module docstring)
# ------------------------------------------------------------------------------------------------
_CACHE_DIRS: dict = {}


def _cache_dir() -> pathlib.Path | None:
    env = (os.environ.get("OLV_VERIFY_DIGESTS", ""), os.environ.get("OLV_CACHE_DIR"),
           os.environ.get("XDG_CACHE_HOME"))
    got = _CACHE_DIRS.get(env, False)
    if got is False:
        got = _CACHE_DIRS[env] = _find_cache_dir()
    return got


def _find_cache_dir() -> pathlib.Path | None:
    from olv_runtime.errors import env_error

    mode = os.environ.get("OLV_VERIFY_DIGESTS", "").strip().lower()
    if mode == "full":
        return None
    if mode != "":
        raise env_error("OLV_VERIFY_DIGESTS", os.environ["OLV_VERIFY_DIGESTS"],
                        "'full' (hash every payload at every load), unset or empty (the "
                        "default: remember verified files by identity)")
    base = os.environ.get("OLV_CACHE_DIR")
    if base:
        root = pathlib.Path(base)
        # the nearest existing ancestor must be a directory (``/dev/null/x`` can never be made)
        p = root.absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        if not p.is_dir():
            raise env_error("OLV_CACHE_DIR", base, f"a directory or a path creatable as one "
                            f"({str(p)!r} exists and is not a directory)")
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = pathlib.Path(xdg) / "olv_runtime" if xdg else pathlib.Path.home() / ".cache" / "olv_runtime"
    return root / "verified-digests"


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _mapped_ranges(model: Model) -> list:
    out = []
    for path, (_mm, arr) in model._maps.items():
        if arr.size:
            out.append((_addr(arr), arr.size, path))
    out.extend(getattr(model, "_compiled_ranges", []))
    return out


def _identity(path: pathlib.Path, memo: dict | None = None) -> bytes:
    if memo is not None and path in memo:
        return memo[path]
    st = os.stat(path)
    got = repr((str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                st.st_ctime_ns)).encode()
    if memo is not None:
        memo[path] = got
    return got


def _quick_key(model: Model, parts: list, algorithm: str, expected: bytes,
               memo: dict | None = None, ranges: list | None = None) -> str:
    """Key of a verification: inline parts hashed, file-backed parts by file identity + range
    (``memo``: file identities already taken by this caller; ``ranges``: the model's
    :func:`_mapped_ranges`, when the caller has them)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(algorithm.encode() + b"\0" + expected)
    if ranges is None:
        ranges = _mapped_ranges(model)
    for p in parts:
        if isinstance(p, (bytes, bytearray)):
            h.update(b"b" + struct.pack("<Q", len(p)))
            h.update(p)
            continue
        addr, size = _addr(p), p.nbytes
        for base, length, path in ranges:
            if base <= addr and addr + size <= base + length:
                h.update(b"f" + _identity(path, memo) + struct.pack("<QQ", addr - base, size))
                break
        else:
            h.update(b"b" + struct.pack("<Q", size))
            h.update(memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8)))
    return h.hexdigest()


def _verified(key: str, d=False) -> bool:
    if d is False:
        d = _cache_dir()
    # os.path on a string: one stat per entry at session creation, without pathlib's objects
    return d is not None and os.path.exists(os.path.join(str(d), key[:2], key))


def _remember(key: str, d=False) -> None:
    if d is False:
        d = _cache_dir()
    if d is None:
        return
    try:
        (d / key[:2]).mkdir(parents=True, exist_ok=True)
        (d / key[:2] / key).touch()
    except OSError:  # an unwritable cache only costs a full hash next time
        pass


def verify_digest(model: Model, parts: list, algorithm: str, expected: bytes,
                  counters=None, memo: dict | None = None, ranges: list | None = None,
                  directory=False) -> bool:
    """True when the digest of ``parts`` equals ``expected`` (cached verification, see module
    docstring). Bytes hashed are added to the ``bytes_digest_verified`` counter. ``memo``,
    ``ranges`` and ``directory`` (the verified-digest cache, :func:`_cache_dir`) let a caller
    checking many entries take file identities, the model's mapped ranges and the environment
    once."""
    key = _quick_key(model, parts, algorithm, expected, memo, ranges)
    if _verified(key, directory):
        return True
    got, n = _hash_parts(parts, algorithm)
    if counters is not None:
        counters.add("bytes_digest_verified", n)
    if got != expected:
        return False
    _remember(key, directory)
    return True


# ------------------------------------------------------------------------------------------------
# checker (seed 004 "Validation")
# ------------------------------------------------------------------------------------------------
def _unique_keys(entries, where: str) -> None:
    seen = set()
    for e in entries:
        if e.key in seen:
            raise CompiledTensorError(f"{where}: metadata key {e.key!r} appears more than once")
        seen.add(e.key)


def _device_key(d: DeviceProto) -> tuple:
    return (d.type, d.index if d.HasField("index") else None, d.architecture, d.runtime,
            d.runtime_version, tuple(sorted((e.key, e.value) for e in d.metadata_props)))


def physical_type(entry: CompiledTensorProto) -> tuple:
    """The physical type of an entry's value: ``("type_id", id)`` or ``("inline", name)``."""
    st = entry.value.struct_type
    if st.WhichOneof("kind") == "type_ref":
        return ("type_id", int(st.type_ref))
    return ("inline", st.name)


def check_compiled(model: Model, catalogue=None) -> dict:
    """Apply the seed 004 checker rules to ``ModelProto.devices`` / ``compiled_tensors``.

    Parameters
    ----------
    model : Model
    catalogue : Catalogue, optional
        The model's resolved struct catalogue (built when omitted).

    Returns
    -------
    dict
        Entry index -> resolved :class:`~olv_runtime.structs.catalogue.RootType` of its value.

    Raises
    ------
    CompiledTensorError
        Duplicate device descriptors or metadata keys; a device index out of range; duplicate
        ``(source_name, device, physical type)`` keys; a source that is not exactly one
        initializer; an empty digest or algorithm, or a digest whose length is not the known
        algorithm's; a value that is not an exact structured value (affine, no layout,
        unconstrained category, unresolved type), or whose payload is not a whole positive
        number of records (inline length or external ``length``).
    """
    from olv_runtime.structs.catalogue import Catalogue

    proto = model.proto
    devices = list(proto.devices)
    entries = list(proto.compiled_tensors)
    if not devices and not entries:
        return {}
    if catalogue is None:
        catalogue = Catalogue(proto.struct_types)
    seen_dev: dict = {}
    for i, d in enumerate(devices):
        _unique_keys(d.metadata_props, f"device {i} ({d.type!r}, {d.architecture!r})")
        key = _device_key(d)
        if key in seen_dev:
            raise CompiledTensorError(
                f"devices {seen_dev[key]} and {i} are the same descriptor ({d.type!r}, "
                f"{d.architecture!r}, {d.runtime!r} {d.runtime_version!r}); device descriptors "
                "must be unique"
            )
        seen_dev[key] = i
    names = {}
    g = proto.graph
    for t in g.initializer:
        names[t.name] = names.get(t.name, 0) + 1
    for e in g.encoded_initializer:
        names[e.name] = names.get(e.name, 0) + 1
    keys: dict = {}
    roots: dict = {}
    resolved_types: dict = {}
    for i, e in enumerate(entries):
        what = f"compiled tensor {i} (source {e.source_name!r})"
        _unique_keys(e.metadata_props, what)
        if not 0 <= e.device < len(devices):
            raise CompiledTensorError(
                f"{what}: device index {e.device} is out of range (the model has "
                f"{len(devices)} devices)"
            )
        if not e.source_name:
            raise CompiledTensorError(f"{what}: source_name is empty")
        count = names.get(e.source_name, 0)
        if count != 1:
            raise CompiledTensorError(
                f"{what}: source_name resolves to {count} initializers of the root graph, "
                "expected exactly one"
            )
        if not e.digest_algorithm:
            raise CompiledTensorError(f"{what}: digest_algorithm is empty")
        if not e.source_digest:
            raise CompiledTensorError(f"{what}: source_digest is empty")
        size = DIGEST_ALGORITHMS.get(e.digest_algorithm)
        if size is not None and len(e.source_digest) != size:
            raise CompiledTensorError(
                f"{what}: source_digest has {len(e.source_digest)} bytes, {e.digest_algorithm} "
                f"digests have {size}"
            )
        if not e.HasField("value"):
            raise CompiledTensorError(f"{what}: value is missing")
        v = e.value
        layout = v.WhichOneof("layout")
        if layout != "struct_type":
            raise CompiledTensorError(
                f"{what}: value must be an exact structured value (struct_type), got "
                f"{layout or 'no layout'}"
            )
        if v.struct_type.WhichOneof("kind") is None:
            raise CompiledTensorError(
                f"{what}: value struct_type is an unconstrained category (no kind); a compiled "
                "value needs a type_ref or an inline concrete declaration"
            )
        key_bytes = v.struct_type.SerializeToString(deterministic=True)
        root = resolved_types.get(key_bytes)
        if root is None:  # layers repeat the same few declarations: resolve each once
            try:
                root = catalogue.root(v.struct_type, what)
            except OlvError as exc:
                raise CompiledTensorError(f"{what}: value type does not resolve: {exc}") from None
            resolved_types[key_bytes] = root
        _unique_keys(root.declaration.metadata_props, f"{what} value type")
        rb = root.record_bytes
        if v.data_location == TensorProto.EXTERNAL:
            ext = {x.key: x.value for x in v.external_data}
            if v.HasField("raw_data"):
                raise CompiledTensorError(f"{what}: raw_data and external_data are both set")
            try:
                nbytes = int(ext["length"])
                int(ext.get("offset", "0"))
            except (KeyError, ValueError):
                raise CompiledTensorError(
                    f"{what}: an external compiled payload needs 'location' and an integer "
                    f"'length' (got {sorted(ext)})"
                ) from None
            if not ext.get("location"):
                raise CompiledTensorError(f"{what}: external payload without 'location'")
        else:
            nbytes = len(v.raw_data)
        if nbytes <= 0 or nbytes % rb:
            raise CompiledTensorError(
                f"{what}: payload of {nbytes} bytes is not a whole positive number of "
                f"{rb}-byte records of {root.describe()}"
            )
        key = (e.source_name, int(e.device), physical_type(e))
        if key in keys:
            raise CompiledTensorError(
                f"{what}: same cache key (source {e.source_name!r}, device {e.device}, physical "
                f"type {key[2][1]!r}) as compiled tensor {keys[key]}"
            )
        keys[key] = i
        roots[i] = root
    return roots


# ------------------------------------------------------------------------------------------------
# loading rules
# ------------------------------------------------------------------------------------------------
def this_device() -> DeviceProto:
    """The DeviceProto of this CPU for olv_runtime's packed layouts."""
    from olv_runtime.kernels.layouts import PACKED_LAYOUT_VERSION, cpu_architecture

    return DeviceProto(type=DEVICE_TYPE, architecture=cpu_architecture(), runtime=RUNTIME,
                       runtime_version=PACKED_LAYOUT_VERSION)


@dataclasses.dataclass
class EntryStatus:
    """Use of one compiled entry by a session (``olv inspect`` prints these).

    ``status`` is ``"hit"`` (used), ``"miss"`` (rebuilt from the source; ``reason`` says why) or
    ``"unused"`` (the session does not prepack this source, or a sibling of a merged weight
    missed so the group was repacked).
    """

    index: int
    source_name: str
    device: int
    device_text: str
    physical_type: str
    status: str = "unused"
    reason: str = ""


class CompiledEntries:
    """A session's view of the model's compiled entries (loading rules of seed 004).

    Parameters
    ----------
    model : Model
    roots : dict
        From :func:`check_compiled`.
    counters : Counters, optional
        ``compiled_hits``, ``compiled_misses``, ``bytes_digest_verified``.
    """

    def __init__(self, model: Model, roots: dict, counters=None):
        self.model = model
        self.counters = counters
        self.roots = roots
        proto = model.proto
        self.entries = list(proto.compiled_tensors)
        self.devices = list(proto.devices)
        self.status: list[EntryStatus] = []
        self.by_source: dict[str, list[int]] = {}
        dev_text = [f"{d.type}:{d.architecture} {d.runtime} {d.runtime_version}"
                    for d in self.devices]
        for i, e in enumerate(self.entries):
            kind, ident = physical_type(e)
            self.status.append(EntryStatus(
                i, e.source_name, int(e.device), dev_text[e.device],
                ident if kind == "inline" else f"type_id {ident}"))
            self.by_source.setdefault(e.source_name, []).append(i)
        self._here = this_device()
        # one private mapping per compiled file and model (shared by its sessions)
        self._maps: dict = model.__dict__.setdefault("_compiled_maps", {})
        self._stat: dict = {}  # file identities, taken once per session
        self._paths: dict = {}  # location -> resolved compiled payload file
        self._why: dict = {}  # device index -> device-rule miss reason (None: compatible)
        self._dir = _cache_dir()  # verified-digest cache, read from the environment once
        self._ranges: tuple = (None, None)  # (number of mapped files, _mapped_ranges)
        self._plans: dict = {}  # checked field plans (_field_plan)

    # -- per-entry rules ---------------------------------------------------------------------
    def _miss(self, i: int, reason: str) -> None:
        st = self.status[i]
        st.status, st.reason = "miss", reason
        if self.counters is not None:
            self.counters.add("compiled_misses", 1)
        log.debug("compiled tensor %d (source %r, device %d): cache miss: %s", i,
                  st.source_name, st.device, reason)

    def _device_rule(self, d: DeviceProto) -> str | None:
        here = self._here
        if d.type != here.type:
            return f"device type {d.type!r} is not {here.type!r}"
        if d.architecture != here.architecture:
            return f"architecture {d.architecture!r} is not this CPU's {here.architecture!r}"
        if d.runtime != here.runtime:
            return f"runtime {d.runtime!r} is not {here.runtime!r}"
        if d.runtime_version != here.runtime_version:
            return (f"runtime_version {d.runtime_version!r} is not this runtime's packed-layout "
                    f"version {here.runtime_version!r}")
        for e in d.metadata_props:
            if e.key.startswith("olv.require."):
                return f"required device metadata {e.key!r} is not known to this runtime"
        return None

    def _mapped(self) -> list:
        """The model's mapped ranges (recomputed when a file was mapped since)."""
        n = len(self.model._maps) + len(getattr(self.model, "_compiled_ranges", ()))
        if self._ranges[0] != n:
            self._ranges = (n, _mapped_ranges(self.model))
        return self._ranges[1]

    def _map(self, path: pathlib.Path):
        got = self._maps.get(path)
        if got is None:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                size = st.st_size
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            stamps = getattr(self.model, "_stamps", None)
            if stamps is not None:  # checked before every run like the other mapped files
                stamps[path] = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
            got = self._maps[path] = (mm, size)
            if mm is not None:
                base = np.frombuffer(mm, np.uint8)
                from olv_runtime.kernels.arena import advise_huge_pages

                advise_huge_pages(base)  # read from disk: 2 MiB folios (the decode stream)
                ranges = getattr(self.model, "_compiled_ranges", None)
                if ranges is None:
                    ranges = self.model._compiled_ranges = []
                ranges.append((_addr(base), base.size, path))
                self.model._compiled_keepalive = getattr(self.model, "_compiled_keepalive", [])
                self.model._compiled_keepalive.append((mm, base))
        return got

    def _payload(self, v: EncodedValueProto, rb: int):
        """(buffer, offset, nbytes) of the compiled payload, or a miss reason string."""
        if v.data_location != TensorProto.EXTERNAL:
            raw = v.raw_data
            return (np.frombuffer(raw, np.uint8) if raw else None, 0, len(raw))
        ext = {x.key: x.value for x in v.external_data}
        location, offset, length = ext["location"], int(ext.get("offset", "0")), int(ext["length"])
        full = self._paths.get(location)
        if full is None:
            base = self.model.base_dir
            if base is None:
                return ("the model was not loaded from a file (no directory for the compiled "
                        "payload)")
            rel = pathlib.PurePosixPath(location.replace("\\", "/"))
            try:
                full = (base / rel).resolve()
            except (OSError, RuntimeError, ValueError) as exc:
                return f"compiled payload location {location!r} cannot be resolved: {exc}"
            if rel.is_absolute() or base not in full.parents:
                return f"compiled payload location {location!r} is not inside the model directory"
            if not full.is_file():
                return f"compiled payload file {location!r} not found"
            self._paths[location] = full
        mm, size = self._map(full)
        if offset < 0 or offset + length > size:
            return (f"compiled payload [{offset}, {offset + length}) lies past the end of "
                    f"{location!r} ({size} bytes): truncated")
        return (mm, offset, length)

    def _field_plan(self, root, lay, source) -> tuple | str:
        """(ints, [(array name, dtype, shape, byte offset in the record)]) of a physical type
        for ``source``'s shape, or a miss reason. The checks depend only on the declaration,
        the layout and the source's [N, K] / zero point / scale dtype: entries sharing them
        (the same linear of every layer) are checked once per session."""
        layout = root.layout
        n, k = source.shape
        key = (id(layout), lay.name, n, k, source.zero_point is not None,
               np.dtype(source.scale.dtype).str)
        got = self._plans.get(key)
        if got is not None and got[0] is layout:  # (the id of a live declaration)
            return got[1]
        ints = {}
        plan = None
        for name in lay.ints:
            c = layout.constant(name)
            if c is None or c.value.size != 1:
                plan = f"physical type {lay.name!r} has no scalar constant field {name!r}"
                break
            ints[name] = int(c.value.reshape(-1)[0])
        if plan is None and (ints.get("n"), ints.get("k")) != (n, k):
            plan = (f"compiled entry is for [N, K] = [{ints.get('n')}, {ints.get('k')}], the "
                    f"source {source.name!r} is [{n}, {k}]")
        if plan is None:
            want = lay.shapes(n, k, source.zero_point is not None, source.scale.dtype)
            fields = []
            for name in lay.arrays:
                leaf = layout.leaf(name)
                dt, shape = want[name]
                dt, shape = np.dtype(dt), tuple(shape)
                if leaf is None:
                    plan = f"physical type {lay.name!r} has no field {name!r}"
                    break
                if leaf.dtype != dt or tuple(leaf.shape) != shape or not leaf.byte_aligned():
                    plan = (f"field {name!r} is {leaf.dtype}{list(leaf.shape)}, the layout "
                            f"needs {dt}{list(shape)} for [N, K] = [{n}, {k}]")
                    break
                fields.append((name, dt, shape, leaf.offset // 8))
            else:
                plan = (ints, fields)
        self._plans[key] = (layout, plan)
        return plan

    def _fields(self, i: int, root, lay, source) -> tuple | str:
        """(packed part, {array: (buffer, offset)}, hashed parts) or a miss reason."""
        e = self.entries[i]
        got = self._payload(e.value, root.record_bytes)
        if isinstance(got, str):
            return got
        buf, off0, nbytes = got
        if nbytes != root.record_bytes:
            return (f"compiled payload has {nbytes} bytes, the olv layouts store one record of "
                    f"{root.record_bytes} bytes")
        plan = self._field_plan(root, lay, source)
        if isinstance(plan, str):
            return plan
        ints, fields = plan
        arrays, where, parts = {}, {}, []
        for name, dt, shape, rel in fields:
            off = off0 + rel
            if dt.itemsize and off % dt.alignment:
                return f"field {name!r} at byte {off} is not {dt.alignment}-byte aligned"
            if buf is None or 0 in shape:
                arr = np.zeros(shape, dt)
            else:
                arr = np.ndarray(shape, dtype=dt, buffer=buf, offset=off)
            # read-only, as the session's own repacks are (fusion.LinearStep._repack): the
            # kernels are then compiled and cached for one array type (numba types a read-only
            # array apart from a writeable one), shared by plain and compiled models
            arr.flags.writeable = False
            arrays[name] = arr
            where[name] = (buf, off)
            parts.append(arr)
        return lay.build(arrays, ints), where, parts

    def lookup(self, source, layout_name: str):
        """The packed part for ``source`` (an AffineValue) in layout ``layout_name`` from a valid
        compiled entry, or None (every candidate entry that fails a loading rule is a miss).

        Returns
        -------
        tuple or None
            ``(entry index, packed object, {array name: (buffer, byte offset)})``.
        """
        from olv_runtime.kernels.layouts import layout_named

        sname = source_name_of(source)
        cands = self.by_source.get(sname, [])
        for i in cands:
            e = self.entries[i]
            dev = int(e.device)
            why = self._why.get(dev, False)
            if why is False:
                why = self._why[dev] = self._device_rule(self.devices[dev])
            if why is not None:
                self._miss(i, why)
                continue
            root = self.roots[i]
            pname = root.declaration.name
            lay = layout_named(pname)
            if lay is None:
                self._miss(i, f"unknown physical type {pname!r} (this runtime packs "
                              f"{layout_name!r})")
                continue
            if lay.name != layout_name:
                self._miss(i, f"physical type {pname!r} is not the layout this session builds "
                              f"for the source ({layout_name!r})")
                continue
            if e.digest_algorithm not in DIGEST_ALGORITHMS:
                self._miss(i, f"digest algorithm {e.digest_algorithm!r} is not supported "
                              f"(supported: {sorted(DIGEST_ALGORITHMS)})")
                continue
            got = self._fields(i, root, lay, source)
            if isinstance(got, str):
                self._miss(i, got)
                continue
            packed, where, parts = got
            meta = {m.key: m.value for m in e.metadata_props}
            pd = meta.get(PAYLOAD_DIGEST_KEY)
            if pd is None:
                self._miss(i, f"no {PAYLOAD_DIGEST_KEY!r} metadata (digest of the compiled bytes)")
                continue
            try:
                want = bytes.fromhex(pd)
            except ValueError:
                self._miss(i, f"{PAYLOAD_DIGEST_KEY!r} is not a hex digest")
                continue
            covered = payload_parts(e.source_name, e.source_digest, e.value.name, parts)
            if not verify_digest(self.model, covered, e.digest_algorithm, want, self.counters,
                                 self._stat, self._mapped(), self._dir):
                self._miss(i, "the digest of the compiled bytes does not match "
                              f"{PAYLOAD_DIGEST_KEY} (corrupted payload, or an entry made for "
                              "another source: the digest covers the entry's source name, "
                              "source digest and name)")
                continue
            try:
                sparts = canonical_parts(self.model, sname, source)
            except CompiledTensorError as exc:
                self._miss(i, str(exc))
                continue
            if not verify_digest(self.model, sparts, e.digest_algorithm, e.source_digest,
                                 self.counters, self._stat, self._mapped(), self._dir):
                self._miss(i, "source_digest does not match the initializer (stale entry: the "
                              "source tensor changed)")
                continue
            st = self.status[i]
            st.status, st.reason = "hit", ""
            if self.counters is not None:
                self.counters.add("compiled_hits", 1)
            return i, packed, where
        return None

    def release(self, hits: list) -> None:
        """Mark entries that were valid but not used (a sibling of their merged weight missed)."""
        for i in hits:
            st = self.status[i]
            st.status, st.reason = "unused", "a sibling of this merged weight missed; repacked"
            if self.counters is not None:
                self.counters.add("compiled_hits", -1)

    def report(self) -> list[EntryStatus]:
        """Status of every entry (after the session's preparation)."""
        return list(self.status)


def packed_from_entries(entries: CompiledEntries | None, weights: list, layout_name: str,
                        counters=None):
    """The packed weight of a (possibly merged) linear from compiled entries, or None.

    Every weight must hit; merged weights are concatenated along N as one zero-copy view of the
    compiled file when the parts are adjacent there (``olv compile`` writes them so), else copied
    (``bytes_copied_other``).
    """
    if entries is None:
        return None
    from olv_runtime.kernels.layouts import layout_named

    lay = layout_named(layout_name)
    if lay is None:
        return None
    hits, parts, wheres, missed = [], [], [], False
    for w in weights:  # every member is evaluated, so that each entry's status is reported
        got = entries.lookup(w, layout_name)
        if got is None:
            missed = True
            continue
        hits.append(got[0])
        parts.append(got[1])
        wheres.append(got[2])
    if missed:
        entries.release(hits)
        return None
    if len(parts) == 1:
        return parts[0]
    if any(p.n % lay.rows_per_group for p in parts[:-1]):
        entries.release(hits)
        for i in hits:
            entries.status[i].reason = (f"merged rows are not multiples of {lay.rows_per_group}; "
                                        "repacked")
        return None
    arrays = {}
    for name in lay.arrays:
        arrs = [getattr(p, name) for p in parts]
        buf0, off0 = wheres[0][name]
        adjacent = buf0 is not None and all(
            wheres[j][name][0] is buf0 and
            wheres[j][name][1] == wheres[j - 1][name][1] + arrs[j - 1].nbytes
            for j in range(1, len(parts)))
        shape = (sum(a.shape[0] for a in arrs),) + arrs[0].shape[1:]
        if adjacent and all(a.shape[1:] == arrs[0].shape[1:] for a in arrs):
            arrays[name] = np.ndarray(shape, dtype=arrs[0].dtype, buffer=buf0, offset=off0)
        else:
            arrays[name] = np.concatenate(arrs, axis=0)
            if counters is not None:
                counters.add("bytes_copied_other", arrays[name].nbytes)
        arrays[name].flags.writeable = False  # one kernel specialisation (see _fields)
    return lay.concat_rows(parts, arrays)


# ------------------------------------------------------------------------------------------------
# writing (olv compile)
# ------------------------------------------------------------------------------------------------
class CompileWarning(UserWarning):
    """``olv compile`` wrote its output but dropped something or replaced a file (the message
    says what and why)."""


@dataclasses.dataclass
class CompileReport:
    """What :func:`compile_model` wrote.

    ``carried``: other devices' entries whose payload bytes were copied into the new payload
    file; ``dropped``: ``(source_name, device, reason)`` of other devices' entries left out (their
    payload could not be read); ``sidecars``: sidecar files copied beside the output."""

    path: pathlib.Path
    compiled_path: pathlib.Path
    entries: int
    bytes: int
    device: str
    skipped: list
    carried: int = 0
    dropped: list = dataclasses.field(default_factory=list)
    sidecars: list = dataclasses.field(default_factory=list)


_ROLE_TEXT = {"model": "the model file", "data": "an external data file",
              "compiled": "the compiled payload file"}
_OUT_TEXT = {"model": "model file", "data": "data file", "compiled": "payload file",
             "sidecar": "sidecar"}


def _external_locations(graph) -> set:
    """``location`` of every external payload in a graph (initializers, encoded values and their
    scales / zero points, sparse values, attributes and subgraphs)."""
    locs, stack = set(), [graph]
    while stack:
        msg = stack.pop()
        for fd, value in msg.ListFields():
            if fd.name == "external_data":
                locs.update(e.value for e in value if e.key == "location")
            elif fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
                if fd.is_repeated:
                    stack.extend(value)
                else:
                    stack.append(value)
    return locs


def _input_files(m: Model) -> list:
    """``(role, resolved path)`` of every file ``m`` reads: ``model``, ``data`` (external data,
    also any file already mapped) and ``compiled`` (payload files of its compiled entries)."""
    if m.path is None:
        return []
    files = [("model", m.path)]
    base = m.base_dir

    def add(role, loc):
        try:
            files.append((role, (base / pathlib.PurePosixPath(loc.replace("\\", "/"))).resolve()))
        except (OSError, RuntimeError, ValueError):
            pass

    for loc in sorted(_external_locations(m.proto.graph)):
        add("data", loc)
    for e in m.proto.compiled_tensors:
        if e.value.data_location == TensorProto.EXTERNAL:
            loc = {x.key: x.value for x in e.value.external_data}.get("location")
            if loc:
                add("compiled", loc)
    files += [("data", p) for p in m._maps]
    files += [("compiled", p) for p in getattr(m, "_compiled_maps", {})]
    seen, out = set(), []
    for f in files:
        if f not in seen:
            seen.add(f)
            out.append(f)
    return out


def _check_outputs(m: Model, out: pathlib.Path, keep_external: bool) -> None:
    """Refuse, before any work, an output whose model, ``.data``, ``.compiled`` or sidecar
    file would be a file the input model reads (resolved path or same inode), unless it is the
    same file in the same role of an in-place compile (atomically replaced: the input is
    replaced as a whole); and outputs that cannot be written (directories)."""
    from olv_runtime.models.qwen import check_output_path
    from olv_runtime.sidecars import SIDECAR_FILES

    check_output_path(out, (), "output")
    targets = [("model", out), ("data", out.with_name(out.name + ".data")),
               ("compiled", out.with_name(out.name + ".compiled"))]
    for _role, t in targets[1:]:
        if t.is_dir():
            raise OutputError(f"cannot write {str(t)!r} (written with the output model "
                              f"{str(out)!r}): it is an existing directory")
    targets += [("sidecar", out.parent / n) for n in SIDECAR_FILES]
    inplace = m.path is not None and same_file(out, m.path)
    inputs = _input_files(m)
    for role_t, t in targets:
        for role_f, f in inputs:
            if not same_file(t, f):
                continue
            if inplace and role_t == role_f and not (role_t == "data" and keep_external):
                continue  # replaced atomically, with the input model that reads it
            raise OutputError(
                f"the output's {_OUT_TEXT[role_t]} {str(t)!r} would overwrite {_ROLE_TEXT[role_f]} "
                f"{str(f)!r} of the input model {str(m.path)!r}: refusing, nothing was written "
                "(choose another output path)")


def _plan_sidecars(m: Model, out: pathlib.Path, warn) -> dict:
    """The input model's own sidecars (tokenizer.json, ...) to copy beside ``out``: name ->
    bytes. Files already there with the same bytes (or the same file) are not copied; a
    different file another model in that folder records is refused (as ``olv convert`` does);
    any other different file is replaced with a warning."""
    from olv_runtime.errors import SidecarError
    from olv_runtime.sidecars import SIDECAR_FILES, check_replacements, sidecar_path

    if m.path is None:
        return {}
    files, replaced = {}, []
    for name in SIDECAR_FILES:
        try:
            src = sidecar_path(m, name)
        except SidecarError as exc:
            warn(f"sidecar {name} not copied: {exc}")
            continue
        if src is None:
            continue
        dst = out.parent / name
        if same_file(dst, src):
            continue
        data = src.read_bytes()
        if dst.exists() or dst.is_symlink():
            if not dst.is_file():
                raise OutputError(f"cannot write sidecar {str(dst)!r}: it exists and is not a "
                                  "regular file")
            if dst.read_bytes() == data:
                continue
            replaced.append(name)
        files[name] = data
    if replaced:
        check_replacements(out, {n: files[n] for n in replaced})
        warn(f"replaced {', '.join(replaced)} in {str(out.parent)!r} with the input model's "
             f"(they differed; no other model in that folder records them)")
    return files


def _kept_range(m: Model, v) -> tuple | str:
    """``(file, offset, length)`` of another device's external compiled payload, or the reason
    it cannot be carried into the new payload file."""
    ext = {x.key: x.value for x in v.external_data}
    location = ext.get("location", "")
    try:
        offset, length = int(ext.get("offset", "0")), int(ext["length"])
    except (KeyError, ValueError):
        return "its payload has no valid offset / length"
    if m.base_dir is None:
        return "the input model was not loaded from a file (no directory for its payload file)"
    rel = pathlib.PurePosixPath(location.replace("\\", "/"))
    try:
        full = (m.base_dir / rel).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"payload location {location!r} cannot be resolved: {exc}"
    if rel.is_absolute() or m.base_dir not in full.parents:
        return f"payload location {location!r} is not inside the model directory"
    if offset < 0 or length <= 0:
        return f"payload range offset {offset} length {length} is invalid"
    if not full.is_file():
        return f"payload file {location!r} not found"
    return full, offset, length


def _carry_kept(m: Model, kept: list, fh, offset: int, cname: str, devices) -> tuple:
    """Copy the external payloads of other devices' entries ``kept`` into ``fh`` (the new
    payload file, at ``offset``) and point the entries at it. Overlapping or touching byte
    ranges of one file (the records of a merged weight share bytes) are copied once, as one
    piece at the same offset modulo the alignment: the records keep their relative layout.
    Regular reads, never the model's mappings. Returns ``(entries carried, dropped, new
    offset)``; ``dropped``: ``(source_name, device, reason)``."""
    carried, dropped, spans = [], [], {}
    for e2 in kept:
        v = e2.value
        if v.data_location != TensorProto.EXTERNAL:
            carried.append(e2)
            continue
        got = _kept_range(m, v)
        if isinstance(got, str):
            d = devices[e2.device]
            dropped.append((e2.source_name, f"{d.type}:{d.architecture}", got))
            continue
        spans.setdefault(got[0], []).append((got[1], got[2], e2))
    for full, items in spans.items():
        items.sort(key=lambda t: t[0])
        groups, cur = [], None
        for off, n, e2 in items:
            if cur is not None and off <= cur[1]:
                cur[1] = max(cur[1], off + n)
                cur[2].append((off, n, e2))
            else:
                cur = [off, off + n, [(off, n, e2)]]
                groups.append(cur)
        try:
            fsrc = open(full, "rb")
        except OSError as exc:
            for _o, _n, e2 in items:
                d = devices[e2.device]
                dropped.append((e2.source_name, f"{d.type}:{d.architecture}",
                                f"payload file {full.name!r} cannot be read "
                                f"({exc.strerror or exc})"))
            continue
        with fsrc:
            for g0, g1, members in groups:
                fsrc.seek(g0)
                data = fsrc.read(g1 - g0)
                ok = [(o, n, e2) for o, n, e2 in members if o + n <= g0 + len(data)]
                for o, n, e2 in members:
                    if o + n > g0 + len(data):
                        d = devices[e2.device]
                        dropped.append((e2.source_name, f"{d.type}:{d.architecture}",
                                        f"payload [{o}, {o + n}) lies past the end of "
                                        f"{full.name!r} (truncated)"))
                if not ok:
                    continue
                p = (g0 - offset) % _ALIGN
                if p:
                    fh.write(b"\0" * p)
                    offset += p
                fh.write(data)
                for o, n, e2 in ok:
                    v = e2.value
                    del v.external_data[:]
                    v.external_data.add(key="location", value=cname)
                    v.external_data.add(key="offset", value=str(offset + o - g0))
                    v.external_data.add(key="length", value=str(n))
                    carried.append(e2)
                offset += len(data)
    order = {id(e2): i for i, e2 in enumerate(kept)}
    carried.sort(key=lambda e2: order[id(e2)])
    return carried, dropped, offset


def _entry_type(lay, arrays: list, gaps: list, ints: dict) -> StructTypeProto:
    from olv_runtime.structs.build import const_field, field, structure, tensor
    from olv_runtime.values import DTYPE_TO_ONNX

    fields = []
    for j, (name, arr) in enumerate(arrays):
        if gaps[j]:
            fields.append(field(f"gap{j}", tensor(TensorProto.UINT8, [gaps[j]])))
        fields.append(field(name, tensor(DTYPE_TO_ONNX[arr.dtype.newbyteorder("=")],
                                         list(arr.shape))))
    for name, v in ints.items():
        fields.append(const_field(name, np.array(v, np.int64)))
    st = structure(*fields)
    st.name = lay.name
    st.doc_string = ("olv_runtime prepacked weight (kernels/layouts.py); runtime-specific, no "
                     "decoder: the source initializer is the portable form")
    return st


def compile_model(model, out_path, *, options=None, progress=None) -> CompileReport:
    """Write ``out_path``: the model plus a device entry for this CPU and one compiled entry per
    prepacked initializer (seed 004), payloads in ``<out name>.compiled`` beside it.

    The source initializers are kept (external data in ``<out name>.data``, scales included, so
    that a session using the entries never parses or touches them). Entries already in the model
    for other devices are kept, their payload bytes copied into the new payload file (an entry
    whose payload cannot be read is dropped with a :class:`CompileWarning`); those for this
    device are replaced. The input model's sidecars (``tokenizer.json``, ...) are copied beside
    the output when it is written to another folder.

    Nothing is written until everything is ready: the files are written to temporary names and
    renamed into place at the end (on a failure the temporary files are removed and existing
    files stay as they were).

    Parameters
    ----------
    model : Model, ModelProto or path
    out_path : path-like
        Destination ``.onnx``. May equal the input path (its files are replaced atomically);
        otherwise the output model, its ``.data``, ``.compiled`` and sidecar files must not be
        any file the input model reads.
    options : SessionOptions, optional
        Session options whose packing is persisted (default options).
    progress : callable, optional
        ``progress(str)`` messages.

    Returns
    -------
    CompileReport

    Raises
    ------
    OutputError
        An output file would overwrite a file the input model reads (its model file, external
        data or compiled payload file); an output path is a directory, its parent is not a
        directory, or a file cannot be written (the message names it). Nothing is written.
    OlvError
        The model does not validate or cannot run (the session's errors).
    """
    from olv_runtime.fusion import LinearStep
    from olv_runtime.kernels.layouts import layout_of
    from olv_runtime.session import InferenceSession, SessionOptions

    import warnings

    from olv_runtime.io import commit_staged, discard_staged, stage_save

    m = as_model(model)
    out = pathlib.Path(out_path)
    # a converted GGUF file references the .gguf in place: keep those references when they
    # resolve from the output's folder (never copy the GGUF's tensors into a .data file)
    gguf_here = (m.metadata().get("olv.source") == "gguf" and m.path is not None
                 and out.parent.resolve() == m.path.parent.resolve())
    _check_outputs(m, out, gguf_here)

    def warn(msg):
        warnings.warn(msg, CompileWarning, stacklevel=3)

    sidecars = _plan_sidecars(m, out, warn)
    opts = dataclasses.replace(options or SessionOptions(), use_compiled=False)
    sess = InferenceSession(m, opts)
    created = []  # folders made for the output (removed again on failure)
    parent = out.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None
    cname = out.name + ".compiled"
    here = this_device()
    proto = ModelProto()
    proto.CopyFrom(m.proto)
    # keep other devices' entries, drop this device's
    old_devices = list(proto.devices)
    keep = [e for e in proto.compiled_tensors
            if _device_key(old_devices[e.device]) != _device_key(here)]
    devices = [d for d in old_devices if _device_key(d) != _device_key(here)]
    remap = {_device_key(d): i for i, d in enumerate(devices)}
    del proto.devices[:]
    proto.devices.extend(devices)
    kept = []
    for e in keep:
        e2 = CompiledTensorProto()
        e2.CopyFrom(e)
        e2.device = remap[_device_key(old_devices[e.device])]
        kept.append(e2)
    dev_index = len(devices)
    proto.devices.add().CopyFrom(here)
    del proto.compiled_tensors[:]
    skipped, dropped, carried = [], [], []
    written = 0
    staged: list = []
    pending = []
    used_sources: set = set()
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".olv-", suffix=".compiled")
        staged.append((tmp, out.parent / cname))
        with _HugePageWriter(os.fdopen(fd, "wb", buffering=0)) as fh:
            offset = 0

            def pad_to(align):
                nonlocal offset
                p = (-offset) % align
                if p:
                    fh.write(b"\0" * p)
                    offset += p

            for step in sess.all_steps():
                lin = step.impl
                if not isinstance(lin, LinearStep):
                    if step.kind.endswith("Linear"):
                        skipped.append((step.name, f"{step.kind} weights are repacked at session "
                                                   "creation and have no persisted layout"))
                    continue
                if lin.packed is None:
                    continue
                lay = layout_of(lin.packed)
                if lay is None:
                    skipped.append((step.name, f"packed class {type(lin.packed).__name__} has "
                                               "no persisted layout"))
                    continue
                ws = lin.weights
                if any(w.shape[0] % lay.rows_per_group for w in ws[:-1]):
                    skipped.append((step.name, f"merged rows not multiples of "
                                               f"{lay.rows_per_group}"))
                    continue
                snames = [source_name_of(w) for w in ws]
                bad = [n for n in snames if n in used_sources
                       or len(_find_initializer(m.proto, n)) != 1]
                if bad:
                    skipped.append((step.name, f"source {bad[0]!r} is not exactly one "
                                               "initializer of the root graph, or is the source "
                                               "of another compiled weight"))
                    continue
                try:
                    sdigests = [_hash_parts(canonical_parts(m, sn, w), DEFAULT_DIGEST_ALGORITHM)[0]
                                for sn, w in zip(snames, ws)]
                except CompiledTensorError as exc:
                    skipped.append((step.name, str(exc)))
                    continue
                used_sources.update(snames)
                arrays, _ints = lay.parts(lin.packed)
                if (arrays.get("scale") is not None and arrays["scale"].dtype == np.uint16
                        and all(np.asarray(w.scale).dtype == np.float32 for w in ws)):
                    # float32 scales the session stored as float16 (all exact, see
                    # decoder_stack._narrow_scales): persisted as the source's float32 values
                    arrays["scale"] = arrays["scale"].view(np.float16).astype(np.float32)
                # per-weight parts: slices along the row-group axis
                bounds, g0 = [], 0
                for w in ws:
                    g1 = g0 + -(-w.shape[0] // lay.rows_per_group)
                    bounds.append((g0, g1))
                    g0 = g1
                starts = {}  # (array, weight index) -> file offset
                for name in lay.arrays:
                    a = arrays[name]
                    pad_to(_ALIGN)
                    for j, (a0, a1) in enumerate(bounds):
                        part = np.ascontiguousarray(a[a0:a1]) if a.shape[0] else a
                        starts[(name, j)] = (offset, part)
                        b = part.reshape(-1).view(np.uint8) if part.size else b""
                        fh.write(memoryview(b) if part.size else b"")
                        offset += part.nbytes
                for j, w in enumerate(ws):
                    fields, gaps, pos, hashed = [], [], None, []
                    for name in lay.arrays:
                        o, part = starts[(name, j)]
                        if pos is None:
                            first, pos = o, o
                        gaps.append(o - pos)
                        fields.append((name, part))
                        hashed.append(part)
                        pos = o + part.nbytes
                    length = pos - first
                    st = _entry_type(lay, fields, gaps, {"n": w.shape[0], "k": w.shape[1]})
                    e = CompiledTensorProto(source_name=snames[j], device=dev_index,
                                            digest_algorithm=DEFAULT_DIGEST_ALGORITHM)
                    e.source_digest = sdigests[j]
                    v = e.value
                    v.name = f"{snames[j]}/compiled"
                    pdig = _hash_parts(payload_parts(snames[j], sdigests[j], v.name, hashed),
                                       DEFAULT_DIGEST_ALGORITHM)[0]
                    e.metadata_props.add(key=PAYLOAD_DIGEST_KEY, value=pdig.hex())
                    v.struct_type.CopyFrom(st)
                    v.data_location = TensorProto.EXTERNAL
                    v.external_data.add(key="location", value=cname)
                    v.external_data.add(key="offset", value=str(first))
                    v.external_data.add(key="length", value=str(length))
                    proto.compiled_tensors.append(e)
                    pending.append(snames[j])
                    written += 1
                if progress is not None:
                    progress(f"compiled {step.name}: {lay.name}, {len(ws)} entr"
                             f"{'y' if len(ws) == 1 else 'ies'}")
            # other devices' entries: their payload bytes follow, at the same offset modulo
            # the alignment (their fields' alignment holds), in the new payload file
            carried, dropped, offset = _carry_kept(m, kept, fh, offset, cname, proto.devices)
            total = offset
        os.chmod(tmp, 0o644)
        new_entries = list(proto.compiled_tensors)
        del proto.compiled_tensors[:]
        proto.compiled_tensors.extend(carried + new_entries)
        # payloads resolved as in m; scales external too (views of the file, never parsed)
        staged += stage_save(Model(proto, m.path), out, external_data=True,
                             external_params=True, keep_external=gguf_here)
        umask = os.umask(0)
        os.umask(umask)
        for name, data in sidecars.items():
            fd2, tmp2 = tempfile.mkstemp(dir=out.parent, prefix=".olv-", suffix=".sidecar")
            staged.append((tmp2, out.parent / name))
            with os.fdopen(fd2, "wb") as fh2:
                fh2.write(data)
            os.chmod(tmp2, 0o666 & ~umask)
        # the model file last: a reader never sees the new model with old payload files
        staged.sort(key=lambda st: pathlib.Path(st[1]) == out)
        commit_staged(staged)
    except OSError as exc:
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"cannot write {str(out)!r}: {exc.strerror or exc}"
                          + (f" ({exc.filename})" if getattr(exc, "filename", None) else "")
                          ) from None
    finally:
        discard_staged(staged)
        if not out.exists():
            for d in created:  # folders made for a write that failed (only if still empty)
                try:
                    d.rmdir()
                except OSError:
                    break
    if dropped:
        warn(f"dropped {len(dropped)} compiled entr{'y' if len(dropped) == 1 else 'ies'} of "
             f"other devices whose payload could not be carried into {cname}: "
             f"{dropped[0][0]!r} ({dropped[0][1]}): {dropped[0][2]}"
             + (f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""))
    # record the verifications of what was just written (the first load is then cheap too):
    # one session on the written model checks every entry under the loading rules
    from olv_runtime.io import load

    InferenceSession(load(out), opts.__class__(**{**dataclasses.asdict(opts),
                                                  "use_compiled": True}))
    return CompileReport(out, out.parent / cname, written, total,
                         f"{here.type}:{here.architecture}", skipped, len(carried), dropped,
                         sorted(sidecars))
