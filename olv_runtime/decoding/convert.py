"""Encoded versus decoded, for users' tests: :func:`decode_value` and :func:`to_decoded`."""
from __future__ import annotations

import numpy as np

from olv_runtime.decoding.decoders import resolve
from olv_runtime.errors import EncodingError
from olv_runtime.io import Model, as_model
from olv_runtime.proto import ModelProto
from olv_runtime.structs.initializers import onnx_type_of

__all__ = ["decode_value", "to_decoded"]


def decode_value(model, name: str) -> np.ndarray:
    """The logical tensor of one encoded initializer.

    Parameters
    ----------
    model : Model, ModelProto, onnx.ModelProto or path
    name : str
        Name of an entry of ``graph.encoded_initializer``.

    Returns
    -------
    numpy.ndarray
        Exactly the value's ``logical_type`` (element type and shape): built-in affine values
        by DequantizeLinear, struct values by their native or FunctionProto decoder.

    Raises
    ------
    InvalidArgument
        No encoded initializer has that name.
    MissingDecoderError
        The value's struct type has no decoder.
    ValidationError (and subclasses)
        The model's representation layer is invalid (validated once, before any decoder runs).
    """
    return resolve(as_model(model)).value(name).decode()


def to_decoded(model) -> Model:
    """A copy of the model with every encoded initializer replaced by its dense decode.

    Each encoded initializer ``W`` becomes a dense ``TensorProto`` initializer ``W`` (raw_data,
    its logical type and shape); each ``olv.Decode(W)`` node becomes ``Identity(W)`` with the
    same name and output, and graph inputs / value_info naming ``W`` get the logical tensor type.
    Everything else (nodes, dense initializers - external ones keep their location -, struct
    catalogue, persistent bindings, metadata) is unchanged, so the two models can be run side by
    side and their outputs compared.

    Parameters
    ----------
    model : Model, ModelProto, onnx.ModelProto or path

    Returns
    -------
    Model
        In memory; its ``path`` is the original's, so external dense data still resolves.

    Raises
    ------
    MissingDecoderError
        An encoded value has no decoder.
    EncodingError
        An encoded value has no logical_type (it has no dense equivalent).
    """
    m = as_model(model)
    resolved = resolve(m)
    dense = {}
    for name, value in resolved.values.items():
        if getattr(value, "logical", True) is None:
            raise EncodingError(
                f"encoded value {name!r} has no logical_type, so it has no dense equivalent"
            )
        dense[name] = np.ascontiguousarray(value.decode())
    proto = ModelProto()
    proto.CopyFrom(m.proto)
    g = proto.graph
    del g.encoded_initializer[:]
    for name, arr in dense.items():
        t = g.initializer.add()
        t.name = name
        t.data_type = onnx_type_of(arr)
        t.dims.extend(arr.shape)
        t.raw_data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    for node in g.node:
        if node.domain == "olv" and node.op_type == "Decode" and node.input and node.input[0] in dense:
            node.op_type = "Identity"
            node.domain = ""
    for section in (g.input, g.value_info):
        for vi in section:
            if vi.name in dense:
                arr = dense[vi.name]
                vi.type.Clear()
                vi.type.tensor_type.elem_type = onnx_type_of(arr)
                vi.type.tensor_type.shape.SetInParent()
                for d in arr.shape:
                    vi.type.tensor_type.shape.dim.add().dim_value = d
    return Model(proto, m.path)


