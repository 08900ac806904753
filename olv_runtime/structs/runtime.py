"""Whole struct values at runtime (seed 000 "Whole structured inputs", "Quantized and paged caches
use the same feedback").

A graph input or output whose type is ``TypeProto.struct_type`` carries, at runtime, one
:class:`RuntimeStruct`: an immutable mapping field name → field value, where a field value is

* a dense ``numpy.ndarray`` (a tensor field),
* an encoded value (:class:`~olv_runtime.structs.initializers.AffineValue` or
  :class:`~olv_runtime.structs.value.StructValue`) standing for a tensor field — allowed when its
  ``logical_type`` is exactly the field's tensor type (seed 000: "Each K/V block may use a different
  EncodedValueProto layout ... provided its decoded type and geometry satisfy the consumer
  contract"); a FLOAT field also accepts a dense float16 array (half storage),
* a ``tuple`` of field values (a ``sequence`` field),
* a nested :class:`RuntimeStruct` (a struct field), or ``None`` (an empty ``optional``).

Fields are held as they are: building, validating, retaining or forwarding a struct never copies
a payload. Each field keeps its own buffer owner (seed 000 "Runtime structs retain each field's
owner independently"). Constant fields of the declaration are not instance data and are not
stored in the value.

:func:`check_struct_value` validates a value against its declared type (following ``type_ref``
through the catalogue) once per (value, declaration): the result is memoised on the value, so a
value produced by a kernel and fed back every call is checked in O(1) (a cache's blocks are shared
between successive cache values and each is checked once).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from olv_runtime.errors import InvalidArgument
from olv_runtime.proto import StructTypeProto, TensorProto, TypeProto
from olv_runtime.structs.initializers import NP_DTYPE, AffineValue, dtype_name

__all__ = ["RuntimeStruct", "SharedPrefix", "check_struct_value", "field_arrays", "payload_nbytes",
           "empty_value"]


class RuntimeStruct(Mapping):
    """An immutable struct value: field name → value (see the module docstring).

    Parameters
    ----------
    fields : mapping of str -> value
        In declaration order (validated against a type by :func:`check_struct_value`).
    meta : object, optional
        Bookkeeping of the producer (e.g. the paged KV cache's block index); not a field, never
        serialized, ignored by validation and retention.

    Attributes
    ----------
    meta : object or None
    """

    __slots__ = ("_fields", "meta", "_checked", "_readonly", "_acct", "__weakref__")

    def __init__(self, fields: Mapping[str, Any], meta: Any = None):
        self._fields = dict(fields)
        self.meta = meta
        self._checked: Any = None  # the declaration this value was last validated against
        self._readonly: bool | None = None
        # (payload bytes, {id(buffer owner): bytes}) when the producer knows them (the paged
        # KV cache: O(1) per call instead of a walk over every block), else None
        self._acct: Any = None

    def __getitem__(self, name: str):
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(f"struct has no field {name!r}; fields: {list(self._fields)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        parts = []
        for k, v in self._fields.items():
            if isinstance(v, np.ndarray):
                parts.append(f"{k}={v.dtype}{list(v.shape)}")
            elif isinstance(v, tuple):
                parts.append(f"{k}=sequence[{len(v)}]")
            else:
                parts.append(f"{k}={type(v).__name__}")
        return "RuntimeStruct(" + ", ".join(parts) + ")"

    @property
    def nbytes(self) -> int:
        """Payload bytes of every field (distinct buffers counted once), see :func:`payload_nbytes`."""
        return payload_nbytes(self)

    def replace(self, **fields) -> "RuntimeStruct":
        """A new struct with some fields replaced (others shared, not copied)."""
        new = dict(self._fields)
        for k, v in fields.items():
            if k not in new:
                raise KeyError(f"struct has no field {k!r}; fields: {list(new)}")
            new[k] = v
        return RuntimeStruct(new, self.meta)

    def readonly(self) -> "RuntimeStruct":
        """This struct if every array in it is read-only, else a struct of read-only views
        (same buffers, no copy). Memoised."""
        if self._readonly:
            return self
        changed = False
        out = {}
        for k, v in self._fields.items():
            r = _readonly_value(v)
            changed |= r is not v
            out[k] = r
        if not changed:
            self._readonly = True
            return self
        new = RuntimeStruct(out, self.meta)
        new._readonly = True
        new._checked = self._checked
        return new


def _readonly_value(v):
    if isinstance(v, np.ndarray):
        if not v.flags.writeable:
            return v
        view = v.view()
        view.flags.writeable = False
        return view
    if isinstance(v, RuntimeStruct):
        return v.readonly()
    if isinstance(v, tuple):
        items = tuple(_readonly_value(x) for x in v)
        return v if all(a is b for a, b in zip(items, v)) else items
    return v


class SharedPrefix(tuple):
    """A sequence field value (a tuple) that shares its first ``base[1]`` items with the
    tuple ``base[0]`` (the same objects): validation of a value whose previous version was
    checked looks at the new items only (a paged KV cache grows by one block at a time).
    ``checked`` is the element declaration the whole tuple was validated against."""

    def __new__(cls, items, base=None):
        t = super().__new__(cls, items)
        t.base = base
        t.checked = None
        return t


# -- payload accounting ------------------------------------------------------------------------
def field_arrays(value) -> Iterator[np.ndarray]:
    """Every payload array inside a value (tensor fields, encoded codes/scales, nested fields)."""
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, AffineValue):
        yield value.codes
        yield value.scale
        if value.zero_point is not None:
            yield value.zero_point
    elif isinstance(value, RuntimeStruct):
        for v in value.values():
            yield from field_arrays(v)
    elif isinstance(value, tuple):
        for v in value:
            yield from field_arrays(v)
    elif value is not None and hasattr(value, "payload"):  # StructValue
        yield value.payload


def payload_nbytes(value) -> int:
    """Bytes of the payload arrays of ``value`` (an array, encoded value or struct); arrays seen
    twice (same data pointer and size) count once."""
    if isinstance(value, RuntimeStruct) and value._acct is not None:
        return value._acct[0]
    seen = set()
    total = 0
    for a in field_arrays(value):
        key = (a.__array_interface__["data"][0], a.nbytes)
        if key not in seen:
            seen.add(key)
            total += a.nbytes
    return total


# -- validation ----------------------------------------------------------------------------------
def _deref(st: StructTypeProto, catalogue, where: str) -> StructTypeProto:
    seen = set()
    while st.WhichOneof("kind") == "type_ref":
        ref = int(st.type_ref)
        if ref in seen:
            raise InvalidArgument(f"{where}: type_ref cycle through {ref}")
        seen.add(ref)
        st = catalogue.get(ref, where)
    return st


def _tensor_dims(tt) -> list | None:
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.WhichOneof("value") == "dim_value" else None for d in tt.shape.dim]


def _check_shape(where: str, got: tuple, dims: list | None) -> None:
    if dims is None:
        return
    if len(got) != len(dims) or any(d is not None and d != g for d, g in zip(dims, got)):
        shown = ["?" if d is None else d for d in dims]
        raise InvalidArgument(f"{where}: expected shape {shown}, got {list(got)}")


def _check_tensor_field(where: str, value, tt) -> None:
    et = tt.elem_type
    dims = _tensor_dims(tt)
    if isinstance(value, np.ndarray):
        want = NP_DTYPE.get(et)
        if want is None:
            raise InvalidArgument(f"{where}: element type {dtype_name(et)} is not supported")
        ok = value.dtype == want.newbyteorder("=")
        if not ok and et == TensorProto.FLOAT and value.dtype == np.float16:
            ok = True  # dense half storage of a FLOAT field
        if not ok:
            raise InvalidArgument(
                f"{where}: expected element type {dtype_name(et)} ({want}), got {value.dtype}")
        if not value.dtype.isnative:
            raise InvalidArgument(f"{where}: byte-swapped dtype {value.dtype} is not supported "
                                  "(no silent copy)")
        if not value.flags.c_contiguous:
            raise InvalidArgument(f"{where}: array is not C-contiguous (strides {value.strides}); "
                                  "the runtime does not copy struct fields silently")
        _check_shape(where, value.shape, dims)
        return
    logical = None
    if isinstance(value, AffineValue):
        logical = (value.elem_type, tuple(value.shape))
    elif hasattr(value, "logical") and hasattr(value, "payload"):  # StructValue
        logical = value.logical
        if logical is None:
            raise InvalidArgument(f"{where}: encoded value {value.name!r} has no logical_type; a "
                                  "tensor field needs one")
    else:
        raise InvalidArgument(f"{where}: expected a tensor (numpy array or encoded value), got "
                              f"{type(value).__name__}")
    if logical[0] != et:
        raise InvalidArgument(f"{where}: encoded value's logical element type "
                              f"{dtype_name(logical[0])} differs from the field's {dtype_name(et)}")
    _check_shape(where, tuple(logical[1]), dims)


def _check_value(where: str, value, tp: TypeProto, catalogue) -> None:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        _check_tensor_field(where, value, tp.tensor_type)
    elif kind == "sequence_type":
        if not isinstance(value, tuple):
            raise InvalidArgument(f"{where}: a sequence field is a tuple, got {type(value).__name__}")
        et = tp.sequence_type.elem_type
        if et.WhichOneof("value") == "struct_type":
            # items already checked against the element declaration are skipped in O(1); a
            # SharedPrefix tuple skips even that for the prefix it shares with a checked one
            decl = _deref(et.struct_type, catalogue, where)
            start = 0
            base = getattr(value, "base", None)
            if base is not None and getattr(base[0], "checked", None) is decl:
                start = base[1]
            for i in range(start, len(value)):
                item = value[i]
                if type(item) is RuntimeStruct and item._checked is decl:
                    continue
                check_struct_value(f"{where}[{i}]", item, et.struct_type, catalogue)
            if type(value) is SharedPrefix:
                value.checked = decl
            return
        for i, item in enumerate(value):
            _check_value(f"{where}[{i}]", item, et, catalogue)
    elif kind == "optional_type":
        if value is not None:
            _check_value(where, value, tp.optional_type.elem_type, catalogue)
    elif kind == "struct_type":
        check_struct_value(where, value, tp.struct_type, catalogue)
    else:
        raise InvalidArgument(f"{where}: fields of kind {kind} are not supported at runtime")


def check_struct_value(where: str, value, st: StructTypeProto, catalogue) -> RuntimeStruct:
    """Validate a runtime struct value against a declared struct type (no copy).

    Parameters
    ----------
    where : str
        Names the value in error messages (``input 'cache.0'``).
    value : RuntimeStruct
    st : StructTypeProto
        The declared type (``type_ref`` or an inline ``structure``).
    catalogue : Catalogue
        Resolves ``type_ref``.

    Returns
    -------
    RuntimeStruct
        ``value`` itself.

    Raises
    ------
    InvalidArgument
        Not a RuntimeStruct, missing or unknown fields, a field of the wrong kind, element type or
        shape, a non-contiguous or byte-swapped array, an encoded value whose logical type is not
        the field's type.
    """
    if not isinstance(value, RuntimeStruct):
        raise InvalidArgument(f"{where}: expected a struct value (olv_runtime.RuntimeStruct), got "
                              f"{type(value).__name__}")
    decl = _deref(st, catalogue, where)
    if value._checked is decl:
        return value
    kind = decl.WhichOneof("kind")
    if kind != "structure":
        raise InvalidArgument(f"{where}: only structure types have runtime struct values, the "
                              f"declaration is a {kind}")
    declared = [f for f in decl.structure.field if not f.HasField("constant")]
    names = [f.name for f in declared]
    extra = [k for k in value if k not in names]
    if extra:
        raise InvalidArgument(f"{where}: unknown field(s) {extra}; the type declares {names}")
    for f in declared:
        if f.name not in value:
            raise InvalidArgument(f"{where}: missing field {f.name!r}; the type declares {names}")
        _check_value(f"{where}.{f.name}", value[f.name], f.type, catalogue)
    value._checked = decl
    return value


def empty_value(tp: TypeProto, catalogue, batch_size: int = 1):
    """An empty value of a type: sequences empty, INT64 scalars 0, symbolic dims 0 (dim 0 of a
    tensor is ``batch_size`` when symbolic), nested structs empty likewise."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        dims = _tensor_dims(tp.tensor_type) or []
        shape = [d if d is not None else (batch_size if k == 0 and len(dims) > 1 else 0)
                 for k, d in enumerate(dims)]
        return np.zeros(shape, NP_DTYPE[tp.tensor_type.elem_type].newbyteorder("="))
    if kind == "sequence_type":
        return ()
    if kind == "optional_type":
        return None
    if kind == "struct_type":
        decl = _deref(tp.struct_type, catalogue, "empty value")
        return RuntimeStruct({f.name: empty_value(f.type, catalogue, batch_size)
                              for f in decl.structure.field if not f.HasField("constant")})
    raise InvalidArgument(f"no empty value for a {kind}")
