"""Runtime views of struct-typed encoded values and the once-per-model resolution.

:func:`resolve_values` validates a :class:`~olv_runtime.io.Model` once (cached per Model object) in this
order, so that nothing runs on unvalidated data (seed 000 "Payload bounds and layout are validated
before any decoder or native callback runs"):

1. the struct catalogue (:class:`~olv_runtime.structs.catalogue.Catalogue`) and every struct type
   used by graph inputs, outputs and value_info;
2. initializer names unique across dense, sparse and encoded initializers;
3. every encoded initializer: its layout (built-in affine -> :class:`~olv_runtime.structs.initializers.AffineValue`,
   struct -> :class:`StructValue`) and payload (location, extent, whole records);
4. then decoders are bound (:mod:`olv_runtime.decoding.decoders`): native decoders verify the
   resolved declaration, FunctionProto decoders are compiled into small plans. Nothing is decoded.

Loading a model (:func:`olv_runtime.load`) does none of this; an InferenceSession does it at
creation, :func:`olv_runtime.decode_value` / :func:`olv_runtime.to_decoded` on first use.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from olv_runtime.errors import (
    AffineLayoutError,
    DuplicateNameError,
    EncodingError,
    InvalidArgument,
    MissingDecoderError,
    RecordCountError,
)
from olv_runtime.io import Model
from olv_runtime.proto import EncodedValueProto, TensorProto
from olv_runtime.proto.helper import canonical_domain
from olv_runtime.structs.access import field_array
from olv_runtime.structs.catalogue import Catalogue, RootType
from olv_runtime.structs.initializers import (
    AffineValue,
    affine_value,
    param_tensor,
    tensor_type_shape,
)


class StructValue:
    """Validated runtime view of an ``EncodedValueProto`` with a struct layout.

    Attributes
    ----------
    name : str
    root : RootType
        Resolved declaration, type_id (None for inline) and record layout.
    payload : numpy.ndarray
        Read-only ``uint8`` view of the payload (inline bytes or the external memory map),
        ``records * record_bytes`` bytes.
    records : int
        ``payload bytes / record bytes`` (an empty payload is zero records).
    logical : tuple (elem_type, shape) or None
        The logical tensor type the decoder must produce exactly; None when the value has no
        tensor semantics.
    decoder : object or None
        Bound decoder (``decoder.decode(value) -> ndarray``), set by :func:`olv_runtime.decoding.resolve`.
    decoder_error : str or None
        Why no decoder is bound (reported when something needs to decode this value).
    """

    def __init__(self, name: str, root: RootType, payload: np.ndarray, records: int,
                 logical: tuple | None):
        self.name = name
        self.root = root
        self.payload = payload
        self.records = records
        self.logical = logical
        self.decoder = None
        self.decoder_error: str | None = None

    @property
    def type_id(self) -> int | None:
        return self.root.type_id

    @property
    def layout(self):
        return self.root.layout

    @property
    def record_bytes(self) -> int:
        return self.root.record_bytes

    @property
    def nbytes(self) -> int:
        """Payload bytes."""
        return int(self.payload.size)

    def describe(self) -> str:
        return f"encoded value {self.name!r} ({self.root.describe()})"

    def field(self, path: str, copy: bool = False, records: slice | None = None) -> np.ndarray:
        """The array of leaf ``path``: ``[records, *field_shape]``; a constant: its own shape.

        Byte-aligned leaves are zero-copy strided views of the payload unless ``copy``; other
        leaves are unpacked by the numba kernels (:mod:`olv_runtime.structs.access`).

        Parameters
        ----------
        path : str
            Leaf or constant path (``scale``, ``quantized.codes.index``).
        copy : bool
            Unpack even byte-aligned leaves into a fresh aligned array.
        records : slice, optional
            Only these records (step 1), e.g. ``slice(0, 16)``: unpacks nothing else.

        Raises
        ------
        KeyError
            Unknown path (the message lists the available paths).
        """
        leaf = self.layout.leaf(path)
        if leaf is not None:
            payload, count = self.payload, self.records
            if records is not None:
                start, stop, step = records.indices(self.records)
                if step != 1:
                    raise ValueError(f"records: only step 1 is supported, got {step}")
                count = max(stop - start, 0)
                rb = self.record_bytes
                payload = payload[start * rb: (start + count) * rb]
            return field_array(payload, count, self.record_bytes, leaf, copy=copy)
        c = self.layout.constant(path)
        if c is not None:
            return c.value
        raise KeyError(f"{self.describe()} has no field {path!r}; paths: {self.layout.paths()}")

    def fields(self) -> dict[str, np.ndarray]:
        """Every leaf and constant by path (see :meth:`field`)."""
        return {p: self.field(p) for p in self.layout.paths()}

    def decode(self) -> np.ndarray:
        """The logical tensor, through the bound decoder.

        Raises
        ------
        MissingDecoderError
            No native decoder and no FunctionProto decoder for this value.
        DecoderError
            The decoder's result is not exactly the logical type.
        """
        if self.decoder is None:
            raise MissingDecoderError(
                f"{self.describe()}: {self.decoder_error or 'no decoder is bound'}"
            )
        return self.decoder.decode(self)

    def __repr__(self) -> str:
        return (f"StructValue({self.name!r}, {self.root.describe()}, records={self.records}, "
                f"record_bytes={self.record_bytes})")


class ResolvedModel:
    """The validated representation layer of one model (see :func:`resolve_values`).

    Attributes
    ----------
    catalogue : Catalogue
    values : dict of str -> AffineValue or StructValue
        Every encoded initializer by name, in graph order.
    opsets : dict of str -> int
        The model's opset imports (decoder FunctionProtos without their own use these).
    compiled_roots : dict of int -> RootType
        Resolved value types of the seed 004 compiled entries (checked by
        :func:`olv_runtime.structs.compiled.check_compiled`).
    """

    def __init__(self, catalogue: Catalogue, values: dict, opsets: dict):
        self.catalogue = catalogue
        self.values = values
        self.opsets = opsets
        self.compiled_roots: dict = {}
        self.decoders_bound = False  # set by olv_runtime.decoding.resolve

    def value(self, name: str):
        try:
            return self.values[name]
        except KeyError:
            raise InvalidArgument(
                f"no encoded initializer named {name!r}; encoded initializers: {list(self.values)}"
            ) from None


_CACHE: "weakref.WeakKeyDictionary[Model, ResolvedModel]" = weakref.WeakKeyDictionary()


def resolve_values(model: Model, counters=None) -> ResolvedModel:
    """Validate the model's representation layer once and return it (cached per Model).

    Decoders are not bound here: :func:`olv_runtime.decoding.resolve` checks the seed 004
    compiled entries and binds a decoder to every struct value of the result (what callers
    that decode use).

    Parameters
    ----------
    model : Model
    counters : Counters, optional
        Receives ``payload_bytes_read`` / ``payload_bytes_copied``: payload bytes this layer
        read or copied while validating (only the affine "unused final bits" check reads one byte
        per value; nothing is copied).

    Raises
    ------
    CatalogueError, DeclarationError, LayoutError, PayloadError, RecordCountError,
    AffineLayoutError, DuplicateNameError, DecoderError, DecoderBindingError
        See :mod:`olv_runtime.errors`; messages name the value, type_id, field and numbers.
    """
    got = _CACHE.get(model)
    if got is not None:
        return got
    proto = model.proto
    g = proto.graph
    catalogue = Catalogue(proto.struct_types)
    for section in (g.input, g.output, g.value_info):
        for vi in section:
            if vi.type.WhichOneof("value") not in (None, "tensor_type"):
                catalogue.check_type(vi.type, f"graph value {vi.name!r}")
    _check_names(g)
    values: dict = {}
    read = 0
    for ev in g.encoded_initializer:
        v = encoded_value(model, ev, catalogue)
        if isinstance(v, AffineValue) and v.codes.size and (v.size * v.bits) % 8:
            read += 1
        values[ev.name] = v
    if counters is not None:
        counters.add("payload_bytes_read", read)
        counters.add("payload_bytes_copied", 0)
    opsets = {canonical_domain(o.domain): int(o.version) for o in proto.opset_import}
    resolved = ResolvedModel(catalogue, values, opsets)
    _CACHE[model] = resolved
    return resolved


def _check_names(g) -> None:
    seen: dict[str, str] = {}
    names = ([(t.name, "dense") for t in g.initializer]
             + [(s.values.name, "sparse") for s in g.sparse_initializer]
             + [(e.name, "encoded") for e in g.encoded_initializer])
    for name, kind in names:
        if not name:
            raise DuplicateNameError(f"a {kind} initializer has an empty name")
        if name in seen:
            raise DuplicateNameError(
                f"initializer name {name!r} is used by both a {seen[name]} and a {kind} "
                "initializer (names are unique across dense, sparse and encoded initializers)"
            )
        seen[name] = kind


def encoded_value(model: Model, ev: EncodedValueProto, catalogue: Catalogue):
    """Validate one encoded initializer; AffineValue or StructValue (payload viewed, not read).

    Raises
    ------
    AffineLayoutError, LayoutError, PayloadError, RecordCountError, EncodingError
    """
    what = f"encoded value {ev.name!r}"
    layout = ev.WhichOneof("layout")
    if layout == "affine":
        a = ev.affine
        # scale / zero_point may be external (olv_runtime.save writes large ones to the data
        # file): then they are read-only views of the memory map, not bytes parsed into the proto
        pay = {}
        for label, part in (("scale", a.scale), ("zero_point", a.zero_point)):
            if part.data_location == TensorProto.EXTERNAL:
                pay[label] = model.payload(part, (label, ev.name))  # PayloadError: location
        try:
            scale = param_tensor(a.scale, pay.get("scale"))
            zp = (param_tensor(a.zero_point, pay.get("zero_point"))
                  if a.HasField("zero_point") else None)
        except EncodingError:
            raise
        except Exception as exc:
            raise AffineLayoutError(f"{what}: bad scale/zero_point tensor: {exc}") from None
        return affine_value(ev, model.payload(ev), scale, zp)
    if layout == "struct_type":
        root = catalogue.root(ev.struct_type, what)
        logical = None
        if ev.HasField("logical_type"):
            logical = tensor_type_shape(ev.logical_type, what)
        payload = model.payload(ev)  # PayloadError: location, extent, exclusivity
        rb = root.record_bytes
        if payload.size % rb:
            raise RecordCountError(
                f"{what} ({root.describe()}): payload bytes {payload.size} are not a whole number "
                f"of {rb}-byte records ({payload.size // rb} records + {payload.size % rb} bytes)"
            )
        return StructValue(ev.name, root, payload, payload.size // rb, logical)
    raise EncodingError(f"{what}: no layout (affine or struct_type) set")


def logical_size(value) -> int:
    """Elements of the logical tensor of a value (0 when it has no logical type)."""
    if isinstance(value, AffineValue):
        return value.size
    return math.prod(value.logical[1]) if value.logical is not None else 0
