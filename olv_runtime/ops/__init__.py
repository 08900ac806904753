"""Operator implementations, registered by (domain, op_type) over opset version ranges.

Importing this package registers every built-in operator; see :mod:`olv_runtime.ops.registry`.
"""
from olv_runtime.ops import bitwise, com_microsoft, nn, olv, quant, reduce, standard  # noqa: F401
from olv_runtime.ops import paged, structs  # noqa: F401  (olv.PagedAttention, olv.StructGet/Make)
from olv_runtime.ops.registry import Op, lookup, register, registered  # noqa: F401
