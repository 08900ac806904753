"""Feeds checked against a graph input's declaration: :func:`as_array` (numpy arrays and DLPack
tensors without a copy), :class:`TensorSpec` / :func:`tensor_spec` (element type, rank, fixed
dims) and :func:`check_tensor`."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from olv_runtime.errors import InvalidArgument, ValidationError
from olv_runtime.proto import ValueInfoProto
from olv_runtime.proto.helper import declared_shape
from olv_runtime.structs.initializers import NP_DTYPE, dtype_name


def type_string(vi: ValueInfoProto) -> str:
    """onnxruntime's type string of a graph value: ``tensor(float)``, ``struct``, ...."""
    kind = vi.type.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({dtype_name(vi.type.tensor_type.elem_type).lower()})"
    if kind == "struct_type":
        return "struct"
    return kind or "unknown"


def as_array(name: str, value: Any) -> np.ndarray:
    """View a feed as a numpy array without copying (numpy arrays, DLPack CPU tensors).

    Raises
    ------
    InvalidArgument
        Not an array / DLPack tensor, or a tensor that cannot be viewed without a copy.
    """
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except Exception as exc:  # BufferError, TypeError, RuntimeError from the producer
            raise InvalidArgument(
                f"input {name!r}: {type(value).__name__} cannot be viewed without a copy "
                f"via DLPack ({exc}); pass a CPU, contiguous tensor"
            ) from None
    raise InvalidArgument(
        f"input {name!r}: expected a numpy array or a DLPack tensor (e.g. torch CPU), got "
        f"{type(value).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a tensor input declares, parsed once from its ValueInfoProto."""

    kind: str                 # TypeProto 'value' oneof ('tensor_type', 'struct_type', ...)
    type_string: str
    elem_type: int
    dtype: np.dtype | None    # native-order numpy dtype (None: unsupported element type)
    shape: tuple | None       # ints for fixed dims, str/None for symbolic; None: no shape


def tensor_spec(vi: ValueInfoProto) -> TensorSpec:
    """Parse a ValueInfoProto's tensor type once (see :func:`check_tensor`)."""
    kind = vi.type.WhichOneof("value") or ""
    et = vi.type.tensor_type.elem_type if kind == "tensor_type" else 0
    want = NP_DTYPE.get(et)
    shape = declared_shape(vi)
    for i, d in enumerate(shape or ()):
        if isinstance(d, int) and d < 0:
            raise ValidationError(
                f"graph value {vi.name!r}: declared dimension {i} is negative ({d}); a "
                "dim_value is a size >= 0 (use a dim_param for a symbolic size)"
            )
    return TensorSpec(kind, type_string(vi), et,
                      want.newbyteorder("=") if want is not None else None,
                      tuple(shape) if shape is not None else None)


def check_tensor(name: str, value: Any, vi, allow_strided: bool = False) -> np.ndarray:
    """Validate one feed against its declared type and return the numpy view (never a copy).

    ``vi`` is the input's ValueInfoProto or its parsed :class:`TensorSpec`. ``allow_strided``
    accepts non-contiguous arrays (for inputs whose consumers read any strides, such as KV past
    inputs)."""
    spec = vi if isinstance(vi, TensorSpec) else tensor_spec(vi)
    arr = as_array(name, value)
    if spec.kind != "tensor_type":
        raise InvalidArgument(f"input {name!r}: only tensor inputs can be fed, the graph declares {spec.type_string}")
    et = spec.elem_type
    want = spec.dtype
    if want is None:
        raise InvalidArgument(f"input {name!r}: element type {dtype_name(et)} is not supported")
    if arr.dtype is want or arr.dtype == want:
        pass
    elif not arr.dtype.isnative:
        raise InvalidArgument(
            f"input {name!r}: byte-swapped dtype {arr.dtype} is not supported (no silent copy); "
            "convert it to native byte order first"
        )
    else:
        raise InvalidArgument(
            f"input {name!r}: expected element type {dtype_name(et)} ({want}), got {arr.dtype}"
        )
    if not allow_strided and not arr.flags.c_contiguous:
        raise InvalidArgument(
            f"input {name!r}: array is not C-contiguous (strides {arr.strides}); the runtime does "
            "not copy inputs silently — pass np.ascontiguousarray(x)"
        )
    shape = spec.shape
    if shape is not None:
        if arr.ndim != len(shape):
            raise InvalidArgument(
                f"input {name!r}: expected rank {len(shape)} (shape {shape}), got shape {list(arr.shape)}"
            )
        for i, (d, got) in enumerate(zip(shape, arr.shape)):
            if isinstance(d, int) and d != got:
                raise InvalidArgument(
                    f"input {name!r}: dimension {i} must be {d}, got {got} (shape {list(arr.shape)})"
                )
    return arr
