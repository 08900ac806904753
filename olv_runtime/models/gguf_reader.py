"""A bounded reader of GGUF files (llama.cpp's model format): header, metadata, tensor infos.

Layout (GGUF specification, ggml ``docs/gguf.md``; versions 2 and 3, little-endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x       { key: string, value_type u32, value }
    n_tensors x  { name: string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64 }
    padding to general.alignment (default 32)
    tensor data  (each tensor at data_start + offset, offset a multiple of the alignment)

    string = { length u64, utf-8 bytes }      array = { elem_type u32, count u64, elements }

Every length, count and offset is checked against the bytes that remain in the file *before*
anything is allocated or read, so a hostile file fails fast with a
:class:`~olv_runtime.errors.GGUFFormatError` (a ``ModelFormatError``) naming the field, the value
and the limit, and nothing outside the file is ever read. (gguf-py's ``GGUFReader`` 0.19 trusts
these fields: a 43-byte file declaring an array of 2^63 elements makes it allocate without bound.)

Checked: magic, version (2 or 3), counts, string and array lengths (against the remaining bytes),
nested array depth, value types, UTF-8 keys and strings, duplicate keys, ``general.alignment``
(a power of two), ``n_dims`` (1..4, ``GGML_MAX_DIMS``), dimensions (>= 1, element count and byte
size without int64 overflow), ``ne[0]`` a multiple of the block size, known ggml type, offset
alignment, tensor extent inside the file, duplicate tensor names, overlapping tensors.

The tensor data is memory-mapped read-only and returned as ``uint8`` views
(:meth:`GGUFFile.tensor_bytes`); the reader never copies it.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np

from olv_runtime.errors import GGUFFormatError

__all__ = ["GGUFFile", "GGUFTensorInfo", "GGML_TYPES", "GGML_MAX_DIMS", "read_gguf"]

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 4
_INT64_MAX = (1 << 63) - 1

#: ggml tensor types this reader knows: id -> (name, block size in elements, block bytes).
#: Source: ggml ``ggml.h`` ``enum ggml_type`` and ``ggml.c`` ``type_traits`` (the same table as
#: gguf-py's ``GGML_QUANT_SIZES``, which the tests compare against).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
}

# GGUF metadata value types: id -> (name, struct format or None, size in bytes)
_VT_UINT8, _VT_INT8, _VT_UINT16, _VT_INT16, _VT_UINT32, _VT_INT32, _VT_FLOAT32, _VT_BOOL, \
    _VT_STRING, _VT_ARRAY, _VT_UINT64, _VT_INT64, _VT_FLOAT64 = range(13)
_SCALARS = {
    _VT_UINT8: ("UINT8", "<B", "u1"), _VT_INT8: ("INT8", "<b", "i1"),
    _VT_UINT16: ("UINT16", "<H", "<u2"), _VT_INT16: ("INT16", "<h", "<i2"),
    _VT_UINT32: ("UINT32", "<I", "<u4"), _VT_INT32: ("INT32", "<i", "<i4"),
    _VT_FLOAT32: ("FLOAT32", "<f", "<f4"), _VT_BOOL: ("BOOL", "<?", "u1"),
    _VT_UINT64: ("UINT64", "<Q", "<u8"), _VT_INT64: ("INT64", "<q", "<i8"),
    _VT_FLOAT64: ("FLOAT64", "<d", "<f8"),
}
_VALUE_TYPE_NAMES = {**{k: v[0] for k, v in _SCALARS.items()}, _VT_STRING: "STRING",
                     _VT_ARRAY: "ARRAY"}
# Smallest encoding of one element of each type (bounds an array's count by the bytes left).
_MIN_SIZE = {**{k: struct.calcsize(v[1]) for k, v in _SCALARS.items()}, _VT_STRING: 8,
             _VT_ARRAY: 12}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file.

    Attributes
    ----------
    name : str
        GGUF tensor name (``blk.0.attn_q.weight``).
    ne : tuple of int
        ggml dimensions, fastest-varying first (``ne[0]`` is the row length).
    shape : tuple of int
        numpy / ONNX shape: ``ne`` reversed (``[rows, ne[0]]`` for a matrix).
    ggml_type : int
        ggml type id (:data:`GGML_TYPES`).
    type_name : str
        ``"Q4_0"``, ``"F32"``, ...
    offset : int
        Absolute byte offset of the data in the file.
    nbytes : int
        Bytes of the data: ``elements / block_size * block_bytes``.
    elements : int
    block_size, block_bytes : int
        Elements per block and bytes per block of the type.
    """

    name: str
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int
    elements: int
    block_size: int
    block_bytes: int


class _Cursor:
    """Bounds-checked little-endian reads over the file's bytes."""

    def __init__(self, buf, size: int, path: str):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.path = path

    def fail(self, msg: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(
                f"truncated file: {what} needs {n} bytes at offset {self.pos}, but only "
                f"{self.size - self.pos} remain (file size {self.size})"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} length")
        if n > self.size - self.pos:
            raise self.fail(
                f"{what}: string length {n} exceeds the {self.size - self.pos} bytes left in the "
                f"file (offset {self.pos})"
            )
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what}: string is not valid UTF-8 ({exc})") from None


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        v = cur.unpack(_SCALARS[vtype][1], what)
        return bool(v) if vtype == _VT_BOOL else v
    if vtype == _VT_STRING:
        return cur.string(what)
    if vtype == _VT_ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise cur.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
        etype = cur.unpack("<I", f"{what} element type")
        if etype not in _MIN_SIZE:
            raise cur.fail(f"{what}: unknown array element type {etype} (known: 0..12)")
        count = cur.unpack("<Q", f"{what} array length")
        left = cur.size - cur.pos
        if count > left // _MIN_SIZE[etype]:
            raise cur.fail(
                f"{what}: array of {count} {_VALUE_TYPE_NAMES[etype]} elements needs at least "
                f"{count * _MIN_SIZE[etype]} bytes, but only {left} remain in the file"
            )
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][2])
            nbytes = count * dt.itemsize
            arr = np.frombuffer(cur.buf, dtype=dt, count=count, offset=cur.pos).copy()
            cur.pos += nbytes
            return arr.astype(bool) if etype == _VT_BOOL else arr
        return [_read_value(cur, etype, f"{what}[{i}]", depth + 1) for i in range(count)]
    raise cur.fail(f"{what}: unknown value type {vtype} (known: 0..12)")


class GGUFFile:
    """A parsed GGUF file: metadata, tensor infos and the read-only map of its data.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.gguf`` file. Parsed and validated completely on construction (see the module
        docstring); the tensor data is memory-mapped, never read or copied here.

    Attributes
    ----------
    path : str
    version : int
        2 or 3.
    metadata : dict of str -> value
        Scalars as Python numbers / bool / str; arrays of numbers as numpy arrays; arrays of
        strings (and nested arrays) as lists.
    value_types : dict of str -> str
        GGUF value type name of each key (``"UINT32"``, ``"ARRAY[STRING]"``, ...).
    tensors : dict of str -> GGUFTensorInfo
        In file order.
    alignment : int
    data_start : int
        Absolute offset of the tensor data section.
    file_size : int

    Raises
    ------
    GGUFFormatError
        Any violation listed in the module docstring (a ``ModelFormatError``).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise GGUFFormatError(f"cannot open GGUF file {self.path!r}: {exc}") from None
        try:
            self.file_size = os.fstat(self._fh.fileno()).st_size
            if self.file_size == 0:
                raise GGUFFormatError(f"{self.path}: empty file (no GGUF header)")
            self._mmap = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._data = np.frombuffer(self._mmap, dtype=np.uint8)
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        cur = _Cursor(self._mmap, self.file_size, self.path)
        cur.need(4, "magic")
        magic = bytes(self._mmap[0:4])
        if magic != GGUF_MAGIC:
            raise cur.fail(f"not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}")
        cur.pos = 4
        version = cur.unpack("<I", "version")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 and version else ""
            raise cur.fail(f"unsupported GGUF version {version}{hint}; supported: 2, 3")
        self.version = version
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        left = self.file_size - cur.pos
        # each key/value takes >= 8 (key length) + 4 (type) + 1 bytes, each tensor info >= 28
        if n_kv > left // 13:
            raise cur.fail(f"metadata count {n_kv} cannot fit in the {left} bytes left")
        if n_tensors > left // 28:
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the {left} bytes left")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, str] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            vtype = cur.unpack("<I", f"value type of {key!r}")
            if vtype not in _VALUE_TYPE_NAMES:
                raise cur.fail(f"metadata {key!r}: unknown value type {vtype} (known: 0..12)")
            tname = _VALUE_TYPE_NAMES[vtype]
            if vtype == _VT_ARRAY and cur.pos + 4 <= self.file_size:
                et = struct.unpack_from("<I", self._mmap, cur.pos)[0]
                tname = f"ARRAY[{_VALUE_TYPE_NAMES.get(et, et)}]"
            self.metadata[key] = _read_value(cur, vtype, f"metadata {key!r}")
            self.value_types[key] = tname
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in self.metadata and self.value_types["general.alignment"] != "UINT32":
            raise cur.fail(f"general.alignment must be UINT32, got "
                           f"{self.value_types['general.alignment']}")
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise cur.fail(f"general.alignment must be a power of two, got {align!r}")
        self.alignment = align
        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"tensor #{i} name")
            if name in names:
                raise cur.fail(f"duplicate tensor name {name!r}")
            names.add(name)
            n_dims = cur.unpack("<I", f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise cur.fail(f"tensor {name!r}: n_dims {n_dims} is outside [1, {GGML_MAX_DIMS}]")
            ne = tuple(cur.unpack("<Q", f"tensor {name!r} dimension {j}") for j in range(n_dims))
            gtype = cur.unpack("<I", f"tensor {name!r} type")
            offset = cur.unpack("<Q", f"tensor {name!r} offset")
            infos.append((name, ne, gtype, offset))
        data_start = cur.pos + (-cur.pos) % align
        self.data_start = data_start
        self.tensors: dict[str, GGUFTensorInfo] = {}
        extents = []
        for name, ne, gtype, offset in infos:
            if gtype not in GGML_TYPES:
                raise cur.fail(f"tensor {name!r}: unknown ggml type {gtype}; known: "
                               + ", ".join(f"{k} ({v[0]})" for k, v in GGML_TYPES.items()))
            tname, bs, bb = GGML_TYPES[gtype]
            elements = 1
            for j, d in enumerate(ne):
                if d < 1:
                    raise cur.fail(f"tensor {name!r}: dimension {j} is {d}, must be >= 1")
                elements *= d
                if elements > _INT64_MAX:
                    raise cur.fail(f"tensor {name!r}: element count of dimensions {list(ne)} "
                                   "overflows int64")
            if ne[0] % bs:
                raise cur.fail(f"tensor {name!r}: row length ne[0]={ne[0]} is not a multiple of "
                               f"the {tname} block size {bs}")
            nbytes = elements // bs * bb
            if nbytes > _INT64_MAX:
                raise cur.fail(f"tensor {name!r}: byte size {nbytes} overflows int64")
            if offset % align:
                raise cur.fail(f"tensor {name!r}: data offset {offset} is not a multiple of the "
                               f"alignment {align}")
            start = data_start + offset
            if start > self.file_size or nbytes > self.file_size - start:
                raise cur.fail(
                    f"tensor {name!r} ({tname} {list(ne)}): data [{start}, {start + nbytes}) "
                    f"lies beyond the end of the file ({self.file_size} bytes)"
                )
            info = GGUFTensorInfo(name, ne, tuple(reversed(ne)), gtype, tname, start, nbytes,
                                  elements, bs, bb)
            self.tensors[name] = info
            extents.append((start, start + nbytes, name))
        extents.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(extents, extents[1:]):
            if s1 < e0:
                raise cur.fail(f"tensors {n0!r} [{s0}, {e0}) and {n1!r} [{s1}, {e1}) overlap")

    # -- access --------------------------------------------------------------------------------
    def tensor_bytes(self, name: str) -> np.ndarray:
        """The data of tensor ``name``: a read-only ``uint8`` view of the file map (no copy).

        Raises
        ------
        KeyError
            No tensor of that name.
        """
        t = self.tensors[name]
        return self._data[t.offset:t.offset + t.nbytes]

    def get(self, key: str, default=None):
        """A metadata value (``default`` when absent)."""
        return self.metadata.get(key, default)

    def close(self) -> None:
        """Release the map (views from :meth:`tensor_bytes` keep it alive until dropped)."""
        self._data = None
        mm = getattr(self, "_mmap", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views are alive; the garbage collector releases the map
            self._mmap = None
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()
            self._fh = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)}, "
                f"metadata={len(self.metadata)})")


def read_gguf(path) -> GGUFFile:
    """Open and validate a GGUF file; see :class:`GGUFFile`."""
    return GGUFFile(path)
