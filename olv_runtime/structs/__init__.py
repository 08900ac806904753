"""Struct types and encoded values of seed 000: catalogue, record layouts, validation, generic
field access (decoding them: :mod:`olv_runtime.decoding`).

* :class:`Catalogue` - ``ModelProto.struct_types`` resolved by type_id, identity rules checked.
* :class:`Layout` / :class:`Leaf` / :class:`ConstantLeaf` - record size (checked uint64 bits) and
  per-leaf bit offset, width, count, signedness, computed once per type.
* :func:`resolve_values` - validate a model's representation layer once (catalogue, names,
  layouts, payloads); :class:`StructValue` - a struct-typed encoded value (``field(path)`` arrays
  ``[records, *field_shape]``, ``decode()`` once :func:`olv_runtime.decoding.resolve` bound its
  decoder).
* :mod:`olv_runtime.structs.build` - builders for declarations and values.

The decoder input convention is documented in ``docs/encoded_values.md``.
"""
from olv_runtime.structs.access import field_array, unpack_leaf  # noqa: F401
from olv_runtime.structs.catalogue import Catalogue, RootType  # noqa: F401
from olv_runtime.structs.layout import ConstantLeaf, Layout, Leaf  # noqa: F401
from olv_runtime.structs.value import ResolvedModel, StructValue, resolve_values  # noqa: F401
