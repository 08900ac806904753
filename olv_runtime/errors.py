"""Exception hierarchy of olv_runtime.

Every error the runtime raises on bad input derives from :class:`OlvError`, so callers can catch
one base class; the subclasses say which contract was broken. Messages name the value (initializer,
input, node), the type_id or field involved, and the numbers expected and got.
"""
from __future__ import annotations


class OlvError(Exception):
    """Base class of every olv_runtime error."""


class ModelFormatError(OlvError, ValueError):
    """The model file or message is malformed (cannot be parsed, missing external data, ...)."""


class ValidationError(OlvError, ValueError):
    """A value, layout or graph violates the seed 000 contract (found at load/session creation)."""


class EncodingError(ValidationError):
    """An encoded value's layout or payload is invalid (seed 000 "Byte-encoding rules")."""


class PayloadError(ValidationError):
    """A payload's location, extent or size is invalid (seed 000 "Payload and lifetime")."""


class UnsupportedOperatorError(OlvError, NotImplementedError):
    """The graph uses an operator (domain, op_type, version) this runtime does not implement."""


class MissingDecoderError(OlvError):
    """An encoded value reaches a consumer but no decoder or registered consumer exists."""


class InvalidArgument(OlvError, ValueError):
    """A feed or call argument has the wrong name, dtype, shape or memory layout."""


class StateError(OlvError, RuntimeError):
    """Misuse of a persistent state (closed, concurrent call, overriding a retained input, ...)."""


class BindingError(ValidationError):
    """A persistent binding is invalid (unknown name, duplicate selection, type mismatch, ...)."""


class ConversionError(OlvError, ValueError):
    """A checkpoint cannot be converted (unsupported architecture, missing tensor, bad config)."""
