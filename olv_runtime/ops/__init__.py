"""Operator implementations, registered by (domain, op_type) over opset version ranges.

Importing this package registers the standard, nn and olv operators; the operator families most
models do not use are declared here and imported on the first lookup of one of their operators
(:func:`olv_runtime.ops.registry.register_lazy`; tests/ops/test_ops_versions.py checks each
declaration against what the module registers). See :mod:`olv_runtime.ops.registry`.
"""
from olv_runtime.ops import nn, olv, standard  # noqa: F401
from olv_runtime.ops.registry import Op, lookup, register, register_lazy, registered  # noqa: F401

#: module -> the (domain, op_type) pairs it registers (imported on first use)
LAZY_MODULES = {
    "olv_runtime.ops.bitwise": (("", "BitShift"), ("", "BitwiseAnd"), ("", "BitwiseNot"),
                                ("", "BitwiseOr"), ("", "BitwiseXor")),
    "olv_runtime.ops.com_microsoft": (
        ("", "SimplifiedLayerNormalization"), ("com.microsoft", "GatherBlockQuantized"),
        ("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "MatMulNBits"),
        ("com.microsoft", "RotaryEmbedding"), ("com.microsoft", "SimplifiedLayerNormalization"),
        ("com.microsoft", "SkipSimplifiedLayerNormalization")),
    "olv_runtime.ops.paged_attention": (("olv", "PagedAttention"),),
    "olv_runtime.ops.quant": (("", "DequantizeLinear"), ("", "QuantizeLinear")),
    "olv_runtime.ops.reduce": (("", "ArgMax"), ("", "ArgMin"), ("", "CumSum"), ("", "ReduceL1"),
                               ("", "ReduceL2"),
                               ("", "ReduceLogSumExp"), ("", "ReduceMax"), ("", "ReduceMean"),
                               ("", "ReduceMin"), ("", "ReduceProd"), ("", "ReduceSum"),
                               ("", "ReduceSumSquare")),
    "olv_runtime.ops.structs": (("olv", "StructGet"), ("olv", "StructMake")),
}
for _module, _ops in LAZY_MODULES.items():
    register_lazy(_module, _ops)
