"""Decoders of struct-typed encoded values: native (registered by type_id) and FunctionProto.

Which decoder a value gets (bound once per model by :func:`bind_decoders`, after validation):

1. a **native decoder** registered for the root's type_id with :func:`register_native_decoder`,
   if its ``verify`` accepts the resolved declaration and layout (type_ids are model-scoped, so
   the binding must prove the format is the one it was written for);
2. else the root declaration's ``decoder`` FunctionProto, run by olv_runtime itself with the op
   registry (:class:`FunctionDecoder`); a nested type_ref's own decoder is never used;
3. else none: the value keeps ``decoder_error`` and anything that needs to decode it fails with
   :class:`~olv_runtime.errors.MissingDecoderError` (an InferenceSession fails at creation when a
   node consumes it; loading never fails for this).

A native decoder that rejects the declaration while the type has no FunctionProto decoder is a
:class:`~olv_runtime.errors.DecoderBindingError`.

FunctionProto input convention (DESIGN.md section 3, docs/encoded_values.md): each function input
is bound by name to a leaf path of the root struct (``scale``, ``quantized.codes.index``), as an
array ``[records, *field_shape]`` of the leaf's dtype (bit-packing components: the narrowest
UINT8/16/32/64); a constant field path is bound to the constant with its own shape. The single
output must be exactly the value's ``logical_type`` (element type and shape).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np

from olv_runtime.errors import (
    DecoderBindingError,
    DecoderError,
    OlvError,
    UnsupportedOperatorError,
)
from olv_runtime.ops import lookup
from olv_runtime.ops.registry import canonical_domain
from olv_runtime.proto import FunctionProto
from olv_runtime.structs.compiled import check_compiled
from olv_runtime.structs.initializers import NP_DTYPE, dtype_name
from olv_runtime.structs.value import ResolvedModel, StructValue, resolve_values

__all__ = ["NativeDecoder", "register_native_decoder", "unregister_native_decoder",
           "native_decoders", "FunctionDecoder", "bind_decoders", "check_result"]


@dataclasses.dataclass(frozen=True)
class NativeDecoder:
    """A decoder implemented in Python/numba, bound to a type_id.

    Attributes
    ----------
    type_id : int
    decode : callable
        ``decode(value: StructValue) -> numpy.ndarray``: the logical tensor.
    verify : callable
        ``verify(root: RootType) -> None or str``: called with the resolved declaration and
        layout before anything is bound; returning a string (the reason) or raising rejects it.
    name : str
    """

    type_id: int
    decode: Callable
    verify: Callable
    name: str = ""


_NATIVE: dict[int, NativeDecoder] = {}
_LOCK = threading.Lock()


def register_native_decoder(type_id: int, decode: Callable, verify: Callable,
                            name: str = "") -> NativeDecoder:
    """Register a native decoder for ``type_id`` (replacing any previous one).

    Parameters
    ----------
    type_id : int
        Nonzero type_id of the catalogue declaration it decodes.
    decode : callable
        ``decode(value) -> ndarray`` (value: :class:`~olv_runtime.structs.StructValue`, already
        validated; use ``value.field(path)``).
    verify : callable
        ``verify(root) -> None | str`` over the resolved
        :class:`~olv_runtime.structs.catalogue.RootType` (``root.declaration``,
        ``root.layout.signature()``); must reject layouts it was not written for.
    name : str, optional

    Returns
    -------
    NativeDecoder
        The registration (pass it to :func:`unregister_native_decoder`).
    """
    if not isinstance(type_id, (int, np.integer)) or int(type_id) <= 0:
        raise ValueError(f"type_id must be a positive int, got {type_id!r}")
    nd = NativeDecoder(int(type_id), decode, verify, name or getattr(decode, "__name__", ""))
    with _LOCK:
        _NATIVE[nd.type_id] = nd
    return nd


def unregister_native_decoder(type_id: int) -> None:
    """Remove the native decoder of ``type_id`` (no error if none)."""
    with _LOCK:
        _NATIVE.pop(int(type_id), None)


def native_decoders() -> dict[int, NativeDecoder]:
    """A copy of the registry."""
    with _LOCK:
        return dict(_NATIVE)


def check_result(value, out, who: str) -> np.ndarray:
    """The decoded array, checked to be exactly ``value.logical`` (DecoderError otherwise)."""
    if not isinstance(out, np.ndarray):
        raise DecoderError(f"{value.describe()}: {who} returned {type(out).__name__}, not an array")
    if value.logical is None:
        return out
    et, shape = value.logical
    want = NP_DTYPE.get(et)
    if want is None or out.dtype != want.newbyteorder("=") or tuple(out.shape) != tuple(shape):
        raise DecoderError(
            f"{value.describe()}: {who} produced {out.dtype} {list(out.shape)}, but logical_type "
            f"is {dtype_name(et)} {list(shape)} ({value.records} records)"
        )
    return out


class _Native:
    def __init__(self, nd: NativeDecoder):
        self.nd = nd
        self.kind = f"native {nd.name or nd.type_id}"

    def decode(self, value) -> np.ndarray:
        return check_result(value, self.nd.decode(value), f"native decoder {self.nd.name!r}")


class _Info:
    """The session_info ops receive when instantiated inside a decoder plan."""

    counters = None


class FunctionDecoder:
    """A decoder FunctionProto compiled once into a small plan over registered ops.

    Parameters
    ----------
    function : FunctionProto
        The root declaration's ``decoder``.
    root : RootType
        Resolved root type (leaf and constant paths).
    opsets : dict
        The model's opset imports, used for domains the function does not import itself.

    Raises
    ------
    DecoderError
        Not exactly one output; an input that is not a leaf/constant path; function attributes;
        a node input that is neither a function input nor an earlier node output.
    UnsupportedOperatorError
        A node's operator is not registered at the function's opset.
    """

    def __init__(self, function: FunctionProto, root, opsets: dict):
        where = f"decoder {function.name or '<unnamed>'!r} of {root.describe()}"
        self.where = where
        self.kind = f"function {function.name!r}"
        if len(function.output) != 1:
            raise DecoderError(
                f"{where}: a decoder has exactly one output (the logical tensor), got "
                f"{len(function.output)}: {list(function.output)}"
            )
        if len(function.attribute) or len(function.attribute_proto):
            raise DecoderError(f"{where}: decoder functions take no attributes")
        paths = set(root.layout.paths())
        for name in function.input:
            if name not in paths:
                raise DecoderError(
                    f"{where}: input {name!r} is not a leaf or constant path of the root struct; "
                    f"paths: {sorted(paths)}"
                )
        self.inputs = tuple(function.input)
        self.output = function.output[0]
        fopsets = dict(opsets)
        fopsets.update({canonical_domain(o.domain): int(o.version) for o in function.opset_import})
        defined = set(self.inputs) | {""}
        self.steps = []
        for k, node in enumerate(function.node):
            dom = canonical_domain(node.domain)
            if dom not in fopsets:
                raise UnsupportedOperatorError(
                    f"{where}: node {node.name or k!r} ({node.op_type}) uses domain "
                    f"{node.domain!r}, which neither the function nor the model imports"
                )
            for a in node.attribute:
                if a.ref_attr_name:
                    raise DecoderError(f"{where}: node {node.name or k!r} refers to a function "
                                       f"attribute ({a.ref_attr_name!r}); decoders have none")
            for i in node.input:
                if i not in defined:
                    raise DecoderError(
                        f"{where}: node {node.name or k!r} ({node.op_type}) input {i!r} is not a "
                        "function input or an earlier node output"
                    )
            try:
                cls = lookup(dom, node.op_type, fopsets[dom])
            except UnsupportedOperatorError as exc:
                raise UnsupportedOperatorError(f"{where}: {exc}") from None
            self.steps.append((cls(node, _Info()), tuple(node.input), tuple(node.output)))
            defined.update(o for o in node.output if o)
        if self.output not in defined:
            raise DecoderError(f"{where}: output {self.output!r} is not produced by any node")

    def decode(self, value) -> np.ndarray:
        env = {name: value.field(name) for name in self.inputs}
        for impl, ins, outs in self.steps:
            try:
                results = impl.run(*[env[i] if i else None for i in ins])
            except OlvError as exc:
                raise DecoderError(f"{value.describe()}: {self.where}: {exc}") from exc
            except Exception as exc:
                raise DecoderError(
                    f"{value.describe()}: {self.where}: node {impl.name!r} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            for o, r in zip(outs, results):
                if o:
                    env[o] = r
        return check_result(value, np.asarray(env[self.output]), self.where)


def bind_decoders(resolved) -> None:
    """Bind a decoder to every StructValue of a validated model (see module docstring)."""
    compiled: dict = {}  # one FunctionDecoder per root declaration
    verified: dict = {}
    registry = native_decoders()
    for value in resolved.values.values():
        if not isinstance(value, StructValue):
            continue
        root = value.root
        rejected = None
        nd = registry.get(root.type_id) if root.type_id is not None else None
        if nd is not None:
            key = root.type_id
            if key not in verified:
                try:
                    reason = nd.verify(root)
                except Exception as exc:  # a verify callback that raises rejects the layout
                    reason = f"{type(exc).__name__}: {exc}"
                verified[key] = reason
            reason = verified[key]
            if not reason:
                value.decoder = _Native(nd)
                continue
            rejected = (f"native decoder {nd.name!r} registered for type_id {root.type_id} "
                        f"rejected the declaration: {reason}")
        decl = root.declaration
        if decl.HasField("decoder"):
            key = id(decl)
            if key not in compiled:
                compiled[key] = FunctionDecoder(decl.decoder, root, resolved.opsets)
            value.decoder = compiled[key]
            continue
        if rejected:
            raise DecoderBindingError(f"{value.describe()}: {rejected}")
        value.decoder_error = (
            f"no decoder: {root.describe()} declares no decoder FunctionProto and no native "
            "decoder is registered for its type_id"
        )


_BIND_LOCK = threading.Lock()


def resolve(model, counters=None) -> ResolvedModel:
    """Validate a model's representation layer and bind its decoders, once per Model.

    Parameters
    ----------
    model : Model
    counters : Counters, optional
        Passed to :func:`olv_runtime.structs.value.resolve_values` (payload bytes read/copied
        while validating).

    Returns
    -------
    ResolvedModel
        ``values`` by name (AffineValue or StructValue with ``decoder`` bound), ``catalogue``,
        ``opsets``, ``compiled_roots`` (seed 004 entries' value types).

    Raises
    ------
    CatalogueError, DeclarationError, LayoutError, PayloadError, RecordCountError,
    AffineLayoutError, DuplicateNameError, CompiledTensorError, DecoderError, DecoderBindingError
        See :mod:`olv_runtime.errors`; messages name the value, type_id, field and numbers.
    """
    resolved = resolve_values(model, counters)
    if resolved.decoders_bound:
        return resolved
    with _BIND_LOCK:
        if not resolved.decoders_bound:
            # seed 004 "Validation" (structural), then decoders after every value is validated
            resolved.compiled_roots = check_compiled(model, resolved.catalogue)
            bind_decoders(resolved)
            resolved.decoders_bound = True
    return resolved
