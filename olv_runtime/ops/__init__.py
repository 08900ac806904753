"""Operator implementations, registered by (domain, op_type) over opset version ranges.

Importing this package registers every built-in operator; see :mod:`olv_runtime.ops.registry`.
"""
from olv_runtime.ops import bitwise, nn, olv, reduce, standard  # noqa: F401  (registration side effects)
from olv_runtime.ops import paged, structs  # noqa: F401  (olv.PagedAttention, olv.StructGet/Make)
from olv_runtime.ops.registry import Op, lookup, register, registered  # noqa: F401
