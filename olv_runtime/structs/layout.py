"""Record layouts of byte-encodable struct types (seed 000 "Byte-encoding rules and validation").

Sizes are computed recursively in bits with checked uint64 arithmetic::

    size(scalar(T))             = bit_width(T)
    size(tensor(T, dims))       = checked_product(dims) * bit_width(T)
    size(Array(T, n))           = n * size(T)
    size(BitPacking(c..., n))   = n * sum(c.bit_width)
    size(Field(constant))       = 0
    size(Field(T))              = size(T)
    size(Structure(f...))       = sum(size(f))
    size(type_ref=id)           = size(resolve_type_id(id))

Fields follow declaration order, arrays and bit packings are tight, bits run least-to-most
significant and multi-byte values are little-endian; there is no implicit padding.

A :class:`Layout` lists, once per type, every physical leaf (:class:`Leaf`: path, element type,
bit offset, bit width, element count, signedness, per-dimension bit strides) and every constant
field (:class:`ConstantLeaf`). Leaf paths join field and component names with dots
(``quantized.codes.index``); an array adds a leading dimension to every leaf below it but no path
component. The one unnamed leaf of a root array of scalars is called ``value``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from olv_runtime.errors import LayoutError, SizeOverflowError
from olv_runtime.proto import TensorProto
from olv_runtime.proto.helper import bfloat16_dtype  # noqa: F401  (re-exported)

UINT64_MAX = (1 << 64) - 1

#: Fixed-width ONNX scalar leaves: data type -> (bit width, kind, numpy dtype of the field array).
#: Sub-byte integers come back widened to int8/uint8; BOOL is one byte (0 = False).
#: BFLOAT16 (GGUF BF16 tensors) is resolved at its first lookup: its numpy dtype comes from
#: ml_dtypes, whose import costs 0.1-0.9 s (0.5.4 / 0.7.0) that models without a bfloat16 field
#: should not pay at ``import olv_runtime``.
class _LeafTypes(dict):
    def __missing__(self, key):
        if key == TensorProto.BFLOAT16:
            self[key] = value = (16, "float", bfloat16_dtype())
            return value
        raise KeyError(key)

    def __contains__(self, key):
        return key == TensorProto.BFLOAT16 or dict.__contains__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default


LEAF_TYPES: dict[int, tuple[int, str, np.dtype]] = _LeafTypes({
    TensorProto.FLOAT: (32, "float", np.dtype("<f4")),
    TensorProto.FLOAT16: (16, "float", np.dtype("<f2")),
    TensorProto.DOUBLE: (64, "float", np.dtype("<f8")),
    TensorProto.INT8: (8, "int", np.dtype("i1")),
    TensorProto.UINT8: (8, "uint", np.dtype("u1")),
    TensorProto.INT16: (16, "int", np.dtype("<i2")),
    TensorProto.UINT16: (16, "uint", np.dtype("<u2")),
    TensorProto.INT32: (32, "int", np.dtype("<i4")),
    TensorProto.UINT32: (32, "uint", np.dtype("<u4")),
    TensorProto.INT64: (64, "int", np.dtype("<i8")),
    TensorProto.UINT64: (64, "uint", np.dtype("<u8")),
    TensorProto.BOOL: (8, "bool", np.dtype("?")),
    TensorProto.INT4: (4, "int", np.dtype("i1")),
    TensorProto.UINT4: (4, "uint", np.dtype("u1")),
    TensorProto.INT2: (2, "int", np.dtype("i1")),
    TensorProto.UINT2: (2, "uint", np.dtype("u1")),
})


def component_type(bit_width: int) -> tuple[int, np.dtype]:
    """(ONNX element type, numpy dtype) of a bit-packing component: the narrowest unsigned
    integer holding ``bit_width`` (1..64) bits."""
    for limit, et, dt in ((8, TensorProto.UINT8, "u1"), (16, TensorProto.UINT16, "<u2"),
                          (32, TensorProto.UINT32, "<u4"), (64, TensorProto.UINT64, "<u8")):
        if bit_width <= limit:
            return et, np.dtype(dt)
    raise AssertionError(bit_width)


def checked_add(a: int, b: int, what: str) -> int:
    """``a + b`` in uint64; :class:`SizeOverflowError` naming ``what`` on overflow."""
    r = a + b
    if r > UINT64_MAX:
        raise SizeOverflowError(f"{what}: size {a} + {b} bits overflows uint64")
    return r


def checked_mul(a: int, b: int, what: str) -> int:
    """``a * b`` in uint64; :class:`SizeOverflowError` naming ``what`` on overflow."""
    r = a * b
    if r > UINT64_MAX:
        raise SizeOverflowError(f"{what}: size {a} * {b} bits overflows uint64")
    return r


def checked_product(dims, what: str) -> int:
    p = 1
    for d in dims:
        p = checked_mul(p, int(d), what)
    return p


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One physical field of a record: a fixed-width scalar repeated over ``shape``.

    Attributes
    ----------
    path : str
        Dotted leaf path (``scale``, ``quantized.codes.index``).
    elem_type : int
        TensorProto.DataType of the field array handed to decoders (bit-packing components:
        the narrowest UINT8/16/32/64 holding them).
    bits : int
        Width of one element in bits (1..64).
    kind : str
        ``"int"`` (two's complement, sign-extended), ``"uint"``, ``"float"`` or ``"bool"``.
    dtype : numpy.dtype
        dtype of the field array.
    shape : tuple of int
        Field shape within one record (the array is ``[records, *shape]``).
    offset : int
        Bit offset of element ``(0, ..., 0)`` from the start of the record.
    strides : tuple of int
        Bit stride of each dimension of ``shape``.
    """

    path: str
    elem_type: int
    bits: int
    kind: str
    dtype: np.dtype
    shape: tuple
    offset: int
    strides: tuple

    @property
    def signed(self) -> bool:
        return self.kind == "int"

    @property
    def count(self) -> int:
        """Elements per record."""
        return math.prod(self.shape)

    def element_offsets(self) -> np.ndarray:
        """Bit offset of every element within the record, row-major over ``shape``: int64 [count]."""
        off = np.full((), self.offset, dtype=np.int64)
        for extent, stride in zip(self.shape, self.strides):
            off = off[..., None] + np.arange(extent, dtype=np.int64) * np.int64(stride)
        return off.reshape(-1)

    def byte_aligned(self) -> bool:
        """True when the field can be a zero-copy strided view (whole-byte scalars at byte
        offsets and byte strides)."""
        return (self.kind != "bool" and self.bits in (8, 16, 32, 64) and self.offset % 8 == 0
                and all(s % 8 == 0 for s in self.strides))

    def moved(self, prefix: str, offset: int, outer: tuple = ()) -> "Leaf":
        """This leaf nested under ``prefix`` at bit ``offset``, inside arrays ``outer``
        ((extent, stride_bits) pairs, outermost first)."""
        return dataclasses.replace(
            self,
            path=join(prefix, self.path),
            offset=self.offset + offset,
            shape=tuple(e for e, _ in outer) + self.shape,
            strides=tuple(s for _, s in outer) + self.strides,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class ConstantLeaf:
    """A constant field (seed 000 ``Field.constant``): no payload bits; bound with its own shape.

    Attributes
    ----------
    path : str
    elem_type : int
    value : numpy.ndarray
        Read-only array of the constant (sub-byte integers widened to int8/uint8).
    """

    path: str
    elem_type: int
    value: np.ndarray

    def __eq__(self, other) -> bool:
        return (isinstance(other, ConstantLeaf) and self.path == other.path
                and self.elem_type == other.elem_type and self.value.dtype == other.value.dtype
                and np.array_equal(self.value, other.value))

    __hash__ = None

    def moved(self, prefix: str) -> "ConstantLeaf":
        return dataclasses.replace(self, path=join(prefix, self.path))


def join(prefix: str, path: str) -> str:
    if not prefix:
        return path
    return f"{prefix}.{path}" if path else prefix


@dataclasses.dataclass(frozen=True)
class Layout:
    """The layout of one byte-encodable struct type (relative to the record start).

    Attributes
    ----------
    bits : int
        Record size in bits (checked uint64).
    leaves : tuple of Leaf
        Physical fields in declaration order.
    constants : tuple of ConstantLeaf
        Constant fields in declaration order (including those of nested type_refs).
    """

    bits: int
    leaves: tuple
    constants: tuple

    @property
    def record_bytes(self) -> int:
        return self.bits // 8

    def leaf(self, path: str) -> Leaf | None:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        return None

    def constant(self, path: str) -> ConstantLeaf | None:
        for c in self.constants:
            if c.path == path:
                return c
        return None

    def paths(self) -> list[str]:
        """Every leaf and constant path."""
        return [leaf.path for leaf in self.leaves] + [c.path for c in self.constants]

    def signature(self) -> dict:
        """A plain description for native-decoder verification and ``olv inspect``:
        ``{"bits", "leaves": {path: (elem_type, bits, shape, offset)}, "constants": {path:
        (elem_type, shape, values list)}}``."""
        return {
            "bits": self.bits,
            "leaves": {lf.path: (lf.elem_type, lf.bits, lf.shape, lf.offset) for lf in self.leaves},
            "constants": {c.path: (c.elem_type, c.value.shape, c.value.tolist())
                          for c in self.constants},
        }


def check_root(layout: Layout, what: str) -> None:
    """Seed 000: the encoded root must have strictly positive size divisible by eight."""
    if layout.bits == 0:
        raise LayoutError(
            f"{what}: the record size is 0 bits (a constant-only struct is a valid type but not "
            "an encoding root)"
        )
    if layout.bits % 8:
        raise LayoutError(
            f"{what}: the record size is {layout.bits} bits, not a whole number of bytes "
            f"({layout.bits % 8} bits left over; padding must be explicit)"
        )
