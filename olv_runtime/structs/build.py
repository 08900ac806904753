"""Builders for struct declarations and struct-typed encoded values (seed 000 notation).

::

    decl = declare(1102, "SCALED_CODEBOOK2_BLOCK_32", structure(
        field("quantized", ref(1101)),
        field("scale", tensor("FLOAT", [])),
    ), decoder=fn)
    ev = make_struct_encoded("w", 1102, payload, logical=("FLOAT", [32]))

Types are ``TypeProto``; ``structure`` / ``array`` / ``bit_packing`` build ``StructTypeProto``
kinds and may be used as field types directly (they are wrapped into ``TypeProto.struct_type``).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from olv_runtime.proto import (
    EncodedValueProto,
    FunctionProto,
    StructTypeProto,
    TensorProto,
    TypeProto,
)
from olv_runtime.proto.helper import make_tensor, make_tensor_type

__all__ = ["tensor", "scalar", "ref", "array", "bit_packing", "structure", "field",
           "const_field", "declare", "make_struct_encoded", "as_type", "make_function"]


def tensor(elem_type, dims: Sequence[int]) -> TypeProto:
    """``tensor(T, dims)``: a TypeProto with a concrete shape (``[]`` for a scalar)."""
    return make_tensor_type(elem_type, list(dims))


def scalar(elem_type) -> TypeProto:
    """``tensor(T, [])``."""
    return tensor(elem_type, [])


def ref(type_id: int) -> TypeProto:
    """``{struct_type: {type_ref: id}}``."""
    tp = TypeProto()
    tp.struct_type.type_ref = int(type_id)
    return tp


def as_type(t) -> TypeProto:
    """A TypeProto from a TypeProto, a StructTypeProto (wrapped) or an ONNX type name (scalar)."""
    if isinstance(t, TypeProto):
        return t
    if isinstance(t, StructTypeProto):
        tp = TypeProto()
        tp.struct_type.CopyFrom(t)
        return tp
    return scalar(t)


def array(element, dimension: int) -> StructTypeProto:
    """``Array(element, dimension)`` (element: type or type name)."""
    st = StructTypeProto()
    st.array.element_type.CopyFrom(as_type(element))
    st.array.dimension = int(dimension)
    return st


def bit_packing(components: Sequence[tuple[str, int]], dimension: int) -> StructTypeProto:
    """``BitPacking((name, bit_width)..., dimension)``."""
    st = StructTypeProto()
    for name, width in components:
        st.bit_packing.component.add(name=name, bit_width=int(width))
    st.bit_packing.dimension = int(dimension)
    return st


def field(name: str, type_) -> StructTypeProto.Structure.Field:
    """A typed field."""
    f = StructTypeProto.Structure.Field(name=name)
    f.type.CopyFrom(as_type(type_))
    return f


def const_field(name: str, value, elem_type=None) -> StructTypeProto.Structure.Field:
    """A constant field holding ``value`` (numpy array or TensorProto)."""
    f = StructTypeProto.Structure.Field(name=name)
    if isinstance(value, TensorProto):
        f.constant.CopyFrom(value)
    else:
        t = make_tensor("", np.asarray(value))
        t.ClearField("name")
        f.constant.CopyFrom(t)
    return f


def structure(*fields) -> StructTypeProto:
    """``Structure(fields...)``."""
    st = StructTypeProto()
    st.structure.SetInParent()
    st.structure.field.extend(fields)
    return st


def declare(type_id: int | None, name: str, kind: StructTypeProto,
            decoder: FunctionProto | None = None) -> StructTypeProto:
    """A catalogue declaration (``type_id`` None: an inline declaration)."""
    st = StructTypeProto()
    st.CopyFrom(kind)
    if type_id is not None:
        st.type_id = int(type_id)
    if name:
        st.name = name
    if decoder is not None:
        st.decoder.CopyFrom(decoder)
    return st


def make_struct_encoded(name: str, struct_type, payload: bytes,
                        logical: tuple | None = None) -> EncodedValueProto:
    """An EncodedValueProto with a struct layout and an inline payload.

    Parameters
    ----------
    name : str
    struct_type : int or StructTypeProto
        A type_id (exact ``type_ref``) or an inline declaration.
    payload : bytes
        The records, densely.
    logical : (elem_type, dims), optional
        The logical tensor type.
    """
    ev = EncodedValueProto(name=name)
    if isinstance(struct_type, StructTypeProto):
        ev.struct_type.CopyFrom(struct_type)
    else:
        ev.struct_type.type_ref = int(struct_type)
    if logical is not None:
        ev.logical_type.CopyFrom(make_tensor_type(logical[0], list(logical[1])))
    ev.raw_data = bytes(payload)
    return ev


def make_function(name: str, inputs: Sequence[str], outputs: Sequence[str], nodes,
                  opsets: Sequence[tuple[str, int]] = (("", 21),),
                  domain: str = "olv.decoders") -> FunctionProto:
    """A FunctionProto (e.g. a struct decoder)."""
    fn = FunctionProto(name=name, domain=domain)
    fn.input.extend(inputs)
    fn.output.extend(outputs)
    fn.node.extend(nodes)
    for d, v in opsets:
        fn.opset_import.add(domain=d, version=v)
    return fn
