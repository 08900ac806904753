"""Operators of the ``olv`` domain.

``olv.Decode(encoded) -> tensor`` (since version 1): the explicit decoder of seed 000 "Encoded
values in graphs". Its input is an encoded value (an ``EncodedValueProto`` initializer): the
built-in affine layout decodes as ONNX DequantizeLinear; a struct layout decodes through its
native decoder (registered by type_id) or its declaration's FunctionProto decoder
(:mod:`olv_runtime.structs.decoders`). The output is the logical tensor, exactly
``logical_type``. Tensor-only operators never receive encoded values implicitly, and a struct
value with no decoder fails at session creation (``MissingDecoderError``). The session fuses
``Decode`` into the consumers that can read the encoded form directly (linear layers, embedding
gathers), so this materialising path runs only when nothing else can; it adds the decoded bytes to
the ``bytes_dequantized`` counter.
"""
from __future__ import annotations

from olv_runtime.ops.registry import Op, register
from olv_runtime.structs.value import StructValue
from olv_runtime.values import AffineValue


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
