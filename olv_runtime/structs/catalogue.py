"""The struct type catalogue of a model (seed 000 "Catalogue and identity contract").

:class:`Catalogue` resolves ``ModelProto.struct_types`` by ``type_id`` once and validates:

* identity: every declaration has a nonzero ``type_id``, no two share one, a declaration has a
  concrete kind (array, structure or bit_packing); a ``type_ref`` carries only the referenced ID
  (no name, doc_string, metadata, codecs, type_id); an inline declaration has no ``type_id``;
  every reference resolves; no reference cycles, direct or indirect. Reordering the catalogue
  changes nothing (lookups are by ID only).
* declarations (:class:`~olv_runtime.errors.DeclarationError`): fields have a non-empty,
  dot-free name unique in their structure and exactly one of type/constant; constants are inline
  tensors with matching data; arrays have an element type and an explicit dimension; bit packings
  have named components of 1..64 bits and an explicit dimension; TypeProtos are set.

Nesting is limited to :data:`MAX_NESTING` levels (inline declarations, element types and
``type_ref`` hops counted together along any path): deeper types raise
:class:`~olv_runtime.errors.DeclarationError` instead of exhausting Python's recursion limit.

Layouts (:mod:`olv_runtime.structs.layout`) are computed lazily, once per type_id; a type that is
not byte-encodable (sequence field, dynamic dims, STRING leaf, size overflow) is still a valid
type: the error is raised only when it is used as (part of) a byte-encoded layout.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import (
    CatalogueError,
    DeclarationError,
    DuplicateTypeIdError,
    LayoutError,
    TypeRefCycleError,
    UnresolvedTypeRefError,
    ValidationError,
)
from olv_runtime.proto import StructTypeProto, TensorProto, TypeProto
from olv_runtime.structs.initializers import dtype_name, param_tensor
from olv_runtime.structs.layout import (
    LEAF_TYPES,
    ConstantLeaf,
    Layout,
    Leaf,
    check_root,
    checked_add,
    checked_mul,
    checked_product,
    component_type,
)

#: Deepest nesting of struct/type declarations accepted (inline levels plus type_ref hops along
#: any path from a declaration or graph value type to a leaf).
MAX_NESTING = 64

_MAP_KEYS = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
             TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
             TensorProto.STRING}


def describe(st: StructTypeProto) -> str:
    """``type_id 1102 ('SCALED_CODEBOOK2_BLOCK_32')``, ``type_ref 1101`` or ``inline structure``."""
    kind = st.WhichOneof("kind")
    if kind == "type_ref":
        return f"type_ref {st.type_ref}"
    if st.HasField("type_id"):
        return f"type_id {st.type_id} ({st.name!r})" if st.name else f"type_id {st.type_id}"
    return f"inline {kind or 'struct category'}" + (f" {st.name!r}" if st.name else "")


class RootType:
    """A resolved byte-encoding root: the concrete declaration, its type_id and its layout.

    Attributes
    ----------
    declaration : StructTypeProto
        The concrete declaration (the catalogue entry for a ``type_ref``, else the inline one).
    type_id : int or None
        None for an inline declaration.
    layout : Layout
        Record layout (root leaf paths; the unnamed leaf of a root array is ``value``).
    """

    __slots__ = ("declaration", "type_id", "layout")

    def __init__(self, declaration: StructTypeProto, type_id: int | None, layout: Layout):
        self.declaration = declaration
        self.type_id = type_id
        self.layout = layout

    @property
    def record_bytes(self) -> int:
        return self.layout.bits // 8

    def describe(self) -> str:
        return describe(self.declaration)


class Catalogue:
    """``ModelProto.struct_types`` resolved by type_id and validated (see module docstring).

    Parameters
    ----------
    struct_types : iterable of StructTypeProto

    Raises
    ------
    CatalogueError, DuplicateTypeIdError, UnresolvedTypeRefError, TypeRefCycleError
        Identity contract violations.
    DeclarationError
        Malformed declarations.
    """

    def __init__(self, struct_types):
        self._decls: dict[int, StructTypeProto] = {}
        self._order: list[int] = []
        for i, st in enumerate(struct_types):
            where = f"struct_types[{i}] ({st.name!r})" if st.name else f"struct_types[{i}]"
            kind = st.WhichOneof("kind")
            if not st.HasField("type_id") or st.type_id == 0:
                raise CatalogueError(
                    f"{where}: a catalogue declaration needs a nonzero type_id, got "
                    f"{st.type_id if st.HasField('type_id') else 'none'}"
                )
            tid = int(st.type_id)
            if tid in self._decls:
                other = self._decls[tid]
                raise DuplicateTypeIdError(
                    f"type_id {tid} is declared twice: {other.name!r} and {st.name!r} at "
                    f"struct_types[{i}] (each ID has exactly one declaration)"
                )
            if kind is None:
                raise CatalogueError(
                    f"type_id {tid} ({st.name!r}): a StructTypeProto with no kind is an "
                    "unconstrained category, never a declaration"
                )
            if kind == "type_ref":
                raise CatalogueError(
                    f"type_id {tid} ({st.name!r}): a catalogue declaration cannot be a type_ref "
                    f"(to {st.type_ref}); declare the concrete layout"
                )
            self._decls[tid] = st
            self._order.append(tid)
        self._refs: dict[int, dict[int, int]] = {}  # tid -> {referenced tid: nesting level}
        self._depth: dict[int, int] = {}  # tid -> nesting depth including referenced types
        self._inline: dict[int, int] = {}
        for tid in self._order:
            refs: dict[int, int] = {}
            self._max_level = 0
            self.check_struct(self._decls[tid], describe(self._decls[tid]), refs, entry=True)
            self._refs[tid] = refs
            self._inline[tid] = self._max_level
        self._check_cycles()
        self._check_depth()
        self._layouts: dict[int, Layout | LayoutError] = {}

    # -- lookup ------------------------------------------------------------------------------
    def __contains__(self, type_id: int) -> bool:
        return type_id in self._decls

    def __len__(self) -> int:
        return len(self._decls)

    def ids(self) -> list[int]:
        """type_ids in catalogue order."""
        return list(self._order)

    def get(self, type_id: int, where: str = "") -> StructTypeProto:
        """The declaration of ``type_id``; :class:`UnresolvedTypeRefError` if absent."""
        try:
            return self._decls[int(type_id)]
        except KeyError:
            known = ", ".join(str(t) for t in self._order) or "none"
            raise UnresolvedTypeRefError(
                f"{where + ': ' if where else ''}type_ref {type_id} does not resolve (catalogue "
                f"type_ids: {known})"
            ) from None

    # -- validation ----------------------------------------------------------------------------
    def _level(self, level: int, where: str) -> None:
        if level > MAX_NESTING:
            raise DeclarationError(
                f"{where}: types nested deeper than {MAX_NESTING} levels (the supported maximum "
                "of inline declarations, element types and type_ref hops)"
            )
        if level > getattr(self, "_max_level", 0):
            self._max_level = level

    def check_struct(self, st: StructTypeProto, where: str, refs: dict | None = None,
                     entry: bool = False, level: int = 0) -> None:
        """Validate one StructTypeProto (identity + declaration rules), collecting type_refs.

        ``refs`` (optional) receives ``{referenced type_id: nesting level}``; ``level`` is the
        nesting level of ``st`` (see :data:`MAX_NESTING`)."""
        self._level(level, where)
        kind = st.WhichOneof("kind")
        if kind == "type_ref":
            extra = [f for f in ("type_id", "name", "doc_string", "decoder", "encoder")
                     if st.HasField(f)]
            if len(st.metadata_props):
                extra.append("metadata_props")
            if extra:
                raise CatalogueError(
                    f"{where}: a type_ref (to {st.type_ref}) contains only the referenced ID; "
                    f"found {', '.join(extra)}"
                )
            if st.type_ref == 0:
                raise CatalogueError(f"{where}: type_ref 0 is invalid (type_ids are nonzero)")
            self.get(st.type_ref, where)
            ref = int(st.type_ref)
            if ref in self._depth:  # catalogue built: the referenced type's own depth counts
                self._level(level + self._depth[ref], f"{where} (via type_ref {ref})")
            if refs is not None:
                refs[ref] = max(refs.get(ref, 0), level)
            return
        if kind is None:
            return  # unconstrained category: callers reject it where a declaration is needed
        if not entry and st.HasField("type_id"):
            raise CatalogueError(
                f"{where}: an inline {kind} declaration has type_id {st.type_id}; inline "
                "declarations have no type_id and cannot be referenced (declare it in "
                "ModelProto.struct_types)"
            )
        if kind == "structure":
            seen: set[str] = set()
            for j, f in enumerate(st.structure.field):
                fw = f"{where} field {f.name!r}" if f.name else f"{where} field #{j}"
                _check_name(f.name, fw, seen, "field")
                content = f.WhichOneof("content")
                if content is None:
                    raise DeclarationError(f"{fw}: a field needs either a type or a constant")
                if content == "type":
                    self.check_type(f.type, fw, refs, level + 1)
                else:
                    constant_value(f.constant, fw)
        elif kind == "array":
            a = st.array
            if not a.HasField("element_type"):
                raise DeclarationError(f"{where}: array without element_type")
            if not a.HasField("dimension"):
                raise DeclarationError(
                    f"{where}: array without an explicit dimension (array lengths are concrete "
                    "integers)"
                )
            self.check_type(a.element_type, f"{where} array element", refs, level + 1)
        else:  # bit_packing
            bp = st.bit_packing
            if not len(bp.component):
                raise DeclarationError(f"{where}: bit_packing without components")
            seen = set()
            for j, c in enumerate(bp.component):
                cw = f"{where} component {c.name!r}" if c.name else f"{where} component #{j}"
                _check_name(c.name, cw, seen, "component")
                if not 1 <= c.bit_width <= 64:
                    raise DeclarationError(f"{cw}: bit_width must be 1..64, got {c.bit_width}")
            if not bp.HasField("dimension"):
                raise DeclarationError(
                    f"{where}: bit_packing without an explicit dimension (counts are concrete "
                    "integers)"
                )

    def check_type(self, tp: TypeProto, where: str, refs: dict | None = None,
                   level: int = 0) -> None:
        """Validate a TypeProto (tensor, sequence, map, optional, struct ...) recursively
        (at most :data:`MAX_NESTING` levels deep, else DeclarationError)."""
        self._level(level, where)
        kind = tp.WhichOneof("value")
        if kind is None:
            raise DeclarationError(f"{where}: TypeProto has no type set")
        if kind in ("tensor_type", "sparse_tensor_type"):
            t = getattr(tp, kind)
            if t.elem_type == TensorProto.UNDEFINED or t.elem_type not in TensorProto.DataType.values():
                raise DeclarationError(
                    f"{where}: tensor element type {dtype_name(t.elem_type)} is not a data type"
                )
            for i, d in enumerate(t.shape.dim):
                if d.WhichOneof("value") == "dim_value" and d.dim_value < 0:
                    raise DeclarationError(f"{where}: dimension {i} is negative ({d.dim_value})")
        elif kind == "sequence_type":
            if not tp.sequence_type.HasField("elem_type"):
                raise DeclarationError(f"{where}: sequence without elem_type")
            self.check_type(tp.sequence_type.elem_type, f"{where} sequence element", refs,
                            level + 1)
        elif kind == "map_type":
            if tp.map_type.key_type not in _MAP_KEYS:
                raise DeclarationError(
                    f"{where}: map key type {dtype_name(tp.map_type.key_type)} is not an "
                    "integer or string type"
                )
            if not tp.map_type.HasField("value_type"):
                raise DeclarationError(f"{where}: map without value_type")
            self.check_type(tp.map_type.value_type, f"{where} map value", refs, level + 1)
        elif kind == "optional_type":
            if not tp.optional_type.HasField("elem_type"):
                raise DeclarationError(f"{where}: optional without elem_type")
            self.check_type(tp.optional_type.elem_type, f"{where} optional element", refs,
                            level + 1)
        elif kind == "struct_type":
            self.check_struct(tp.struct_type, where, refs, level=level + 1)

    def _check_cycles(self) -> None:
        state: dict[int, int] = {}  # 1 = on the stack, 2 = done
        for start in self._order:
            if state.get(start):
                continue
            stack = [(start, iter(sorted(self._refs[start])))]
            path = [start]
            state[start] = 1
            while stack:
                tid, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[tid] = 2
                    stack.pop()
                    path.pop()
                    continue
                if state.get(nxt) == 1:
                    cyc = path[path.index(nxt):] + [nxt]
                    names = " -> ".join(f"{t} ({self._decls[t].name!r})" for t in cyc)
                    raise TypeRefCycleError(f"struct types reference each other in a cycle: {names}")
                if not state.get(nxt):
                    state[nxt] = 1
                    path.append(nxt)
                    stack.append((nxt, iter(sorted(self._refs[nxt]))))

    def _check_depth(self) -> None:
        """Depth of every declaration through its type_refs (iterative; the graph is acyclic)."""
        depth = self._depth
        for start in self._order:
            stack = [start]
            while stack:
                tid = stack[-1]
                if tid in depth:
                    stack.pop()
                    continue
                pending = [r for r in self._refs[tid] if r not in depth]
                if pending:
                    stack.extend(pending)
                    continue
                d = max([self._inline[tid]]
                        + [lv + depth[r] for r, lv in self._refs[tid].items()])
                if d > MAX_NESTING:
                    decl = self._decls[tid]
                    raise DeclarationError(
                        f"{describe(decl)}: types nested deeper than {MAX_NESTING} levels "
                        f"through type_refs (depth {d}; the supported maximum of inline "
                        "declarations, element types and type_ref hops)"
                    )
                depth[tid] = d
                stack.pop()

    # -- layouts ---------------------------------------------------------------------------------
    def layout(self, type_id: int) -> Layout:
        """Record layout of catalogue type ``type_id`` (computed once; errors are cached too).

        Raises
        ------
        LayoutError, SizeOverflowError
            The type is not byte-encodable (reason in the message).
        """
        tid = int(type_id)
        got = self._layouts.get(tid)
        if got is None:
            decl = self.get(tid)
            try:
                got = self._decl_layout(decl, describe(decl))
            except LayoutError as exc:
                got = exc
            self._layouts[tid] = got
        if isinstance(got, LayoutError):
            raise type(got)(str(got))
        return got

    def root(self, st: StructTypeProto, what: str) -> RootType:
        """Resolve ``EncodedValueProto.struct_type``: an exact type_ref or an inline declaration.

        Raises
        ------
        CatalogueError, UnresolvedTypeRefError, DeclarationError
            Identity / declaration errors of an inline root.
        LayoutError, SizeOverflowError
            Not byte-encodable, or record size zero / not a whole number of bytes.
        """
        kind = st.WhichOneof("kind")
        if kind is None:
            raise LayoutError(
                f"{what}: struct_type has no kind; an unconstrained struct category is never a "
                "payload layout"
            )
        self.check_struct(st, f"{what} struct_type")
        if kind == "type_ref":
            decl = self.get(st.type_ref, what)
            try:
                layout = self.layout(st.type_ref)
            except LayoutError as exc:
                raise type(exc)(f"{what}: {exc}") from None
            tid = int(st.type_ref)
        else:
            decl = st
            layout = self._decl_layout(st, f"{what} inline {kind}")
            tid = None
        check_root(layout, f"{what} ({describe(decl)})")
        if any(lf.path == "" for lf in layout.leaves):
            layout = Layout(layout.bits, tuple(
                lf.moved("value", 0) if lf.path == "" else lf for lf in layout.leaves
            ), layout.constants)
        return RootType(decl, tid, layout)

    def _type_layout(self, tp: TypeProto, where: str) -> Layout:
        kind = tp.WhichOneof("value")
        if kind == "tensor_type":
            t = tp.tensor_type
            if t.elem_type not in LEAF_TYPES:
                raise LayoutError(
                    f"{where}: {dtype_name(t.elem_type)} is not a supported fixed-width scalar "
                    "leaf for byte encoding"
                )
            if not t.HasField("shape"):
                raise LayoutError(
                    f"{where}: tensor of unknown rank is not fixed-size (declare shape {{}} for a "
                    "scalar)"
                )
            dims = []
            for i, d in enumerate(t.shape.dim):
                if d.WhichOneof("value") != "dim_value":
                    raise LayoutError(
                        f"{where}: dimension {i} ({d.dim_param or 'unknown'!r}) is not a concrete "
                        "integer; the field is not fixed-size"
                    )
                dims.append(int(d.dim_value))
            bits, leaf_kind, dtype = LEAF_TYPES[t.elem_type]
            size = checked_mul(checked_product(dims, where), bits, where)
            strides = []
            acc = bits
            for d in reversed(dims):
                strides.append(acc)
                acc = checked_mul(acc, d, where)
            strides.reverse()
            leaf = Leaf("", int(t.elem_type), bits, leaf_kind, dtype, tuple(dims), 0, tuple(strides))
            return Layout(size, (leaf,), ())
        if kind == "struct_type":
            st = tp.struct_type
            sk = st.WhichOneof("kind")
            if sk is None:
                raise LayoutError(f"{where}: an unconstrained struct category is not fixed-size")
            if sk == "type_ref":
                try:
                    return self.layout(st.type_ref)
                except LayoutError as exc:
                    raise type(exc)(f"{where}: via type_ref {st.type_ref}: {exc}") from None
            return self._decl_layout(st, where)
        raise LayoutError(
            f"{where}: a {kind} field is not fixed-size inline data (valid as a runtime type, not "
            "as a byte-encoded layout)"
        )

    def _decl_layout(self, decl: StructTypeProto, where: str) -> Layout:
        kind = decl.WhichOneof("kind")
        if kind == "structure":
            off = 0
            leaves: list = []
            consts: list = []
            for f in decl.structure.field:
                fw = f"{where} field {f.name!r}"
                if f.WhichOneof("content") == "constant":
                    consts.append(ConstantLeaf(f.name, int(f.constant.data_type),
                                               constant_value(f.constant, fw)))
                    continue
                sub = self._type_layout(f.type, fw)
                leaves.extend(lf.moved(f.name, off) for lf in sub.leaves)
                consts.extend(c.moved(f.name) for c in sub.constants)
                off = checked_add(off, sub.bits, fw)
            return Layout(off, tuple(leaves), tuple(consts))
        if kind == "array":
            n = int(decl.array.dimension)
            sub = self._type_layout(decl.array.element_type, f"{where} array element")
            bits = checked_mul(n, sub.bits, where)
            return Layout(bits, tuple(lf.moved("", 0, ((n, sub.bits),)) for lf in sub.leaves),
                          sub.constants)
        if kind == "bit_packing":
            bp = decl.bit_packing
            n = int(bp.dimension)
            group = 0
            starts = []
            for c in bp.component:
                starts.append(group)
                group = checked_add(group, int(c.bit_width), where)
            leaves = []
            for c, start in zip(bp.component, starts):
                et, dt = component_type(c.bit_width)
                leaves.append(Leaf(c.name, et, int(c.bit_width), "uint", dt, (n,), start, (group,)))
            return Layout(checked_mul(n, group, where), tuple(leaves), ())
        raise AssertionError(kind)


def _check_name(name: str, where: str, seen: set, what: str) -> None:
    if not name:
        raise DeclarationError(f"{where}: a {what} needs a non-empty name")
    if "." in name:
        raise DeclarationError(
            f"{where}: {what} name {name!r} contains '.', which separates leaf paths"
        )
    if name in seen:
        raise DeclarationError(f"{where}: duplicate {what} name {name!r}")
    seen.add(name)


def constant_value(t: TensorProto, where: str) -> np.ndarray:
    """The array of a ``Field.constant`` (inline, concrete, matching data); DeclarationError."""
    if t.data_location == TensorProto.EXTERNAL:
        raise DeclarationError(f"{where}: constant tensors must be stored inline, not externally")
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        raise DeclarationError(
            f"{where}: constant of type {dtype_name(t.data_type)} is not supported"
        )
    if any(d < 0 for d in t.dims):
        raise DeclarationError(f"{where}: constant dims {list(t.dims)} must be non-negative")
    try:
        arr = param_tensor(t)
    except ValidationError as exc:
        raise DeclarationError(f"{where}: bad constant: {exc}") from None
    arr = np.array(arr)  # own a small copy: constants are shared format data, not payloads
    arr.flags.writeable = False
    return arr
