"""float16 block scales read by the kernels without a float32 copy.

numba has no float16 arithmetic, so a float16 scale array enters a kernel as its ``uint16`` bit
view (:func:`scale_bits`) and every read goes through :func:`widen`, which emits LLVM's
``fpext half -> float`` (``vcvtph2ps`` with F16C: exact, every float16 is a float32). A float32
scale array passes through unchanged (``widen`` is then the identity), so one kernel source
serves both scale types (numba compiles one specialization per dtype).

Source: IEEE 754 binary16 -> binary32 conversion is exact (DequantizeLinear with a float16 scale
and output_dtype FLOAT, ONNX opset 23: the multiplication is done in float32).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

__all__ = ["widen", "scale_bits", "SCALE_DTYPES"]

#: Scale dtypes the INT4 kernels take (float16 through its uint16 bit view).
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


@intrinsic
def widen(typingctx, v):
    """float32 value of a scale element: ``uint16`` = float16 bits (exact fpext), ``float32`` as
    is."""
    if v == types.uint16:
        def codegen(context, builder, sig, args):
            h = builder.bitcast(args[0], ir.HalfType())
            return builder.fpext(h, ir.FloatType())
        return types.float32(v), codegen
    if v == types.float32:
        def codegen(context, builder, sig, args):
            return args[0]
        return types.float32(v), codegen
    return None


def scale_bits(scale: np.ndarray) -> np.ndarray:
    """The array a kernel reads: the ``uint16`` view of a float16 array, a float32 array as is."""
    if scale.dtype == np.float16:
        return scale.view(np.uint16)
    return scale
