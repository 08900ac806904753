"""Validation of ``graph.persistent_bindings`` (seed 000 "Persistent state from model inputs and
outputs", "Minimal rules"): :func:`resolve_bindings` pairs each bound input with the output that
feeds it back and checks their types agree (tensors and struct types), that no binding is nested
in a subgraph and no bound value holds strings. Used by :func:`olv_runtime.state.make_state` and by
:meth:`olv_runtime.builder.GraphBuilder.to_model`.
"""
from __future__ import annotations

from olv_runtime.errors import BindingError
from olv_runtime.io import Model
from olv_runtime.proto import TensorProto, TypeProto
from olv_runtime.proto.helper import declared_shape
from olv_runtime.structs.initializers import dtype_name


def resolve_bindings(model: Model) -> list[tuple[str, str]]:
    """Validate ``graph.persistent_bindings`` of the root graph; return (input, output) pairs.

    Names are exact whole input/output names: dots and backslashes are literal characters, not
    field paths (seed 000 "Graph-level persistence declaration"). Only metadata is read: the
    model is not serialized or copied.

    Parameters
    ----------
    model : Model

    Returns
    -------
    list of (str, str)
        (input_name, output_name) in declaration order.

    Raises
    ------
    BindingError
        An empty or unknown input/output name (the message lists the graph's names), an input
        that is an initializer, duplicate input or output selections, type kinds that differ,
        element type / rank / fixed dimension mismatches, struct types that differ, a string
        tensor anywhere in the selected type (nested struct fields, constant fields, sequence
        elements, following ``type_ref`` through ``ModelProto.struct_types``), bindings
        declared inside a control-flow subgraph or a local function's subgraph.
    """
    proto = model.proto
    g = proto.graph
    inputs = {vi.name: vi for vi in g.input}
    outputs = {vi.name: vi for vi in g.output}
    inits = {t.name for t in g.initializer} | {e.name for e in g.encoded_initializer}
    for node in g.node:
        _reject_nested_bindings(node)
    for fn in proto.functions:
        for node in fn.node:
            _reject_nested_bindings(node, f"function {fn.domain}::{fn.name} ")
    catalogue = {int(st.type_id): st for st in proto.struct_types if st.type_id}
    pairs: list[tuple[str, str]] = []
    seen_in: dict[str, str] = {}
    seen_out: dict[str, str] = {}
    for b in g.persistent_bindings:
        i, o = b.input_name, b.output_name
        what = f"persistent binding {i!r} <- {o!r}"
        if i not in inputs:
            raise BindingError(
                f"{what}: {i!r} is not an input of the root graph; inputs are {sorted(inputs)} "
                "(names are exact: dots and backslashes are literal)"
            )
        if i in inits:
            raise BindingError(f"{what}: {i!r} is an initializer, not a free input")
        if o not in outputs:
            raise BindingError(
                f"{what}: {o!r} is not an output of the root graph; outputs are "
                f"{sorted(outputs)} (names are exact: dots and backslashes are literal)"
            )
        if i in seen_in:
            raise BindingError(
                f"{what}: input {i!r} is already selected (by <- {seen_in[i]!r}); an input is "
                "bound at most once"
            )
        if o in seen_out:
            raise BindingError(
                f"{what}: output {o!r} is already selected (by {seen_out[o]!r} <-); an output "
                "is bound at most once"
            )
        seen_in[i] = o
        seen_out[o] = i
        _check_pair(what, inputs[i], outputs[o], catalogue)
        pairs.append((i, o))
    return pairs


def _check_pair(what: str, vin, vout, catalogue: dict) -> None:
    ti, to = vin.type, vout.type
    ki, ko = ti.WhichOneof("value"), to.WhichOneof("value")
    if ki is None or ko is None:
        raise BindingError(f"{what}: the input and output must both declare a type")
    if ki != ko:
        raise BindingError(f"{what}: input is {ki}, output is {ko}")
    for side, t in ((vin.name, ti), (vout.name, to)):
        path = _string_path(t, catalogue, side, set())
        if path is not None:
            raise BindingError(f"{what}: {path} is a string tensor; strings cannot persist")
    if ki == "tensor_type":
        ei, eo = ti.tensor_type.elem_type, to.tensor_type.elem_type
        if ei != eo:
            raise BindingError(
                f"{what}: element types differ ({dtype_name(ei)} vs {dtype_name(eo)})"
            )
        si, so = declared_shape(vin), declared_shape(vout)
        if si is not None and so is not None:
            if len(si) != len(so):
                raise BindingError(f"{what}: ranks differ ({si} vs {so})")
            for k, (a, c) in enumerate(zip(si, so)):
                if isinstance(a, int) and isinstance(c, int) and a != c:
                    raise BindingError(f"{what}: dimension {k} differs ({a} vs {c})")
    elif ki == "struct_type":
        di = _deref(ti.struct_type, catalogue, what)
        do = _deref(to.struct_type, catalogue, what)
        if di is not do and di != do:
            raise BindingError(
                f"{what}: the input and output struct types differ "
                f"({_struct_name(ti.struct_type)} vs {_struct_name(to.struct_type)})"
            )
    elif ti != to:  # sequence, optional, map: the same declared type
        raise BindingError(f"{what}: the input and output {ki} types differ")


def _struct_name(st) -> str:
    if st.WhichOneof("kind") == "type_ref":
        return f"type_ref {st.type_ref}"
    return st.name or f"inline {st.WhichOneof('kind')}"


def _deref(st, catalogue: dict, what: str):
    seen = set()
    while st.WhichOneof("kind") == "type_ref":
        ref = int(st.type_ref)
        if ref in seen or ref not in catalogue:
            raise BindingError(f"{what}: type_ref {ref} does not resolve in ModelProto.struct_types")
        seen.add(ref)
        st = catalogue[ref]
    return st


def _string_path(t: TypeProto, catalogue: dict, path: str, refs: set) -> str | None:
    """Path of the first string tensor inside type ``t`` (None if there is none)."""
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        return path if t.tensor_type.elem_type == TensorProto.STRING else None
    if kind == "sparse_tensor_type":
        return path if t.sparse_tensor_type.elem_type == TensorProto.STRING else None
    if kind == "sequence_type":
        return _string_path(t.sequence_type.elem_type, catalogue, path + "[]", refs)
    if kind == "optional_type":
        return _string_path(t.optional_type.elem_type, catalogue, path, refs)
    if kind == "map_type":
        if t.map_type.key_type == TensorProto.STRING:
            return path + " (map key)"
        return _string_path(t.map_type.value_type, catalogue, path + "[value]", refs)
    if kind == "struct_type":
        return _struct_string_path(t.struct_type, catalogue, path, refs)
    return None


def _struct_string_path(st, catalogue: dict, path: str, refs: set) -> str | None:
    kind = st.WhichOneof("kind")
    if kind == "type_ref":
        ref = int(st.type_ref)
        if ref in refs:
            return None
        if ref not in catalogue:
            raise BindingError(f"{path}: type_ref {ref} does not resolve in ModelProto.struct_types")
        return _struct_string_path(catalogue[ref], catalogue, path, refs | {ref})
    if kind == "structure":
        for f in st.structure.field:
            sub = f"{path}.{f.name}"
            if f.HasField("constant"):
                if f.constant.data_type == TensorProto.STRING:
                    return sub + " (constant)"
            elif f.HasField("type"):
                found = _string_path(f.type, catalogue, sub, refs)
                if found is not None:
                    return found
        return None
    if kind == "array":
        return _string_path(st.array.element_type, catalogue, path + "[]", refs)
    return None


def _reject_nested_bindings(node, where: str = "") -> None:
    for attr in node.attribute:
        subs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for sub in subs:
            if len(sub.persistent_bindings):
                b = sub.persistent_bindings[0]
                raise BindingError(
                    f"{where}node {node.name!r} ({node.op_type}) attribute {attr.name!r}: "
                    f"persistent binding {b.input_name!r} <- {b.output_name!r} is declared inside "
                    "a control-flow subgraph; bindings are supported on the root graph only"
                )
            for inner in sub.node:
                _reject_nested_bindings(inner, where)


# -- the state -------------------------------------------------------------------------------
