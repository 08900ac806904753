"""Small builders for olv_runtime's own protobuf messages.

These mirror the most used functions of :mod:`onnx.helper` but produce the message classes of
:mod:`olv_runtime.proto` (compiled from ``proto/onnx_light.proto``), which are different Python
types from onnx's even though the wire format of the standard fields is identical. They also
build the seed 000 extension :class:`~olv_runtime.proto.EncodedValueProto` with the built-in
affine layout.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from olv_runtime.proto import (
    AttributeProto,
    EncodedValueProto,
    NodeProto,
    TensorProto,
    TypeProto,
    ValueInfoProto,
)

__all__ = [
    "make_node",
    "make_attribute",
    "make_tensor",
    "make_tensor_value_info",
    "make_tensor_type",
    "tensor_to_array",
    "make_affine_encoded",
    "np_dtype_to_tensor_type",
    "tensor_type_to_np_dtype",
]

# ONNX element type <-> numpy dtype for the dense types this module reads and writes.
_NP_TO_ONNX: dict[np.dtype, int] = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int16): TensorProto.INT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.uint32): TensorProto.UINT32,
    np.dtype(np.uint64): TensorProto.UINT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}  # + bfloat16 (raw_data: the 16-bit patterns), added by _bfloat16() when first needed
_ONNX_TO_NP: dict[int, np.dtype] = {v: k for k, v in _NP_TO_ONNX.items()}

# Sub-byte storage types: bits per code and signedness.
_SUBBYTE: dict[int, tuple[int, bool]] = {
    TensorProto.INT4: (4, True),
    TensorProto.UINT4: (4, False),
    TensorProto.INT2: (2, True),
    TensorProto.UINT2: (2, False),
}


def np_dtype_to_tensor_type(dtype) -> int:
    """Return the ONNX ``TensorProto.DataType`` of a numpy dtype.

    Parameters
    ----------
    dtype : numpy dtype-like
        One of float32, float16, float64, (u)int8/16/32/64 or bool.

    Returns
    -------
    int
        The ``TensorProto.DataType`` enum value.

    Raises
    ------
    TypeError
        If the dtype has no dense ONNX equivalent handled here.
    """
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        _bfloat16()
    try:
        return _NP_TO_ONNX[dt]
    except KeyError:
        raise TypeError(f"numpy dtype {dt} has no supported ONNX tensor type") from None


def tensor_type_to_np_dtype(elem_type: int) -> np.dtype:
    """Return the numpy dtype of a dense ONNX element type.

    Parameters
    ----------
    elem_type : int
        A ``TensorProto.DataType`` value.

    Returns
    -------
    numpy.dtype

    Raises
    ------
    TypeError
        If the element type is not a dense type handled here.
    """
    if elem_type == TensorProto.BFLOAT16:
        _bfloat16()
    try:
        return _ONNX_TO_NP[int(elem_type)]
    except KeyError:
        raise TypeError(
            f"ONNX element type {elem_type} ({_type_name(elem_type)}) has no numpy dtype here"
        ) from None


_DOMAIN_ALIASES = {"ai.onnx": ""}


def canonical_domain(domain: str) -> str:
    """"" for the standard ONNX domain (also spelled "ai.onnx"), else the domain unchanged."""
    return _DOMAIN_ALIASES.get(domain, domain)


def declared_shape(vi: ValueInfoProto) -> list | None:
    """The declared tensor shape of ``vi``: ints and dim_param names (None for an unnamed
    symbolic dim), or None when ``vi`` is not a tensor or has no shape."""
    if vi.type.WhichOneof("value") != "tensor_type" or not vi.type.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in vi.type.tensor_type.shape.dim:
        which = d.WhichOneof("value")
        dims.append(d.dim_value if which == "dim_value" else (d.dim_param or None))
    return dims


def bfloat16_dtype() -> np.dtype:
    """numpy dtype of bfloat16 (ml_dtypes, imported at the first call: its import costs
    0.1-0.9 s; :data:`olv_runtime.config.LAZY_IMPORTS`)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def pack_codes(codes, bits: int) -> np.ndarray:
    """Pack integer codes into bytes, LSB-first.

    Element ``e`` of the flattened (C order) ``codes`` occupies bits
    ``[(e % (8 // bits)) * bits, ... + bits)`` of byte ``e // (8 // bits)``; the unused high
    bits of the last byte are zero. Signed codes are stored in two's complement (only the low
    ``bits`` bits of each code are kept).

    Parameters
    ----------
    codes : array_like of int
        Codes of any shape; each must fit in ``bits`` bits (signed or unsigned).
    bits : {1, 2, 4, 8}
        Bits per code.

    Returns
    -------
    numpy.ndarray
        ``uint8`` array of ``ceil(codes.size * bits / 8)`` bytes.

    Raises
    ------
    ValueError
        If ``bits`` is not 1, 2, 4 or 8.
    """
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"pack_codes: bits must be 1, 2, 4 or 8, got {bits}")
    flat = np.asarray(codes).reshape(-1)
    if not np.issubdtype(flat.dtype, np.integer) and flat.dtype != np.bool_:
        raise ValueError(f"pack_codes: codes must be integers, got {flat.dtype}")
    mask = (1 << bits) - 1
    c = (flat.astype(np.int64, copy=False) & mask).astype(np.uint8)
    if bits == 8:
        return c
    per = 8 // bits
    n = c.size
    nbytes = -(-n * bits // 8)
    pad = nbytes * per - n
    if pad:
        c = np.concatenate([c, np.zeros(pad, dtype=np.uint8)])
    c = c.reshape(nbytes, per)
    out = np.zeros(nbytes, dtype=np.uint8)
    for j in range(per):
        out |= c[:, j] << np.uint8(j * bits)
    return out


def _bfloat16() -> None:
    """Add bfloat16 to the dtype tables (ml_dtypes is imported only when a bfloat16 value is
    met: its import costs 0.1-0.9 s)."""
    if TensorProto.BFLOAT16 not in _ONNX_TO_NP:
        dt = bfloat16_dtype()
        _NP_TO_ONNX[dt] = TensorProto.BFLOAT16
        _ONNX_TO_NP[TensorProto.BFLOAT16] = dt


def _type_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(int(elem_type))
    except ValueError:
        return "unknown"


def _resolve_type(storage_type) -> int:
    if isinstance(storage_type, str):
        try:
            return TensorProto.DataType.Value(storage_type.upper())
        except ValueError:
            raise ValueError(f"unknown ONNX data type name {storage_type!r}") from None
    return int(storage_type)


def make_attribute(name: str, value) -> AttributeProto:
    """Build an :class:`AttributeProto` from a Python value.

    Parameters
    ----------
    name : str
        Attribute name.
    value : int, float, str, bytes, TensorProto, or sequence of int / float / str
        ``bool`` and integers (including numpy integers) become ``INT``; floats become
        ``FLOAT``; str/bytes become ``STRING``; a :class:`TensorProto` becomes ``TENSOR``;
        a sequence of ints becomes ``INTS``, of floats (or mixed int/float) ``FLOATS``,
        of str ``STRINGS``.

    Returns
    -------
    AttributeProto

    Raises
    ------
    TypeError
        If the value's type is not supported (including an empty sequence, whose type is
        ambiguous).
    """
    attr = AttributeProto()
    attr.name = name
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        attr.type = AttributeProto.INT
        attr.i = int(value)
    elif isinstance(value, (float, np.floating)):
        attr.type = AttributeProto.FLOAT
        attr.f = float(value)
    elif isinstance(value, str):
        attr.type = AttributeProto.STRING
        attr.s = value.encode("utf-8")
    elif isinstance(value, bytes):
        attr.type = AttributeProto.STRING
        attr.s = value
    elif isinstance(value, TensorProto):
        attr.type = AttributeProto.TENSOR
        attr.t.CopyFrom(value)
    elif isinstance(value, (Sequence, np.ndarray)):
        items = list(np.asarray(value).tolist()) if isinstance(value, np.ndarray) else list(value)
        if not items:
            raise TypeError(f"attribute {name!r}: empty sequence has no attribute type")
        if all(isinstance(v, (bool, np.bool_, int, np.integer)) for v in items):
            attr.type = AttributeProto.INTS
            attr.ints.extend(int(v) for v in items)
        elif all(isinstance(v, (int, float, np.integer, np.floating)) for v in items):
            attr.type = AttributeProto.FLOATS
            attr.floats.extend(float(v) for v in items)
        elif all(isinstance(v, (str, bytes)) for v in items):
            attr.type = AttributeProto.STRINGS
            attr.strings.extend(v.encode("utf-8") if isinstance(v, str) else v for v in items)
        else:
            raise TypeError(f"attribute {name!r}: unsupported sequence element types")
    else:
        raise TypeError(f"attribute {name!r}: unsupported value type {type(value).__name__}")
    return attr


def make_node(
    op_type: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str | None = None,
    domain: str = "",
    **attrs,
) -> NodeProto:
    """Build a :class:`NodeProto`.

    Parameters
    ----------
    op_type : str
        Operator type, e.g. ``"MatMul"``.
    inputs, outputs : sequence of str
        Value names; ``""`` marks an omitted optional input/output.
    name : str, optional
        Node name.
    domain : str, default ""
        Operator domain (``""`` is the default ONNX domain).
    **attrs
        Attributes, converted with :func:`make_attribute`. Attributes whose value is ``None``
        are skipped. They are written sorted by name for a deterministic encoding.

    Returns
    -------
    NodeProto
    """
    node = NodeProto()
    node.op_type = op_type
    node.input.extend(inputs)
    node.output.extend(outputs)
    if name is not None:
        node.name = name
    if domain:
        node.domain = domain
    for key in sorted(attrs):
        if attrs[key] is not None:
            node.attribute.append(make_attribute(key, attrs[key]))
    return node


def make_tensor(name: str, array: np.ndarray) -> TensorProto:
    """Build a dense :class:`TensorProto` holding ``array`` in ``raw_data``.

    Parameters
    ----------
    name : str
        Tensor name.
    array : numpy.ndarray
        Data; float32, float16, float64, (u)int8/16/32/64 or bool. Stored little-endian,
        C order.

    Returns
    -------
    TensorProto
    """
    arr = np.asarray(array)
    elem_type = np_dtype_to_tensor_type(arr.dtype)
    t = TensorProto()
    t.name = name
    t.data_type = elem_type
    t.dims.extend(int(d) for d in arr.shape)
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    t.raw_data = np.ascontiguousarray(le).tobytes()
    return t


def make_tensor_type(elem_type, shape: Sequence[int | str | None] | None) -> TypeProto:
    """Build a tensor :class:`TypeProto`.

    Parameters
    ----------
    elem_type : int or str
        ``TensorProto.DataType`` value or its name (``"FLOAT"``).
    shape : sequence of (int, str or None), or None
        Dimensions: int → ``dim_value``, str → ``dim_param``, None → unknown dimension.
        ``None`` for the whole shape means unknown rank.

    Returns
    -------
    TypeProto
    """
    tp = TypeProto()
    tp.tensor_type.elem_type = _resolve_type(elem_type)
    if shape is not None:
        dims = tp.tensor_type.shape.dim
        tp.tensor_type.shape.SetInParent()
        for d in shape:
            dim = dims.add()
            if d is None:
                continue
            if isinstance(d, str):
                dim.dim_param = d
            else:
                dim.dim_value = int(d)
    return tp


def make_tensor_value_info(
    name: str, elem_type, shape: Sequence[int | str | None] | None
) -> ValueInfoProto:
    """Build a :class:`ValueInfoProto` for a tensor value.

    Parameters
    ----------
    name : str
        Value name.
    elem_type : int or str
        ``TensorProto.DataType`` value or name.
    shape : sequence of (int, str or None), or None
        See :func:`make_tensor_type`.

    Returns
    -------
    ValueInfoProto
    """
    vi = ValueInfoProto()
    vi.name = name
    vi.type.CopyFrom(make_tensor_type(elem_type, shape))
    return vi


def tensor_to_array(tensor: TensorProto) -> np.ndarray:
    """Convert a dense :class:`TensorProto` to a numpy array.

    Reads ``raw_data`` (little-endian) when present, otherwise the typed fields
    (``float_data``, ``int32_data``, ``int64_data``, ``double_data``, ``uint64_data``).
    FLOAT16 and BOOL/(u)int8/(u)int16 in ``int32_data`` are handled as in ONNX.

    Parameters
    ----------
    tensor : TensorProto
        An in-memory tensor (not external data).

    Returns
    -------
    numpy.ndarray
        A new array of the tensor's shape (a read-only view for ``raw_data``).

    Raises
    ------
    ValueError
        For external data, or a data size that does not match the dims.
    TypeError
        For element types not handled here (e.g. BFLOAT16, sub-byte types, strings).
    """
    if tensor.data_location == TensorProto.EXTERNAL:
        raise ValueError(f"tensor {tensor.name!r} stores its data externally; load it first")
    dtype = tensor_type_to_np_dtype(tensor.data_type)
    shape = tuple(int(d) for d in tensor.dims)
    count = int(np.prod(shape, dtype=np.int64))
    if tensor.HasField("raw_data"):
        raw = tensor.raw_data
        if len(raw) != count * dtype.itemsize:
            raise ValueError(
                f"tensor {tensor.name!r}: raw_data has {len(raw)} bytes, dims {list(shape)} of "
                f"{dtype} need {count * dtype.itemsize}"
            )
        arr = np.frombuffer(raw, dtype=dtype.newbyteorder("<"), count=count)
        return arr.astype(dtype, copy=False).reshape(shape)
    et = tensor.data_type
    if et == TensorProto.FLOAT:
        data = np.asarray(tensor.float_data, dtype=np.float32)
    elif et == TensorProto.DOUBLE:
        data = np.asarray(tensor.double_data, dtype=np.float64)
    elif et == TensorProto.INT64:
        data = np.asarray(tensor.int64_data, dtype=np.int64)
    elif et in (TensorProto.UINT32, TensorProto.UINT64):
        data = np.asarray(tensor.uint64_data, dtype=np.uint64).astype(dtype)
    elif et == TensorProto.FLOAT16:
        # int32_data holds the raw 16-bit patterns.
        data = np.asarray(tensor.int32_data, dtype=np.int32).astype(np.uint16).view(np.float16)
    else:  # INT32, INT16, INT8, UINT16, UINT8, BOOL: int32_data
        data = np.asarray(tensor.int32_data, dtype=np.int32).astype(dtype)
    if data.size != count:
        raise ValueError(
            f"tensor {tensor.name!r}: {data.size} elements stored, dims {list(shape)} need {count}"
        )
    return data.reshape(shape)


def make_affine_encoded(
    name: str,
    codes_payload: bytes,
    storage_type,
    logical_shape: Sequence[int],
    scale: np.ndarray,
    zero_point: np.ndarray | None = None,
    axis: int | None = None,
    block_size: int | None = None,
) -> EncodedValueProto:
    """Build an :class:`EncodedValueProto` with the built-in affine layout.

    The logical value is ``DequantizeLinear(codes, scale, zero_point, axis, block_size)`` of
    logical type FLOAT ``logical_shape``.

    Parameters
    ----------
    name : str
        Value name (as used by graph nodes).
    codes_payload : bytes
        The packed codes, row-major over ``logical_shape`` (sub-byte codes LSB-first, two
        4-bit codes per byte), stored in ``raw_data``.
    storage_type : int or str
        Code type: INT8, UINT8, INT4, UINT4, INT2 or UINT2.
    logical_shape : sequence of int
        Shape of the decoded tensor.
    scale : numpy.ndarray
        Floating-point scale tensor (DequantizeLinear shapes: scalar, ``[shape[axis]]``, or
        blocked with ``shape[axis]`` replaced by ``ceil(shape[axis] / block_size)``).
    zero_point : numpy.ndarray, optional
        Integer zero points of the scale's shape, stored as ``storage_type`` (sub-byte types
        packed LSB-first). Absent means zero.
    axis : int, optional
        Quantization axis; absent means per-tensor.
    block_size : int, optional
        Block size along ``axis`` (blocked quantization); requires ``axis``.

    Returns
    -------
    EncodedValueProto

    Raises
    ------
    ValueError
        If ``block_size`` is given without ``axis`` or the storage type is not an affine code
        type.
    """
    st = _resolve_type(storage_type)
    if st not in _SUBBYTE and st not in (TensorProto.INT8, TensorProto.UINT8):
        raise ValueError(f"{name}: storage_type {_type_name(st)} is not an affine code type")
    if block_size is not None and axis is None:
        raise ValueError(f"{name}: block_size requires axis")
    ev = EncodedValueProto()
    ev.name = name
    aff = ev.affine
    aff.storage_type = st
    aff.scale.CopyFrom(make_tensor("", np.asarray(scale)))
    aff.scale.ClearField("name")
    if zero_point is not None:
        zp = np.asarray(zero_point)
        zt = TensorProto()
        zt.data_type = st
        zt.dims.extend(int(d) for d in zp.shape)
        if st in _SUBBYTE:
            zt.raw_data = pack_codes(zp, _SUBBYTE[st][0]).tobytes()
        else:
            zt.raw_data = zp.astype(np.int8 if st == TensorProto.INT8 else np.uint8).tobytes()
        aff.zero_point.CopyFrom(zt)
    if axis is not None:
        aff.axis = int(axis)
    if block_size is not None:
        aff.block_size = int(block_size)
    ev.logical_type.CopyFrom(make_tensor_type(TensorProto.FLOAT, list(logical_shape)))
    ev.raw_data = bytes(codes_payload)
    return ev
