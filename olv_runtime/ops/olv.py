"""Operators of the ``olv`` domain.

``olv.Decode(encoded) -> tensor`` (since version 1): the explicit decoder of seed 000 "Encoded
values in graphs". Its input is an encoded value (an ``EncodedValueProto`` initializer): the
built-in affine layout decodes as ONNX DequantizeLinear; a struct layout decodes through its
native decoder (registered by type_id) or its declaration's FunctionProto decoder
(:mod:`olv_runtime.decoding.decoders`). The output is the logical tensor, exactly
``logical_type``. Tensor-only operators never receive encoded values implicitly, and a struct
value with no decoder fails at session creation (``MissingDecoderError``). The session fuses
``Decode`` into the consumers that can read the encoded form directly (linear layers, embedding
gathers), so this materialising path runs only when nothing else can; it adds the decoded bytes to
the ``bytes_dequantized`` counter.
"""
from __future__ import annotations

import threading

import numpy as np

from olv_runtime import kernels
from olv_runtime.errors import InvalidArgument
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty
from olv_runtime.structs.initializers import AffineValue
from olv_runtime.structs.value import StructValue


@register("Decode", 1, domain="olv")
class Decode(Op):
    def setup(self, info):
        self.counters = getattr(info, "counters", None)

    def run(self, value):
        if not isinstance(value, (AffineValue, StructValue)):
            raise self.fail(f"input must be an encoded value, got {type(value).__name__}")
        out = value.decode()
        if self.counters is not None:
            self.counters.add("bytes_dequantized", out.nbytes)
        return (out,)


class EncodedGather:
    """Fused ``Gather(Decode(W), ids, axis=0)``: decodes only the selected rows."""

    def __init__(self, name: str, weight: AffineValue):
        self.name = name
        self.w = weight
        self._one = threading.local()  # one_token's scratch row
        self._args = None  # the matrix arguments, validated at the first call

    def _matrix(self) -> tuple:
        """:func:`~olv_runtime.kernels.affine.int4_gather_args` of the weight (validated once: the
        weight is immutable; two threads racing here compute the same tuple)."""
        a = self._args
        if a is None:
            w = self.w
            n, k = w.shape
            a = self._args = kernels.affine.int4_gather_args(w.codes, w.scale, w.zero_point, n,
                                                             k, w.block_size)
        return a

    def one_token(self, ids):
        """``__call__`` for int64 ids of shape [1, 1] (a decode token): the matrix arguments
        validated once, the index range checked here, the serial kernel called directly.
        Returns float32 [1, 1, K] in this thread's scratch row (overwritten by its next
        ``one_token``: the decode program hands it straight to the compiled step). Same values
        and errors as ``__call__``."""
        payload, sbits, zp, has_zp, n, k, bs = self._matrix()
        one = getattr(self._one, "v", None)
        if one is None:
            out = np.empty((1, 1, k), np.float32)
            one = self._one.v = (out, out.reshape(1, k))
        out, out2 = one
        i = int(ids[0, 0])
        if i < -n or i >= n:
            raise InvalidArgument(f"ids: expected indices in [{-n}, {n}), got {i}")
        kernels.affine._gather_int4_ser(payload, sbits, zp, has_zp, n, k, bs, ids.reshape(1),
                                        out2)
        return out

    def __call__(self, ids):
        if ids.dtype not in (np.int64, np.int32):
            raise InvalidArgument(
                f"node {self.name!r} (Gather): indices must be int64 or int32, got {ids.dtype}"
            )
        args = self._matrix()
        return (kernels.affine.gather_rows_checked(
            args, ids, out=empty(tuple(ids.shape) + (args[5],), np.float32)),)
