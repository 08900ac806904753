"""ShapesContext: the one source of truth for value information (seed 002 "ShapesContext").

A :class:`ShapesContext` maps every value name in scope to exactly one symbolic descriptor:

* :class:`SymTensor` - element type and shape (dims: ``int``, ``str`` dim_param, or ``None``);
* :class:`SymSequence` - a sequence of some element descriptor;
* :class:`SymEncodedValue` - an encoded value (seed 002 "SymEncodedValue"): its physical layout
  (built-in affine or a resolved struct type), checked byte size, record count (struct layouts:
  payload bytes / record bytes, exact) and its decoded logical type / :class:`SymTensor`;
* :class:`SymType` - any other declared type (struct-typed inputs, maps, optionals), kept as the
  ``TypeProto``.

The context also owns the struct-type catalogue (``type_id`` -> declaration, in insertion order;
a conflicting definition under an existing ID is rejected, never renumbered), the opset imports
and the model-local functions.

Scopes (seed 002 "Scopes"): a ``"subgraph"`` child (If branches) sees the outer values and the
catalogue; a ``"function"`` child (local-function bodies) sees the catalogue but not the outer
values. The payload bytes are never stored here: they stay with the GraphBuilder.
"""
from __future__ import annotations

import dataclasses
from typing import Union

from olv_runtime.builder.errors import (
    ConflictingTypeError,
    DuplicateValueError,
    UnavailableValueError,
)
from olv_runtime.decoding.decoders import native_decoders
from olv_runtime.proto import StructTypeProto, TypeProto
from olv_runtime.structs.catalogue import Catalogue, RootType, describe
from olv_runtime.structs.initializers import dtype_name

Dim = Union[int, str, None]


# -- descriptors -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SymTensor:
    """A tensor: ``elem_type`` (TensorProto.DataType, 0 = unknown) and ``shape`` (tuple of
    int / str dim_param / None, or None for an unknown rank)."""

    elem_type: int = 0
    shape: tuple | None = None

    @classmethod
    def from_type(cls, tp) -> "SymTensor":
        """From a tensor ``TypeProto`` (ours or onnx's)."""
        tt = tp.tensor_type
        if not tt.HasField("shape"):
            return cls(int(tt.elem_type), None)
        dims = []
        for d in tt.shape.dim:
            which = d.WhichOneof("value")
            dims.append(int(d.dim_value) if which == "dim_value"
                        else d.dim_param if which == "dim_param" else None)
        return cls(int(tt.elem_type), tuple(dims))

    def to_type(self) -> TypeProto:
        tp = TypeProto()
        tp.tensor_type.elem_type = self.elem_type
        if self.shape is not None:
            tp.tensor_type.shape.SetInParent()
            for d in self.shape:
                dim = tp.tensor_type.shape.dim.add()
                if isinstance(d, str):
                    dim.dim_param = d
                elif d is not None:
                    dim.dim_value = int(d)
        return tp

    @property
    def known(self) -> bool:
        return self.elem_type != 0

    def describe(self) -> str:
        shape = "?" if self.shape is None else "[" + ", ".join(
            "?" if d is None else str(d) for d in self.shape) + "]"
        return f"tensor({dtype_name(self.elem_type) if self.elem_type else '?'}, {shape})"


@dataclasses.dataclass(frozen=True)
class SymSequence:
    """A sequence whose elements are described by ``elem`` (None: unknown)."""

    elem: object = None

    def to_type(self) -> TypeProto:
        tp = TypeProto()
        tp.sequence_type.SetInParent()
        if self.elem is not None and hasattr(self.elem, "to_type"):
            tp.sequence_type.elem_type.CopyFrom(self.elem.to_type())
        return tp

    def describe(self) -> str:
        return f"sequence({self.elem.describe() if self.elem is not None else '?'})"


@dataclasses.dataclass(frozen=True)
class SymType:
    """Any other declared value type (struct-typed input, map, optional): the ``TypeProto``."""

    type: TypeProto

    def to_type(self) -> TypeProto:
        tp = TypeProto()
        tp.CopyFrom(self.type)
        return tp

    def describe(self) -> str:
        kind = self.type.WhichOneof("value")
        if kind == "struct_type":
            return f"struct({describe(self.type.struct_type)})"
        return kind or "untyped"


@dataclasses.dataclass(frozen=True)
class EncodedLayoutRef:
    """The physical layout of an encoded value: the built-in affine descriptor or a resolved
    struct root (seed 002 ``EncodedLayoutRef``).

    Attributes
    ----------
    kind : {"affine", "struct"}
    affine : AffineLayoutProto or None
        The affine descriptor (storage type, scale, zero_point, axis, block_size).
    root : RootType or None
        Resolved struct declaration, its type_id (None: inline) and record layout.
    """

    kind: str
    affine: object = None
    root: RootType | None = None

    @property
    def type_id(self) -> int | None:
        return self.root.type_id if self.root is not None else None

    @property
    def record_bytes(self) -> int | None:
        return self.root.record_bytes if self.root is not None else None

    def identity(self) -> bytes:
        """Bytes that are equal iff two layouts interpret a payload identically: the affine
        descriptor (including scale and zero_point values), or the type_id / the serialized
        inline declaration."""
        if self.kind == "affine":
            return b"affine:" + self.affine.SerializeToString(deterministic=True)
        if self.root.type_id is not None:
            return b"type_id:%d" % self.root.type_id
        return b"inline:" + self.root.declaration.SerializeToString(deterministic=True)

    def describe(self) -> str:
        if self.kind == "affine":
            a = self.affine
            extra = ""
            if a.HasField("axis"):
                extra += f", axis {a.axis}"
            if a.HasField("block_size"):
                extra += f", block_size {a.block_size}"
            return f"affine {dtype_name(a.storage_type)}{extra}"
        return describe(self.root.declaration)


@dataclasses.dataclass(frozen=True)
class SymEncodedValue:
    """Symbolic description of an encoded value (seed 002 "SymEncodedValue").

    Attributes
    ----------
    name : str
    layout : EncodedLayoutRef
        Physical layout.
    byte_size : int
        Payload bytes: the inline length or the validated explicit external ``length``.
    records : int or None
        Struct layouts: ``byte_size / record_bytes`` (exact); None for affine.
    logical_type : TypeProto or None
        The decoded type (None: no tensor semantics).
    external : bool
        The payload lives in an external file.
    """

    name: str
    layout: EncodedLayoutRef
    byte_size: int
    records: int | None
    logical_type: TypeProto | None
    external: bool = False

    @property
    def logical_tensor(self) -> SymTensor | None:
        """The decoded tensor, when the logical type is a tensor type."""
        if self.logical_type is None or self.logical_type.WhichOneof("value") != "tensor_type":
            return None
        return SymTensor.from_type(self.logical_type)

    # seed 002 spellings
    def PhysicalLayout(self) -> EncodedLayoutRef:  # noqa: N802
        return self.layout

    def ByteSize(self) -> int:  # noqa: N802
        return self.byte_size

    def LogicalType(self) -> TypeProto | None:  # noqa: N802
        return self.logical_type

    def LogicalTensor(self) -> SymTensor | None:  # noqa: N802
        return self.logical_tensor

    def renamed(self, name: str) -> "SymEncodedValue":
        """The same description under another name (function input/output binding)."""
        return dataclasses.replace(self, name=name)

    def profile(self) -> tuple:
        """Everything but the payload and the name that two duplicates must share: resolved
        layout, byte extent, logical type (seed 002 "Serialization and passes")."""
        logical = (self.logical_type.SerializeToString(deterministic=True)
                   if self.logical_type is not None else None)
        return (self.layout.identity(), self.byte_size, self.records, logical)

    def has_decoder(self) -> bool:
        """Affine values decode as DequantizeLinear; struct values need a FunctionProto decoder
        on the root declaration or a native decoder registered for its type_id."""
        if self.layout.kind == "affine":
            return True
        if self.layout.root.declaration.HasField("decoder"):
            return True
        return self.layout.type_id is not None and self.layout.type_id in native_decoders()

    def describe(self) -> str:
        lt = self.logical_tensor
        rec = f", {self.records} records" if self.records is not None else ""
        return (f"encoded({self.layout.describe()}, {self.byte_size} bytes{rec}, logical "
                f"{lt.describe() if lt is not None else 'none'})")


Sym = Union[SymTensor, SymSequence, SymEncodedValue, SymType]


def sym_from_type(tp: TypeProto) -> Sym:
    """The descriptor of a declared ``TypeProto`` (graph input/output/value_info)."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return SymTensor.from_type(tp)
    if kind == "sequence_type":
        et = tp.sequence_type.elem_type
        return SymSequence(sym_from_type(et) if tp.sequence_type.HasField("elem_type") else None)
    if kind is None:
        return SymTensor()
    return SymType(tp)


# -- encoded values: the one helper used by the builder and by model inference ---------------
def copy_message(msg):
    """A new message of the same type holding a copy of ``msg``."""
    out = type(msg)()
    out.CopyFrom(msg)
    return out


# -- the context ---------------------------------------------------------------------------
class _Catalogue:
    """The struct-type catalogue shared by a root context and its children."""

    def __init__(self):
        self.decls: dict[int, StructTypeProto] = {}
        self._resolved: Catalogue | None = None

    def add(self, st: StructTypeProto) -> int:
        if not st.HasField("type_id") or st.type_id == 0:
            raise ConflictingTypeError(
                f"struct type {st.name!r}: a catalogue declaration needs a nonzero type_id"
            )
        tid = int(st.type_id)
        old = self.decls.get(tid)
        if old is not None:
            if old.SerializeToString(deterministic=True) == st.SerializeToString(deterministic=True):
                return tid
            raise ConflictingTypeError(
                f"type_id {tid} is already declared as {old.name!r}; a different definition "
                f"({st.name!r}) under the same ID is rejected (IDs are never renumbered; changing "
                "a format requires a new type_id)"
            )
        decls = dict(self.decls)
        decls[tid] = copy_message(st)
        resolved = Catalogue(decls.values())  # validates identity, references, cycles
        self.decls = decls
        self._resolved = resolved
        return tid

    def add_many(self, sts) -> list[int]:
        """Add declarations that may reference each other in any order."""
        sts = list(sts)
        for st in sts:
            tid = int(st.type_id) if st.HasField("type_id") else 0
            old = self.decls.get(tid)
            if old is not None and old.SerializeToString(deterministic=True) != \
                    st.SerializeToString(deterministic=True):
                self.add(st)  # raises ConflictingTypeError
        decls = dict(self.decls)
        fresh = [st for st in sts if int(st.type_id) not in decls]
        seen: dict[int, StructTypeProto] = {}
        for st in fresh:
            tid = int(st.type_id) if st.HasField("type_id") else 0
            if tid in seen and seen[tid].SerializeToString(deterministic=True) != \
                    st.SerializeToString(deterministic=True):
                raise ConflictingTypeError(
                    f"type_id {tid} is declared twice with different definitions ({seen[tid].name!r} "
                    f"and {st.name!r})"
                )
            seen[tid] = st
        resolved = Catalogue(list(decls.values()) + list(seen.values()))
        for tid, st in seen.items():
            decls[tid] = copy_message(st)
        self.decls = decls
        self._resolved = resolved
        return [int(st.type_id) for st in sts]

    def resolved(self) -> Catalogue:
        if self._resolved is None:
            self._resolved = Catalogue(self.decls.values())
        return self._resolved


class ShapesContext:
    """Value information of one scope (see the module docstring).

    Parameters
    ----------
    parent : ShapesContext, optional
        The enclosing scope.
    kind : {"graph", "subgraph", "function"}
        ``"subgraph"`` inherits outer values; ``"function"`` does not. Both share the parent's
        catalogue, opsets and functions unless ``opsets`` is given.
    opsets : dict of str -> int, optional
    """

    def __init__(self, parent: "ShapesContext | None" = None, kind: str = "graph",
                 opsets: dict | None = None):
        if kind not in ("graph", "subgraph", "function"):
            raise ValueError(f"unknown scope kind {kind!r}")
        self.parent = parent
        self.kind = kind
        self.tensors_: dict[str, SymTensor | SymType] = {}
        self.sequences_: dict[str, SymSequence] = {}
        self.encoded_values_: dict[str, SymEncodedValue] = {}
        #: small constant int tensors (onnx TensorProto) for shape inference data propagation
        self.constants: dict[str, object] = {}
        if parent is None:
            self._catalogue = _Catalogue()
            self.opsets: dict[str, int] = dict(opsets or {})
            self.functions: dict[tuple[str, str], object] = {}
        else:
            self._catalogue = parent._catalogue
            self.opsets = dict(opsets) if opsets is not None else parent.opsets
            self.functions = parent.functions

    # -- scopes ----------------------------------------------------------------------------
    def child(self, kind: str = "subgraph", opsets: dict | None = None) -> "ShapesContext":
        """A nested scope: ``"subgraph"`` (If branches) or ``"function"`` (local functions)."""
        return ShapesContext(self, kind, opsets)

    # -- struct types ----------------------------------------------------------------------
    def add_struct_type(self, st: StructTypeProto) -> int:
        """Register a catalogue declaration; returns its type_id.

        Raises
        ------
        ConflictingTypeError
            Another definition already uses the type_id.
        CatalogueError, DeclarationError
            The declaration breaks the identity or declaration rules (e.g. an unresolved
            ``type_ref``: add referenced types first or use :meth:`add_struct_types`).
        """
        return self._catalogue.add(st)

    def add_struct_types(self, sts) -> list[int]:
        """Register several declarations at once (references among them in any order)."""
        return self._catalogue.add_many(sts)

    def get_struct_type(self, type_id: int) -> StructTypeProto:
        """The declaration of ``type_id`` (UnresolvedTypeRefError if absent)."""
        return self._catalogue.resolved().get(type_id)

    def has_struct_type(self, type_id: int) -> bool:
        return int(type_id) in self._catalogue.decls

    @property
    def struct_types(self) -> list[StructTypeProto]:
        """The declarations in insertion order."""
        return list(self._catalogue.decls.values())

    @property
    def catalogue(self) -> Catalogue:
        return self._catalogue.resolved()

    # -- values ----------------------------------------------------------------------------
    def _maps(self):
        return (self.tensors_, self.sequences_, self.encoded_values_)

    def local(self, name: str) -> Sym | None:
        for m in self._maps():
            v = m.get(name)
            if v is not None:
                return v
        return None

    def lookup(self, name: str) -> Sym | None:
        """The descriptor of ``name`` in this scope or (subgraphs) an enclosing one."""
        ctx = self
        while ctx is not None:
            v = ctx.local(name)
            if v is not None:
                return v
            ctx = ctx.parent if ctx.kind == "subgraph" else None
        return None

    def has_value(self, name: str) -> bool:
        """Availability: tensors, sequences and encoded values (inherited in subgraphs)."""
        return self.lookup(name) is not None

    def require(self, name: str, user: str) -> Sym:
        """The descriptor of ``name``; :class:`UnavailableValueError` naming ``user`` if absent."""
        v = self.lookup(name)
        if v is None:
            scope = {"graph": "the graph", "subgraph": "this subgraph or an enclosing graph",
                     "function": "this function (functions do not see outer values)"}[self.kind]
            raise UnavailableValueError(
                f"{user} reads {name!r}, which is not an input, initializer, encoded initializer "
                f"or node output in {scope}"
            )
        return v

    def has_encoded_value(self, name: str) -> bool:
        return isinstance(self.lookup(name), SymEncodedValue)

    def get_encoded_value(self, name: str) -> SymEncodedValue:
        v = self.lookup(name)
        if not isinstance(v, SymEncodedValue):
            raise UnavailableValueError(f"{name!r} is not an encoded value in scope")
        return v

    def set_value(self, name: str, sym: Sym, *, replace: bool = False) -> None:
        """Record ``name``'s descriptor in the one map of its kind.

        Raises
        ------
        DuplicateValueError
            ``name`` is already described in this scope (and ``replace`` is false).
        """
        if not name:
            return
        if not replace and self.local(name) is not None:
            raise DuplicateValueError(
                f"value {name!r} is already defined ({self.local(name).describe()})"
            )
        for m in self._maps():
            m.pop(name, None)
        if isinstance(sym, SymEncodedValue):
            self.encoded_values_[name] = sym if sym.name == name else sym.renamed(name)
        elif isinstance(sym, SymSequence):
            self.sequences_[name] = sym
        else:
            self.tensors_[name] = sym

    def set_encoded_value(self, name: str, sym: SymEncodedValue, *, replace: bool = False) -> None:
        self.set_value(name, sym, replace=replace)

    def remove(self, name: str) -> None:
        for m in self._maps():
            m.pop(name, None)
        self.constants.pop(name, None)

    def rename(self, old: str, new: str) -> None:
        v = self.local(old)
        if v is None:
            return
        c = self.constants.get(old)
        self.remove(old)
        self.set_value(new, v)
        if c is not None:
            self.constants[new] = c

    def names(self) -> list[str]:
        out: list[str] = []
        for m in self._maps():
            out.extend(m)
        return out
