"""Struct types and encoded values of seed 000: catalogue, record layouts, validation, generic
field access, decoders.

* :class:`Catalogue` - ``ModelProto.struct_types`` resolved by type_id, identity rules checked.
* :class:`Layout` / :class:`Leaf` / :class:`ConstantLeaf` - record size (checked uint64 bits) and
  per-leaf bit offset, width, count, signedness, computed once per type.
* :func:`resolve` - validate a model's representation layer once (catalogue, names, layouts,
  payloads), then bind decoders; :class:`StructValue` - a struct-typed encoded value
  (``field(path)`` arrays ``[records, *field_shape]``, ``decode()``).
* :func:`register_native_decoder` - native decoders by type_id (verified against the resolved
  declaration first); FunctionProto decoders run by olv_runtime (:class:`FunctionDecoder`).
* :func:`decode_value`, :func:`to_decoded` - encoded versus decoded comparisons.
* :mod:`olv_runtime.structs.build` - builders for declarations and values.

The decoder input convention is documented in ``docs/encoded_values.md``.
"""
from olv_runtime.structs.access import field_array, unpack_leaf  # noqa: F401
from olv_runtime.structs.catalogue import Catalogue, RootType  # noqa: F401
from olv_runtime.structs.convert import decode_value, to_decoded  # noqa: F401
from olv_runtime.structs.decoders import (  # noqa: F401
    FunctionDecoder,
    NativeDecoder,
    native_decoders,
    register_native_decoder,
    unregister_native_decoder,
)
from olv_runtime.structs.layout import ConstantLeaf, Layout, Leaf  # noqa: F401
from olv_runtime.structs.value import ResolvedModel, StructValue, resolve  # noqa: F401
