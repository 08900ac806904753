"""Standard ONNX bit operators: ``BitShift`` (since 11), ``BitwiseAnd`` / ``BitwiseOr`` /
``BitwiseXor`` / ``BitwiseNot`` (since 18), over unsigned and signed integer tensors with
numpy broadcasting. Semantics follow the ONNX operator specs: both inputs have one integer
type; ``BitShift`` takes unsigned inputs and ``direction`` "LEFT" or "RIGHT", bits shifted out
are discarded. The ggml block decoders (:mod:`olv_runtime.structs.ggml`) are written with them.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import ValidationError
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty

_UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)


def _check(op: Op, a: np.ndarray, b: np.ndarray, unsigned: bool) -> tuple:
    if a.dtype != b.dtype:
        raise op.fail(f"inputs must have the same element type, got {a.dtype} and {b.dtype}")
    if not np.issubdtype(a.dtype, np.integer) or (unsigned and a.dtype.type not in _UNSIGNED):
        want = "unsigned integer" if unsigned else "integer"
        raise op.fail(f"inputs must be {want} tensors, got {a.dtype}")
    try:
        return np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise op.fail(f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast") from None


@register("BitShift", 11, 27)  # BitShift-28 adds signed types (not implemented)
class BitShift(Op):
    attributes = {"direction": Op.REQUIRED}

    def setup(self, info):
        if self.attrs["direction"] not in ("LEFT", "RIGHT"):
            raise ValidationError(
                f"node {self.name!r} (BitShift): direction must be 'LEFT' or 'RIGHT', got "
                f"{self.attrs['direction']!r}"
            )
        self.ufunc = np.left_shift if self.attrs["direction"] == "LEFT" else np.right_shift

    def run(self, x, y):
        shape = _check(self, x, y, unsigned=True)
        out = empty(shape, x.dtype)
        bits = x.dtype.itemsize * 8
        # shifts of the full width or more give 0 (numpy's are undefined there)
        with np.errstate(all="ignore"):
            self.ufunc(x, np.minimum(y, bits - 1).astype(x.dtype), out=out)
        if y.size and int(np.max(y)) >= bits:
            out[np.broadcast_to(y >= bits, shape)] = 0
        return (out,)


class _Bitwise(Op):
    ufunc = None

    def run(self, a, b):
        shape = _check(self, a, b, unsigned=False)
        return (type(self).ufunc(a, b, out=empty(shape, a.dtype)),)


@register("BitwiseAnd", 18)
class BitwiseAnd(_Bitwise):
    ufunc = np.bitwise_and


@register("BitwiseOr", 18)
class BitwiseOr(_Bitwise):
    ufunc = np.bitwise_or


@register("BitwiseXor", 18)
class BitwiseXor(_Bitwise):
    ufunc = np.bitwise_xor


@register("BitwiseNot", 18)
class BitwiseNot(Op):
    def run(self, x):
        if not np.issubdtype(x.dtype, np.integer):
            raise self.fail(f"input must be an integer tensor, got {x.dtype}")
        return (np.invert(x, out=empty(x.shape, x.dtype)),)
