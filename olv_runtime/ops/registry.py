"""Operator registry: implementations keyed by (domain, op_type, since_version).

Each operator is a subclass of :class:`Op` registered with :func:`register`. The session looks
up the implementation whose ``since_version`` is the highest one not above the model's opset for
that domain (ONNX versioning rule). A failed lookup raises
:class:`~olv_runtime.errors.UnsupportedOperatorError` naming the operator, its domain and
version, and the versions that exist.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from olv_runtime.errors import InvalidArgument, UnsupportedOperatorError, ValidationError
from olv_runtime.proto import AttributeProto, NodeProto

_REGISTRY: dict[tuple[str, str], list[tuple[int, type]]] = {}

#: domain aliases: "" and "ai.onnx" are the same standard domain.
_DOMAIN_ALIASES = {"ai.onnx": ""}


def canonical_domain(domain: str) -> str:
    """"" for the standard ONNX domain (also spelled "ai.onnx"), else the domain unchanged."""
    return _DOMAIN_ALIASES.get(domain, domain)


def register(op_type: str, since_version: int, domain: str = "") -> Callable[[type], type]:
    """Class decorator registering an :class:`Op` subclass."""

    def deco(cls: type) -> type:
        cls.op_type = op_type
        cls.domain = domain
        cls.since_version = since_version
        versions = _REGISTRY.setdefault((domain, op_type), [])
        versions.append((since_version, cls))
        versions.sort(key=lambda v: v[0])
        return cls

    return deco


def lookup(domain: str, op_type: str, opset_version: int) -> type:
    """The implementation class for a node of ``(domain, op_type)`` under ``opset_version``.

    Raises
    ------
    UnsupportedOperatorError
        No implementation for this operator, or none whose since_version <= opset_version.
    """
    domain = canonical_domain(domain)
    versions = _REGISTRY.get((domain, op_type))
    shown = f"{domain or 'ai.onnx'}::{op_type}"
    if not versions:
        raise UnsupportedOperatorError(
            f"operator {shown} (opset {opset_version}) is not supported by olv_runtime"
        )
    chosen = None
    for since, cls in versions:
        if since <= opset_version:
            chosen = cls
    if chosen is None:
        have = ", ".join(str(v) for v, _ in versions)
        raise UnsupportedOperatorError(
            f"operator {shown} at opset {opset_version} is not supported; implemented since "
            f"versions: {have}"
        )
    return chosen


def registered() -> list[tuple[str, str, int]]:
    """All registered (domain, op_type, since_version) triples, sorted."""
    out = []
    for (domain, op_type), versions in _REGISTRY.items():
        out.extend((domain, op_type, v) for v, _ in versions)
    return sorted(out)


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
        from olv_runtime.values import tensor_from_proto

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

    def setup(self, session_info: Any) -> None:
        """Validate attributes / constant inputs once (override as needed)."""

    def run(self, *inputs):  # pragma: no cover - abstract
        raise NotImplementedError

    def fail(self, message: str) -> InvalidArgument:
        """An InvalidArgument naming this node."""
        return InvalidArgument(f"node {self.name!r} ({self.node.op_type}): {message}")
