"""Errors of :mod:`olv_runtime.builder` (all under :class:`olv_runtime.OlvError`).

They subclass the shared hierarchy of :mod:`olv_runtime.errors` so callers can catch the
contract that was broken (``BindingError``, ``CatalogueError``, ``ValidationError``) or
:class:`BuilderError` for anything raised by the builder itself.
"""
from __future__ import annotations

from olv_runtime.errors import BindingError, CatalogueError, OlvError, ValidationError


class BuilderError(ValidationError):
    """The graph being authored or rewritten would be invalid (seed 002 GraphBuilder rules)."""


class UnavailableValueError(BuilderError):
    """A node reads a name that is no input, initializer, encoded initializer or node output in
    scope (availability covers tensors, sequences and encoded values)."""


class DuplicateValueError(BuilderError):
    """A name is defined twice (values are single-assignment; node names are unique)."""


class EncodedInputError(BuilderError):
    """A tensor-only operator receives an encoded value without an explicit decoder (seed 002
    "Inference": a tensor operator must not receive ``LogicalTensor()`` implicitly)."""


class InferenceError(BuilderError):
    """Incremental type/shape inference found inconsistent operand types."""


class ConflictingTypeError(CatalogueError):
    """A struct declaration conflicts with another declaration under the same type_id (IDs are
    never renumbered)."""


class StandaloneGraphError(BuilderError):
    """A standalone graph export still references model-level struct types."""


class BoundValueError(BindingError):
    """A rewrite would remove or change an input/output selected by a persistent binding."""


class StandardExportError(OlvError, ValueError):
    """The model cannot be written as standard ONNX without losing what it says (the message
    names the value, node or binding)."""
