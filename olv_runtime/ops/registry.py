"""Operator registry: implementations keyed by (domain, op_type) over a range of opset versions.

Each operator is a subclass of :class:`Op` registered with :func:`register` for the opset
versions whose semantics it implements: ``register("Add", 7)`` covers opsets 7 to
:data:`MAX_OPSET` of the standard domain (ONNX versioning rule: a version bump that only widens
the type list keeps the semantics); ``register("ReduceSum", 11, 12)`` covers opsets 11-12 (axes
as an attribute) and a second class registered from 13 covers the axes input. The session looks
up the implementation whose range contains the model's opset for that domain. A failed lookup
raises :class:`~olv_runtime.errors.UnsupportedOperatorError` naming the operator, its domain and
version, and the ranges that exist.

:data:`MAX_OPSET` is the newest standard opset the registered semantics were checked against
(onnx 1.23 defines opset 28); a model importing a newer opset fails at lookup instead of running
semantics that may have changed. Other domains (``com.microsoft``, ``olv``) use their own
version numbers, with no upper bound unless one is given.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import numpy as np

from olv_runtime.errors import (
    InvalidArgument,
    UnsupportedOperatorError,
    ValidationError,
)
from olv_runtime.proto import AttributeProto, NodeProto
from olv_runtime.proto.helper import canonical_domain  # noqa: F401  (re-exported)
from olv_runtime.structs.initializers import tensor_from_proto

_REGISTRY: dict[tuple[str, str], list[tuple[int, int | None, type]]] = {}

#: Newest standard-domain opset whose semantics the registered operators implement.
MAX_OPSET = 28

#: domain aliases: "" and "ai.onnx" are the same standard domain.


def register(op_type: str, since_version: int, until_version: int | None = None,
             domain: str = "") -> Callable[[type], type]:
    """Class decorator registering an :class:`Op` subclass for opsets ``since..until``.

    Parameters
    ----------
    op_type : str
    since_version : int
        First opset version of ``domain`` the class implements.
    until_version : int, optional
        Last one (inclusive). Default: :data:`MAX_OPSET` for the standard domain, unbounded for
        other domains.
    domain : str
        "" (ai.onnx), "com.microsoft", "olv", ...

    Raises
    ------
    ValueError
        The range is empty or overlaps a range already registered for the operator (a
        programming error in the op modules, raised at import).
    """
    if until_version is None and domain == "":
        until_version = MAX_OPSET

    def deco(cls: type) -> type:
        if until_version is not None and until_version < since_version:
            raise ValueError(f"{op_type}: empty opset range {since_version}-{until_version}")
        versions = _REGISTRY.setdefault((domain, op_type), [])
        for lo, hi, other in versions:
            if not ((hi is not None and hi < since_version)
                    or (until_version is not None and until_version < lo)):
                raise ValueError(
                    f"{domain or 'ai.onnx'}::{op_type}: opsets {since_version}-{until_version} "
                    f"overlap {lo}-{hi} ({other.__name__})"
                )
        if "op_type" not in cls.__dict__:  # one class may serve several op types / ranges
            cls.op_type = op_type
            cls.domain = domain
            cls.since_version = since_version
            cls.until_version = until_version
        versions.append((since_version, until_version, cls))
        versions.sort(key=lambda v: v[0])
        return cls

    return deco


def _range_text(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


#: (domain, op_type) -> module that registers it, for op modules imported on first lookup
_LAZY: dict[tuple[str, str], str] = {}


def register_lazy(module: str, ops) -> None:
    """Declare that importing ``module`` registers the ``(domain, op_type)`` pairs ``ops``; the
    module is imported by the first :func:`lookup` of one of them (or by
    :func:`registered_ranges`), not at ``import olv_runtime`` (warm start: operator families most
    models do not use, e.g. ``com.microsoft``, paged attention, reductions)."""
    for key in ops:
        _LAZY[key] = module


def _import_lazy(key=None) -> None:
    modules = {_LAZY[key]} if key is not None else set(_LAZY.values())
    for module in modules:
        for k in [k for k, m in _LAZY.items() if m == module]:
            del _LAZY[k]
        importlib.import_module(module)


def lookup(domain: str, op_type: str, opset_version: int) -> type:
    """The implementation class for a node of ``(domain, op_type)`` under ``opset_version``.

    Raises
    ------
    UnsupportedOperatorError
        No implementation for this operator, or none whose range contains ``opset_version``;
        the message names the operator, the opset and the implemented ranges.
    """
    domain = canonical_domain(domain)
    if (domain, op_type) in _LAZY:
        _import_lazy((domain, op_type))
    versions = _REGISTRY.get((domain, op_type))
    shown = f"{domain or 'ai.onnx'}::{op_type}"
    if not versions:
        raise UnsupportedOperatorError(
            f"operator {shown} (opset {opset_version}) is not supported by olv_runtime"
        )
    for lo, hi, cls in versions:
        if lo <= opset_version and (hi is None or opset_version <= hi):
            return cls
    have = ", ".join(_range_text(lo, hi) for lo, hi, _ in versions)
    raise UnsupportedOperatorError(
        f"operator {shown} at opset {opset_version} is not supported; implemented for opsets "
        f"{have}"
    )


def registered() -> list[tuple[str, str, int]]:
    """All registered (domain, op_type, since_version) triples, sorted."""
    return sorted((d, o, lo) for d, o, lo, _ in registered_ranges())


def registered_ranges() -> list[tuple[str, str, int, int | None]]:
    """All registered (domain, op_type, since_version, until_version) entries, sorted
    (until None: no upper bound). The docs' operator list is generated from this."""
    _import_lazy()
    out = []
    for (domain, op_type), versions in _REGISTRY.items():
        out.extend((domain, op_type, lo, hi) for lo, hi, _ in versions)
    return sorted(out, key=lambda r: (r[0], r[1], r[2]))


def attribute_value(attr: AttributeProto) -> Any:
    """The Python value of an ONNX attribute (ints, floats, strings, tensors, lists)."""
    t = attr.type
    if t == AttributeProto.INT:
        return int(attr.i)
    if t == AttributeProto.FLOAT:
        return float(np.float32(attr.f))
    if t == AttributeProto.STRING:
        return attr.s.decode("utf-8")
    if t == AttributeProto.INTS:
        return [int(v) for v in attr.ints]
    if t == AttributeProto.FLOATS:
        return [float(v) for v in attr.floats]
    if t == AttributeProto.STRINGS:
        return [s.decode("utf-8") for s in attr.strings]
    if t == AttributeProto.TENSOR:
        return tensor_from_proto(attr.t)
    if t == AttributeProto.GRAPH:
        return attr.g
    raise ValidationError(
        f"attribute {attr.name!r} has type {AttributeProto.AttributeType.Name(t)}, which is "
        "not supported"
    )


class Op:
    """Base class of an operator implementation bound to one node.

    Subclasses set ``attributes`` (name → default; ``REQUIRED`` for mandatory ones) and
    implement :meth:`run`. ``__init__`` reads and validates the attributes once at session
    creation; ``run(*inputs)`` receives numpy arrays (``None`` for omitted optional inputs) and
    returns a tuple of outputs.
    """

    op_type = ""
    domain = ""
    since_version = 1
    attributes: dict[str, Any] = {}
    REQUIRED = object()

    def __init__(self, node: NodeProto, session_info: Any = None):
        self.node = node
        self.name = node.name or f"{node.op_type}({', '.join(node.output)})"
        given = {a.name: a for a in node.attribute}
        for key in given:
            if key not in self.attributes:
                raise ValidationError(
                    f"node {self.name!r} ({node.op_type}): unknown attribute {key!r}; "
                    f"expected one of {sorted(self.attributes)}"
                )
        lo, hi = type(self).input_arity()
        if not lo <= len(node.input) <= hi:
            want = f"{lo}" if lo == hi else f"{lo} to {hi}" if hi < 1 << 30 else f"at least {lo}"
            raise ValidationError(
                f"node {self.name!r} ({node.op_type}): expected {want} inputs, got "
                f"{len(node.input)} ({list(node.input)})"
            )
        for i, name in enumerate(node.input[:lo]):
            if not name:
                raise ValidationError(
                    f"node {self.name!r} ({node.op_type}): input #{i} is required but its name "
                    "is empty (only optional inputs may be omitted)"
                )
        self.attrs: dict[str, Any] = {}
        for key, default in self.attributes.items():
            if key in given:
                self.attrs[key] = attribute_value(given[key])
            elif default is Op.REQUIRED:
                raise ValidationError(
                    f"node {self.name!r} ({node.op_type}): required attribute {key!r} is missing"
                )
            else:
                self.attrs[key] = default
        self.setup(session_info)

    @classmethod
    def input_arity(cls) -> tuple[int, int]:
        """(fewest, most) node inputs :meth:`run` takes, from its signature (cached per class).

        Ops whose run takes ``*inputs`` have no upper bound; a node with a different number of
        inputs is rejected at session creation (ValidationError) instead of failing in ``run``.
        """
        got = cls.__dict__.get("_arity")
        if got is None:
            lo, hi = 0, 0
            for prm in list(inspect.signature(cls.run).parameters.values())[1:]:
                if prm.kind == prm.VAR_POSITIONAL:
                    hi = 1 << 30
                elif prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD):
                    hi += 1
                    if prm.default is prm.empty:
                        lo += 1
            got = (lo, hi)
            cls._arity = got
        return got

    def setup(self, session_info: Any) -> None:
        """Validate attributes / constant inputs once (override as needed)."""

    def run(self, *inputs):  # pragma: no cover - abstract
        raise NotImplementedError

    def fail(self, message: str) -> InvalidArgument:
        """An InvalidArgument naming this node."""
        return InvalidArgument(f"node {self.name!r} ({self.node.op_type}): {message}")
