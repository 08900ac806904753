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
  and the reason at DEBUG level on the ``olv_runtime.structs.compiled`` logger. A miss never changes
  results (the packed form is rebuilt from the same source by the same prepacker).
* :func:`olv_runtime.models.compile.compile_model` (``olv compile``) - writes a model with a device entry for this CPU and
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
  ``DequantizeLinear``, the ``B`` of a ``com.microsoft::MatMulNBits``; olv_runtime.structs.recognize):
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
``olv_runtime.models.compile.compile_model`` records the keys of what it wrote, so the first load is already cheap. The
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
from typing import Iterable

import numpy as np

from olv_runtime.config import digest_cache_dir, digest_cache_key
from olv_runtime.errors import CompiledTensorError, OlvError
from olv_runtime.io import Model, as_model
from olv_runtime.kernels.arena import advise_huge_pages
from olv_runtime.kernels.layouts import (
    PACKED_LAYOUT_VERSION,
    cpu_architecture,
    layout_named,
)
from olv_runtime.proto import (
    CompiledTensorProto,
    DeviceProto,
    EncodedValueProto,
    ModelProto,
    TensorProto,
)
from olv_runtime.structs.catalogue import Catalogue
from olv_runtime.structs.initializers import SUBBYTE, AffineValue, tensor_from_proto
from olv_runtime.structs.recognize import FORM_ATTR, INPUTS_ATTR, SOURCE_ATTR
from olv_runtime.structs.value import resolve_values as resolve

log = logging.getLogger("olv_runtime.structs.compiled")

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

__all__ = ["check_compiled", "CompiledEntries", "source_digest",
           "canonical_parts", "this_device", "DEFAULT_DIGEST_ALGORITHM"]




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
    env = digest_cache_key()
    got = _CACHE_DIRS.get(env, False)
    if got is False:
        got = _CACHE_DIRS[env] = digest_cache_dir()
    return got


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


def _check_devices(devices: list) -> None:
    """Device descriptors: unique metadata keys, no descriptor twice (CompiledTensorError)."""
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


def _check_digest_fields(e: CompiledTensorProto, what: str) -> None:
    """A non-empty digest algorithm and source digest, of the known algorithm's length."""
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


def _payload_bytes(v, what: str) -> int:
    """The byte length of a compiled value's payload: its external ``length`` (with a
    ``location`` and an integer ``offset``) or its inline raw_data (CompiledTensorError when the
    external fields are missing or both forms are set)."""
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
        return nbytes
    return len(v.raw_data)


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
    proto = model.proto
    devices = list(proto.devices)
    entries = list(proto.compiled_tensors)
    if not devices and not entries:
        return {}
    if catalogue is None:
        catalogue = Catalogue(proto.struct_types)
    _check_devices(devices)
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
        _check_digest_fields(e, what)
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
        nbytes = _payload_bytes(v, what)
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
