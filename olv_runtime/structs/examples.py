"""The worked examples of seed 000 as ready-made declarations (also used by the tests and docs).

=======  ===============================  ======================  =============================
type_id  name                             record                  decoder
=======  ===============================  ======================  =============================
2001     Int4Block                        16 B codes + FLOAT = 20 B   none declared (native example)
1003     LINEAR_INT4_128_FIXED_PARAMETERS  64 B codes (+ constants)   DecodeLinearInt4
1002     LINEAR_INT4_128_WITH_PARAMETERS   64 + 4 + 8 = 76 B          DecodeLinearInt4
1101     CODEBOOK2_BLOCK_32               32 x 2-bit index = 8 B     none (a subtype)
1102     SCALED_CODEBOOK2_BLOCK_32        1101 + FLOAT = 12 B        DecodeScaledCodebookBlocks
=======  ===============================  ======================  =============================

The decoders are FunctionProtos written with standard ONNX ops (opset 21), following the input
convention of ``docs/encoded_values.md``.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.proto import StructTypeProto, TensorProto
from olv_runtime.proto.helper import make_node
from olv_runtime.structs.build import (
    array,
    bit_packing,
    const_field,
    declare,
    field,
    make_function,
    ref,
    scalar,
    structure,
    tensor,
)

__all__ = ["int4_block_2001", "decode_linear_int4", "linear_int4_fixed_1003",
           "linear_int4_params_1002", "codebook2_1101", "decode_scaled_codebook",
           "scaled_codebook2_1102", "seed_catalogue"]


def int4_block_2001() -> StructTypeProto:
    """``Int4Block {codes: INT4[32], scale: FLOAT}``: 20-byte records, no declared decoder."""
    return declare(2001, "Int4Block", structure(
        field("codes", tensor(TensorProto.INT4, [32])),
        field("scale", scalar(TensorProto.FLOAT)),
    ))


def decode_linear_int4(n: int = 128):
    """``DecodeLinearInt4``: y = (float(values) - float(zero_point)) * scale, flattened.

    Inputs ``values`` [records, n], ``scale`` and ``zero_point`` ([records] fields or [] constants).
    """
    return make_function("DecodeLinearInt4", ["values", "scale", "zero_point"], ["y"], [
        make_node("Cast", ["values"], ["vf"], to=TensorProto.FLOAT),
        make_node("Cast", ["zero_point"], ["zf"], to=TensorProto.FLOAT),
        make_node("Constant", [], ["last"], value_ints=[-1]),
        make_node("Unsqueeze", ["zf", "last"], ["zu"]),
        make_node("Unsqueeze", ["scale", "last"], ["su"]),
        make_node("Sub", ["vf", "zu"], ["d"]),
        make_node("Mul", ["d", "su"], ["y2"]),
        make_node("Reshape", ["y2", "last"], ["y"]),
    ])


def linear_int4_fixed_1003(scale: float = 0.25, zero_point: int = -2,
                           type_id: int = 1003) -> StructTypeProto:
    """Type 1003: 128 INT4 codes; scale and zero_point are format constants."""
    return declare(type_id, "LINEAR_INT4_128_FIXED_PARAMETERS", structure(
        field("values", array(scalar(TensorProto.INT4), 128)),
        const_field("scale", np.array(scale, np.float32)),
        const_field("zero_point", np.array(zero_point, np.int64)),
    ), decoder=decode_linear_int4())


def linear_int4_params_1002() -> StructTypeProto:
    """Type 1002: 128 INT4 codes, then each value's FLOAT scale and INT64 zero_point (76 B)."""
    return declare(1002, "LINEAR_INT4_128_WITH_PARAMETERS", structure(
        field("values", array(scalar(TensorProto.INT4), 128)),
        field("scale", scalar(TensorProto.FLOAT)),
        field("zero_point", scalar(TensorProto.INT64)),
    ), decoder=decode_linear_int4())


def codebook2_1101(codebook=(-1.0, -0.25, 0.25, 1.0), type_id: int = 1101) -> StructTypeProto:
    """Type 1101: 32 two-bit indices and a constant four-entry FLOAT codebook (8 B)."""
    return declare(type_id, "CODEBOOK2_BLOCK_32", structure(
        field("codes", bit_packing([("index", 2)], 32)),
        const_field("codebook", np.asarray(codebook, np.float32)),
    ))


def decode_scaled_codebook():
    """``DecodeScaledCodebookBlocks``: y[b*32 + i] = scale[b] * codebook[index[b, i]]."""
    return make_function(
        "DecodeScaledCodebookBlocks",
        ["quantized.codes.index", "quantized.codebook", "scale"], ["y"], [
            make_node("Cast", ["quantized.codes.index"], ["idx"], to=TensorProto.INT64),
            make_node("Gather", ["quantized.codebook", "idx"], ["vals"], axis=0),
            make_node("Constant", [], ["last"], value_ints=[-1]),
            make_node("Unsqueeze", ["scale", "last"], ["s2"]),
            make_node("Mul", ["vals", "s2"], ["prod"]),
            make_node("Reshape", ["prod", "last"], ["y"]),
        ])


def scaled_codebook2_1102(subtype: int = 1101, type_id: int = 1102) -> StructTypeProto:
    """Type 1102: a 1101 subtype by reference plus a per-block FLOAT scale (12 B)."""
    return declare(type_id, "SCALED_CODEBOOK2_BLOCK_32", structure(
        field("quantized", ref(subtype)),
        field("scale", scalar(TensorProto.FLOAT)),
    ), decoder=decode_scaled_codebook())


def seed_catalogue() -> list[StructTypeProto]:
    """All five declarations (2001, 1003, 1002, 1101, 1102)."""
    return [int4_block_2001(), linear_int4_fixed_1003(), linear_int4_params_1002(),
            codebook2_1101(), scaled_codebook2_1102()]
