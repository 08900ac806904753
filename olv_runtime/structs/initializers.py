"""Runtime views of initializers: dense tensors and affine-encoded values.

:func:`tensor_from_proto` turns a ``TensorProto`` into a numpy array viewing the model's payload
(no copy for ``raw_data`` and external data). :class:`AffineValue` is the validated runtime view
of an ``EncodedValueProto`` with the built-in affine layout (seed 000 "The specialized affine
branch"): storage type, logical shape, axis, block size, scale / zero_point arrays and the code
payload as a ``uint8`` view. Decoding follows ONNX DequantizeLinear.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from olv_runtime.errors import (
    AffineLayoutError,
    EncodingError,
    MissingDecoderError,
    ValidationError,
)
from olv_runtime.kernels.affine import dequantize_affine, unpack_codes
from olv_runtime.proto import EncodedValueProto, TensorProto, TypeProto

#: ONNX TensorProto.DataType → numpy dtype for dense tensors the runtime reads.
NP_DTYPE = {
    TensorProto.FLOAT: np.dtype("<f4"),
    TensorProto.UINT8: np.dtype("u1"),
    TensorProto.INT8: np.dtype("i1"),
    TensorProto.UINT16: np.dtype("<u2"),
    TensorProto.INT16: np.dtype("<i2"),
    TensorProto.INT32: np.dtype("<i4"),
    TensorProto.INT64: np.dtype("<i8"),
    TensorProto.BOOL: np.dtype("?"),
    TensorProto.FLOAT16: np.dtype("<f2"),
    TensorProto.DOUBLE: np.dtype("<f8"),
    TensorProto.UINT32: np.dtype("<u4"),
    TensorProto.UINT64: np.dtype("<u8"),
}
DTYPE_TO_ONNX = {v.newbyteorder("="): k for k, v in NP_DTYPE.items()}

#: Affine storage types of seed 000: data type → (bit width, signed).
AFFINE_STORAGE = {
    TensorProto.INT8: (8, True),
    TensorProto.UINT8: (8, False),
    TensorProto.INT4: (4, True),
    TensorProto.UINT4: (4, False),
    TensorProto.INT2: (2, True),
    TensorProto.UINT2: (2, False),
}
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)


#: Largest tensor rank the runtime accepts (numpy 1.x's limit; numpy 2 allows 64).
MAX_RANK = 32
_INT64_MAX = (1 << 63) - 1


def check_dims(dims, what: str, error: type = ValidationError, itemsize: int = 1) -> tuple:
    """Validate concrete tensor dims: non-negative, rank <= :data:`MAX_RANK`, size representable.

    Parameters
    ----------
    dims : sequence of int
        ``TensorProto.dims`` or the dim_values of a TensorShapeProto.
    what : str
        What is being checked (named in the message).
    error : type
        The exception class raised (a :class:`ValidationError` subclass).
    itemsize : int
        Bytes per element; the product of the non-zero dims times itemsize must fit in int64
        (numpy refuses larger arrays even when another dim is 0).

    Returns
    -------
    tuple of int

    Raises
    ------
    ``error``
        A negative dim, a rank above MAX_RANK, or a size that overflows int64.
    """
    if len(dims) > MAX_RANK:
        raise error(f"{what}: rank {len(dims)} exceeds the supported maximum {MAX_RANK}")
    out = tuple(int(d) for d in dims)
    acc = max(int(itemsize), 1)
    for i, d in enumerate(out):
        if d < 0:
            raise error(f"{what}: dimension {i} is negative ({d}) in dims {list(out)}")
        if d:
            acc *= d
            if acc > _INT64_MAX:
                raise error(
                    f"{what}: dims {list(out)} describe more than 2**63 bytes (the product of "
                    "the non-zero dims overflows int64)"
                )
    return out


def dtype_name(elem_type: int) -> str:
    """The ONNX name of a TensorProto.DataType number (``'FLOAT'``, ``'INT4'``, ...)."""
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<unknown data type {elem_type}>"


def onnx_type_of(array: np.ndarray) -> int:
    """TensorProto.DataType of a numpy array's dtype; ValidationError if unsupported."""
    try:
        return DTYPE_TO_ONNX[array.dtype.newbyteorder("=")]
    except KeyError:
        raise ValidationError(f"numpy dtype {array.dtype} has no supported ONNX type") from None


def _typed_field(t: TensorProto, n: int) -> np.ndarray:
    et = t.data_type
    if et == TensorProto.FLOAT:
        return np.asarray(t.float_data, np.float32)
    if et == TensorProto.DOUBLE:
        return np.asarray(t.double_data, np.float64)
    if et == TensorProto.INT64:
        return np.asarray(t.int64_data, np.int64)
    if et in (TensorProto.UINT64, TensorProto.UINT32):
        return np.asarray(t.uint64_data, NP_DTYPE[et])
    if et in (TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT16,
              TensorProto.UINT8, TensorProto.BOOL):
        return np.asarray(t.int32_data, np.int32).astype(NP_DTYPE[et])
    if et == TensorProto.FLOAT16:
        return np.asarray(t.int32_data, np.uint16).view(np.float16)
    raise ValidationError(f"tensor {t.name!r}: data type {dtype_name(et)} is not supported")


def tensor_from_proto(t: TensorProto, payload: np.ndarray | None = None) -> np.ndarray:
    """A numpy array for a dense ``TensorProto``.

    Parameters
    ----------
    t : TensorProto
    payload : numpy.ndarray, optional
        The ``uint8`` payload view from :meth:`olv_runtime.io.Model.payload` (required for
        external data; inline ``raw_data`` is viewed directly when omitted).

    Returns
    -------
    numpy.ndarray
        Shape ``t.dims``, dtype from ``t.data_type``; a read-only view of the payload when the
        data is in ``raw_data`` or external, else built from the typed repeated fields.

    Raises
    ------
    ValidationError
        Unsupported data type (e.g. STRING) or a payload size that does not match the shape.
    """
    et = t.data_type
    if et not in NP_DTYPE:
        raise ValidationError(
            f"tensor {t.name!r}: data type {dtype_name(et)} is not supported by the runtime"
        )
    dt = NP_DTYPE[et]
    dims = check_dims(t.dims, f"tensor {t.name!r}", itemsize=dt.itemsize)
    n = math.prod(dims)
    if payload is None and t.data_location != TensorProto.EXTERNAL and not t.HasField("raw_data"):
        arr = _typed_field(t, n)
        if arr.size != n:
            raise ValidationError(
                f"tensor {t.name!r}: {arr.size} typed elements for shape {list(dims)} ({n} expected)"
            )
        arr = arr.reshape(dims)
        arr.flags.writeable = False
        return arr
    if payload is None:
        payload = np.frombuffer(t.raw_data, np.uint8)
    if payload.size != n * dt.itemsize:
        raise ValidationError(
            f"tensor {t.name!r}: payload has {payload.size} bytes, shape {list(dims)} of "
            f"{dtype_name(et)} needs {n * dt.itemsize}"
        )
    if n == 0:
        return np.zeros(dims, dt)
    if payload.ctypes.data % dt.alignment:
        raise ValidationError(
            f"tensor {t.name!r}: payload is not {dt.alignment}-byte aligned; the runtime does not "
            "copy it silently (re-save the model with olv_runtime.save)"
        )
    arr = payload.view(dt).reshape(dims)
    if dt.byteorder == "<" and np.little_endian is False:  # pragma: no cover - big endian hosts
        raise ValidationError("big-endian hosts are not supported")
    return arr


#: Sub-byte integer tensor types (packed in raw_data, LSB first): type → (bits, signed).
SUBBYTE = {
    TensorProto.INT4: (4, True),
    TensorProto.UINT4: (4, False),
    TensorProto.INT2: (2, True),
    TensorProto.UINT2: (2, False),
}


def param_tensor(t: TensorProto, payload: np.ndarray | None = None) -> np.ndarray:
    """Like :func:`tensor_from_proto`, also accepting packed INT4/UINT4/INT2/UINT2 tensors.

    Sub-byte tensors (quantization parameters such as zero_point) are unpacked into an
    int8/uint8 array: a small explicit copy of parameters, never of a payload.

    Raises
    ------
    ValidationError
        As :func:`tensor_from_proto`; a packed payload of the wrong size.
    """
    if t.data_type not in SUBBYTE:
        return tensor_from_proto(t, payload)
    bits, signed = SUBBYTE[t.data_type]
    dims = check_dims(t.dims, f"tensor {t.name!r}")
    n = math.prod(dims)
    if payload is None:
        if t.HasField("raw_data"):
            payload = np.frombuffer(t.raw_data, np.uint8)
        else:  # typed storage: int32_data holds the packed bytes (ONNX convention)
            payload = np.asarray(t.int32_data, np.int64).astype(np.uint8)
    need = -(-n * bits // 8)
    if payload.size != need:
        raise ValidationError(
            f"tensor {t.name!r}: {dtype_name(t.data_type)} shape {list(dims)} needs {need} "
            f"packed bytes, got {payload.size}"
        )
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    codes = ((payload[:, None] >> shifts[None, :]) & ((1 << bits) - 1)).reshape(-1)[:n]
    if signed:
        codes = codes.astype(np.int8)
        codes = np.where(codes >= (1 << (bits - 1)), codes - (1 << bits), codes).astype(np.int8)
    else:
        codes = codes.astype(np.uint8)
    return codes.reshape(dims)


def tensor_type_shape(tp: TypeProto, what: str,
                      error: type = EncodingError) -> tuple[int, tuple[int, ...]]:
    """(elem_type, concrete dims) of a tensor TypeProto; ``error`` (EncodingError) if not concrete."""
    if tp.WhichOneof("value") != "tensor_type":
        raise error(f"{what}: logical_type must be a tensor type, got {tp.WhichOneof('value')}")
    tt = tp.tensor_type
    dims = []
    for i, d in enumerate(tt.shape.dim):
        if d.WhichOneof("value") != "dim_value" or d.dim_value < 0:
            raise error(
                f"{what}: logical_type dimension {i} must be a concrete non-negative integer, "
                f"got {d.dim_param or d.WhichOneof('value')!r}"
            )
        dims.append(int(d.dim_value))
    if not tt.HasField("shape"):
        raise error(f"{what}: logical_type has no shape (the affine branch needs one)")
    item = NP_DTYPE[tt.elem_type].itemsize if tt.elem_type in NP_DTYPE else 1
    return tt.elem_type, check_dims(dims, f"{what}: logical_type", error, item)


@dataclasses.dataclass(frozen=True)
class AffineValue:
    """Validated runtime view of an affine ``EncodedValueProto`` (seed 000 affine branch).

    Attributes
    ----------
    name : str
    storage_type : int
        TensorProto.DataType of the codes (INT8, UINT8, INT4, UINT4, INT2, UINT2).
    bits : int
        Code width in bits (8, 4 or 2).
    signed : bool
    shape : tuple of int
        Logical shape (the decoded tensor's dims).
    elem_type : int
        Logical element type (FLOAT, FLOAT16 or DOUBLE): the scale's type, or FLOAT with a
        FLOAT16 scale (DequantizeLinear with ``output_dtype`` FLOAT, ONNX opset 23: the float16
        scale is widened exactly and the product computed in float32).
    axis : int or None
        Normalised quantization axis (None: per-tensor).
    block_size : int or None
        Block length along ``axis`` (None: per-axis / per-tensor).
    scale : numpy.ndarray
        DequantizeLinear scale: scalar, ``[shape[axis]]`` or blocked (``shape`` with
        ``shape[axis]`` replaced by ``ceil(shape[axis] / block_size)``).
    zero_point : numpy.ndarray or None
        Same shape as ``scale``, dtype int8 / uint8 (INT4/INT2 values held in 8 bits).
    codes : numpy.ndarray
        ``uint8`` payload view, ``ceil(n * bits / 8)`` bytes, codes row-major, LSB first.
    """

    name: str
    storage_type: int
    bits: int
    signed: bool
    shape: tuple
    elem_type: int
    axis: int | None
    block_size: int | None
    scale: np.ndarray
    zero_point: np.ndarray | None
    codes: np.ndarray

    @property
    def size(self) -> int:
        """Number of logical elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus parameters (what a kernel reads to use the whole value)."""
        zp = self.zero_point.nbytes if self.zero_point is not None else 0
        return self.codes.nbytes + self.scale.nbytes + zp

    def is_int4_rows_blocked(self) -> bool:
        """True for the fused-kernel form: 2-D, INT4, blocked along axis 1."""
        return (
            len(self.shape) == 2
            and self.storage_type == TensorProto.INT4
            and self.axis == 1
            and self.block_size is not None
            and self.scale.dtype in (np.float32, np.float16)
            and self.elem_type == TensorProto.FLOAT
        )

    def decode(self, out: np.ndarray | None = None) -> np.ndarray:
        """Decode the whole logical tensor (ONNX DequantizeLinear); see kernels.affine."""
        if self.elem_type == TensorProto.DOUBLE:
            # DequantizeLinear with a DOUBLE scale: float32(q - zp) * scale in float64 (the
            # onnx reference order); the float32 kernel does not take float64 scales.
            q = unpack_codes(self.codes, self.bits, self.signed, self.size).astype(np.int64)
            q = q.reshape(self.shape)
            zp = 0 if self.zero_point is None else self._expand(self.zero_point).astype(np.int64)
            y = (q - zp).astype(np.float32).astype(np.float64) * self._expand(self.scale)
            if out is not None:
                out[...] = y
                return out
            return y
        y = dequantize_affine(
            self.codes, self.bits, self.signed, self.shape, self.scale, self.zero_point,
            self.axis, self.block_size, out=out,
        )
        if self.elem_type == TensorProto.FLOAT16:  # exactly logical_type (bit-identical, see kernel)
            return y.astype(np.float16)
        return y

    def _expand(self, p: np.ndarray) -> np.ndarray:
        """A scale/zero_point broadcast to the logical shape (DequantizeLinear rules)."""
        if self.axis is None:
            return np.broadcast_to(p.reshape(()), self.shape)
        if self.block_size is None:
            dims = [1] * len(self.shape)
            dims[self.axis] = p.size
            return np.broadcast_to(p.reshape(dims), self.shape)
        rep = np.repeat(p, self.block_size, axis=self.axis)
        return np.take(rep, np.arange(self.shape[self.axis]), axis=self.axis)


def affine_value(ev: EncodedValueProto, codes: np.ndarray, scale: np.ndarray,
                 zero_point: np.ndarray | None) -> AffineValue:
    """Validate an affine ``EncodedValueProto`` and build its :class:`AffineValue`.

    Parameters
    ----------
    ev : EncodedValueProto
        With ``affine`` set.
    codes : numpy.ndarray
        ``uint8`` payload view (from :meth:`olv_runtime.io.Model.payload`).
    scale, zero_point : numpy.ndarray
        Arrays of ``ev.affine.scale`` / ``ev.affine.zero_point`` (zero_point None when absent).

    Raises
    ------
    EncodingError
        Storage type outside the closed set; scale not floating point; zero_point of another
        type; block_size without axis; axis out of range; parameter shapes not those of
        DequantizeLinear; logical type not a concrete tensor of the scale's type; payload not
        exactly ``ceil(n * bits / 8)`` bytes; unused final high bits not zero.
    """
    what = f"encoded value {ev.name!r}"
    a = ev.affine
    st = a.storage_type
    if st not in AFFINE_STORAGE:
        raise AffineLayoutError(
            f"{what}: affine storage_type must be one of INT8, UINT8, INT4, UINT4, INT2, UINT2; "
            f"got {dtype_name(st)}"
        )
    bits, signed = AFFINE_STORAGE[st]
    if not ev.HasField("logical_type"):
        raise AffineLayoutError(f"{what}: the affine branch needs a logical_type with concrete dims")
    elem_type, shape = tensor_type_shape(ev.logical_type, what, AffineLayoutError)
    if a.scale.data_type not in _FLOAT_TYPES:
        raise AffineLayoutError(
            f"{what}: scale must be FLOAT, FLOAT16 or DOUBLE, got {dtype_name(a.scale.data_type)}"
        )
    widened = elem_type == TensorProto.FLOAT and a.scale.data_type == TensorProto.FLOAT16
    if elem_type != a.scale.data_type and not widened:
        raise AffineLayoutError(
            f"{what}: logical element type {dtype_name(elem_type)} differs from the scale's "
            f"{dtype_name(a.scale.data_type)} (DequantizeLinear's output type is the scale's "
            "type, or FLOAT for a FLOAT16 scale as with output_dtype=FLOAT)"
        )
    if zero_point is not None and a.zero_point.data_type != st:
        raise AffineLayoutError(
            f"{what}: zero_point must have storage_type {dtype_name(st)}, got "
            f"{dtype_name(a.zero_point.data_type)}"
        )
    rank = len(shape)
    axis = None
    block = None
    if a.HasField("block_size") and not a.HasField("axis"):
        raise AffineLayoutError(f"{what}: block_size {a.block_size} is only valid with an axis")
    if a.HasField("axis"):
        axis = int(a.axis)
        if not -rank <= axis < rank:
            raise AffineLayoutError(f"{what}: axis {axis} out of range for rank {rank}")
        axis %= rank
        if a.HasField("block_size"):
            block = int(a.block_size)  # uint64 on the wire: a Python int, never wrapped
            if block <= 0:
                raise AffineLayoutError(f"{what}: block_size must be positive, got {block}")
            # DequantizeLinear: scale dim = ceil(D / block_size), element d uses block
            # d // block_size. For block_size >= D every element is in block 0, exactly as with
            # block_size = D, so the block is clamped to max(D, 1): kernels then see a small
            # int64 (a block_size >= 2**63 would otherwise wrap negative in int64 arithmetic).
            block = min(block, max(shape[axis], 1))
    # parameter shapes (DequantizeLinear)
    if axis is None:
        if scale.size != 1 or scale.ndim > 1:
            raise AffineLayoutError(
                f"{what}: per-tensor scale must be a scalar, got shape {list(scale.shape)}"
            )
    elif block is None:
        if scale.shape != (shape[axis],):
            raise AffineLayoutError(
                f"{what}: per-axis scale must have shape [{shape[axis]}] (dim {axis}), got "
                f"{list(scale.shape)}"
            )
    else:
        want = list(shape)
        want[axis] = -(-shape[axis] // block)
        if list(scale.shape) != want:
            raise AffineLayoutError(
                f"{what}: blocked scale must have shape {want} (block_size {block} along axis "
                f"{axis}), got {list(scale.shape)}"
            )
    if zero_point is not None and zero_point.shape != scale.shape:
        raise AffineLayoutError(
            f"{what}: zero_point shape {list(zero_point.shape)} differs from scale shape "
            f"{list(scale.shape)}"
        )
    n = math.prod(shape)
    need = -(-n * bits // 8)
    if codes.size != need:
        raise AffineLayoutError(
            f"{what}: payload must be exactly ceil({n} * {bits} / 8) = {need} bytes, got {codes.size}"
        )
    used = (n * bits) % 8
    if used and int(codes[-1]) >> used:
        raise AffineLayoutError(
            f"{what}: unused final high bits of the last payload byte must be zero "
            f"(byte 0x{int(codes[-1]):02x}, {8 - used} unused bits)"
        )
    return AffineValue(ev.name, st, bits, signed, shape, elem_type, axis, block,
                       scale, zero_point, codes)


def decoder_missing(name: str, type_desc: str) -> MissingDecoderError:
    """The error raised when an encoded value has no decoder or registered consumer."""
    return MissingDecoderError(
        f"encoded value {name!r} ({type_desc}) has no decoder: its struct type declares no "
        "decoder FunctionProto and no native decoder is registered for its type_id"
    )
