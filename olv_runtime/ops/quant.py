"""Standard ONNX quantization operators: DequantizeLinear and QuantizeLinear (opsets 10-28).

Semantics (https://onnx.ai/onnx/operators/onnx__DequantizeLinear.html): ``y = (x - zero_point)
* scale`` per tensor (scalar scale), per axis (``scale[x.shape[axis]]``, opset 13) or blocked
(``block_size`` along ``axis``, opset 21); ``QuantizeLinear`` is ``saturate(round_half_even(x /
scale) + zero_point)``. Input/zero-point types INT8, UINT8, INT32 (dequantize only), INT16,
UINT16, and the sub-byte INT4/UINT4 (opset 21) and INT2/UINT2 (opset 25), which the runtime holds
unpacked as int8/uint8 arrays (one value per byte). Float8 types are rejected (named).

A DequantizeLinear over initializers is recognised at session creation as an affine encoded
value (:mod:`olv_runtime.structs.recognize`): its input is then that zero-copy value, fused consumers
(MatMul, Gather) read it with the packed kernels, and only an unfused DequantizeLinear decodes it
(``bytes_dequantized``).
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import ValidationError
from olv_runtime.ops.registry import Op, register
from olv_runtime.proto import TensorProto
from olv_runtime.structs.initializers import NP_DTYPE, AffineValue, dtype_name

#: Integer quantized types: ONNX type -> (numpy holder dtype, min, max).
QTYPES = {
    TensorProto.INT8: (np.int8, -128, 127),
    TensorProto.UINT8: (np.uint8, 0, 255),
    TensorProto.INT16: (np.int16, -32768, 32767),
    TensorProto.UINT16: (np.uint16, 0, 65535),
    TensorProto.INT4: (np.int8, -8, 7),
    TensorProto.UINT4: (np.uint8, 0, 15),
    TensorProto.INT2: (np.int8, -2, 1),
    TensorProto.UINT2: (np.uint8, 0, 3),
}


def _expand(op: Op, p: np.ndarray, x_shape: tuple, axis: int, block: int, what: str):
    """``p`` broadcast to ``x_shape`` by DequantizeLinear's rules."""
    rank = len(x_shape)
    if p.size == 1 and block == 0 and p.ndim <= 1:
        return p.reshape(())
    if not -rank <= axis < max(rank, 1):
        raise op.fail(f"axis {axis} out of range for rank {rank}")
    ax = axis % rank
    if block == 0:
        if p.shape != (x_shape[ax],):
            raise op.fail(f"per-axis {what} must have shape [{x_shape[ax]}] (axis {ax}), got "
                          f"{list(p.shape)}")
        dims = [1] * rank
        dims[ax] = x_shape[ax]
        return p.reshape(dims)
    if block < 0:
        raise op.fail(f"block_size must be >= 0, got {block}")
    want = [-(-d // block) if i == ax else d for i, d in enumerate(x_shape)]
    if list(p.shape) != want:
        raise op.fail(f"blocked {what} must have shape {want} (block_size {block} along axis "
                      f"{ax}), got {list(p.shape)}")
    return np.repeat(p, block, axis=ax).take(np.arange(x_shape[ax]), axis=ax)


@register("DequantizeLinear", 10)
class DequantizeLinear(Op):
    """ONNX DequantizeLinear-10..28 (see the module docstring); computed in float32 (float64
    for a DOUBLE scale), output in the scale's type or ``output_dtype``."""

    attributes = {"axis": 1, "block_size": 0, "output_dtype": 0}

    def setup(self, info):
        self.counters = getattr(info, "counters", None)
        od = self.attrs["output_dtype"]
        if od and od not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
            raise ValidationError(
                f"node {self.name!r} (DequantizeLinear): output_dtype {dtype_name(od)} is not "
                "supported (FLOAT, FLOAT16, DOUBLE)")
        self.out_dtype = NP_DTYPE[od] if od else None
        self._cached = None

    def run(self, x, scale, zero_point=None):
        if isinstance(x, AffineValue):  # a recognised initializer: decode it (counted)
            y = x.decode()
            if self.counters is not None:
                self.counters.add("bytes_dequantized", y.nbytes)
            return (y.astype(self.out_dtype, copy=False) if self.out_dtype else y,)
        if x.dtype.kind not in "iu":
            raise self.fail(f"x must be an integer tensor (INT8, UINT8, INT16, UINT16, INT32, "
                            f"INT4/UINT4/INT2/UINT2 held as int8/uint8), got {x.dtype}")
        if scale.dtype.kind != "f":
            raise self.fail(f"x_scale must be floating point, got {scale.dtype}")
        ax, bs = self.attrs["axis"], self.attrs["block_size"]
        s = _expand(self, scale, x.shape, ax, bs, "x_scale")
        ct = np.float64 if scale.dtype == np.float64 else np.float32
        xi = x.astype(np.int64)
        if zero_point is not None:
            if zero_point.dtype.kind not in "iu":
                raise self.fail(f"x_zero_point must be an integer tensor, got {zero_point.dtype}")
            xi = xi - _expand(self, zero_point, x.shape, ax, bs, "x_zero_point").astype(np.int64)
        y = xi.astype(np.float32).astype(ct) * s.astype(ct)
        out = self.out_dtype or scale.dtype
        return (np.asarray(y, out),)


@register("QuantizeLinear", 10)
class QuantizeLinear(Op):
    """ONNX QuantizeLinear-10..28: ``saturate(round(x / y_scale) + y_zero_point)`` with round
    half to even, per tensor, per axis or blocked. The output type is ``output_dtype``, else the
    zero point's type (a sub-byte zero-point initializer keeps its INT4/UINT4/INT2/UINT2 type),
    else UINT8; sub-byte results are held as int8/uint8 values in their type's range."""

    attributes = {"axis": 1, "block_size": 0, "output_dtype": 0, "saturate": 1, "precision": 0}

    def setup(self, info):
        od = self.attrs["output_dtype"]
        zp_name = self.node.input[2] if len(self.node.input) > 2 else ""
        if not od and zp_name:
            od = getattr(info, "constant_types", {}).get(zp_name, 0)
        if od and od not in QTYPES:
            raise ValidationError(
                f"node {self.name!r} (QuantizeLinear): output type {dtype_name(od)} is not "
                "supported (INT8, UINT8, INT16, UINT16, INT4, UINT4, INT2, UINT2)")
        self.qtype = od or None

    def run(self, x, scale, zero_point=None):
        if x.dtype.kind != "f" and x.dtype != np.int32:
            raise self.fail(f"x must be floating point or int32, got {x.dtype}")
        if scale.dtype.kind != "f" and scale.dtype != np.int32:
            raise self.fail(f"y_scale must be floating point, got {scale.dtype}")
        qtype = self.qtype
        if qtype is None:
            if zero_point is None:
                qtype = TensorProto.UINT8
            else:
                qtype = {np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
                         np.dtype(np.int16): TensorProto.INT16,
                         np.dtype(np.uint16): TensorProto.UINT16}.get(zero_point.dtype)
                if qtype is None:
                    raise self.fail(f"y_zero_point type {zero_point.dtype} is not supported")
        holder, lo, hi = QTYPES[qtype]
        ax, bs = self.attrs["axis"], self.attrs["block_size"]
        ct = np.float64 if x.dtype == np.float64 or scale.dtype == np.float64 else np.float32
        s = _expand(self, scale, x.shape, ax, bs, "y_scale").astype(ct)
        q = np.rint(x.astype(ct) / s)
        if zero_point is not None:
            q = q + _expand(self, zero_point, x.shape, ax, bs, "y_zero_point").astype(ct)
        return (np.clip(q, lo, hi).astype(holder),)
