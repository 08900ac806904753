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


class GGUFFormatError(ModelFormatError):
    """A GGUF file is malformed or hostile (truncated, lengths or offsets beyond the file, bad
    dimensions, unknown types, misalignment, duplicates); raised before anything is read
    outside the file (:mod:`olv_runtime.models.gguf_reader`)."""


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


class ContextLengthError(InvalidArgument):
    """A prompt (with what a continued state already holds) does not fit the model's context
    (``max_position_embeddings``, or the ``context_limit`` given); the message gives the
    numbers. Raised before any prefill."""


class MissingDependencyError(OlvError, ImportError):
    """An optional package a feature needs is not installed (the message names the extra to
    install, e.g. ``pip install 'olv_runtime[reference]'``)."""


class StateError(OlvError, RuntimeError):
    """Misuse of a persistent state (closed, concurrent call, overriding a retained input, ...)."""


class BindingError(ValidationError):
    """A persistent binding is invalid (unknown name, duplicate selection, type mismatch, ...)."""


class CompiledTensorError(ValidationError):
    """``ModelProto.devices`` / ``compiled_tensors`` break a checker rule of seed 004
    "Validation" (device index, duplicate key or descriptor, missing source, empty digest,
    inexact structured value, payload size, duplicate metadata key). Ordinary incompatibility or
    a stale digest is not an error but a cache miss."""


class ConversionError(OlvError, ValueError):
    """A checkpoint cannot be converted (unsupported architecture, missing tensor, bad config)."""


# -- seed 000 representation contract (olv_runtime.structs) -------------------------------------
class CatalogueError(ValidationError):
    """The struct catalogue breaks the identity contract (seed 000 "Catalogue and identity"):
    a zero or missing type_id, a type_ref carrying more than the ID, an inline declaration with a
    type_id, a declaration without a kind."""


class DuplicateTypeIdError(CatalogueError):
    """Two declarations in ``ModelProto.struct_types`` share one type_id."""


class UnresolvedTypeRefError(CatalogueError):
    """A ``type_ref`` names a type_id that has no declaration in the catalogue."""


class TypeRefCycleError(CatalogueError):
    """Declarations reference each other in a cycle (directly or through nested types)."""


class DeclarationError(ValidationError):
    """A StructTypeProto declaration is malformed: structural, naming, type or count errors
    (missing kind/content, empty or duplicate names, bad bit width, missing dimension, bad
    constant)."""


class LayoutError(EncodingError):
    """A struct type cannot be the byte-encoded layout of a value (seed 000 "Byte-encoding
    rules"): non-fixed-size field, unsupported leaf, root size zero or not a whole number of
    bytes, unconstrained category used as a layout."""


class SizeOverflowError(LayoutError):
    """The record size in bits does not fit the checked uint64 arithmetic of seed 000."""


class RecordCountError(PayloadError):
    """The payload is not a whole number of records (payload bytes % record bytes != 0)."""


class AffineLayoutError(EncodingError):
    """The built-in affine branch is violated (storage type, scale/zero_point types and shapes,
    axis/block_size, logical type, payload size, unused final bits)."""


class DuplicateNameError(ValidationError):
    """Initializer names are not unique across dense, sparse and encoded initializers."""


class DecoderError(ValidationError):
    """A struct decoder is malformed (FunctionProto inputs/outputs/ops) or its result is not
    exactly the value's logical_type."""


class DecoderBindingError(DecoderError):
    """A native decoder registered for a type_id rejected the resolved declaration."""


class StateFileError(OlvError, ValueError):
    """A saved state file (prompt cache) is malformed, or was made for another model (its model
    digest differs from the model's)."""


class SidecarError(ModelFormatError):
    """A sidecar file beside the model (tokenizer.json, generation_config.json, ...) belongs to
    another model (digest recorded at conversion differs), cannot be read, or does not fit the
    model (tokenizer vocabulary larger than the model's)."""


class OutputError(OlvError, OSError):
    """An output path cannot be written: an existing directory, an input file of the same
    call, a read-only or impossible location. The message names the path."""


class EnvironmentVariableError(OlvError, ValueError):
    """An ``OLV_*`` environment variable holds a value outside its accepted set (raised where
    the variable is first used; the message names the variable, the value and what is
    accepted)."""


def env_error(name: str, value: str, accepted: str) -> EnvironmentVariableError:
    """The error of environment variable ``name`` set to ``value`` (``accepted``: a phrase)."""
    return EnvironmentVariableError(f"environment variable {name}={value!r} is not valid; "
                                    f"accepted: {accepted}")


def node_failed(step, exc: BaseException) -> InvalidArgument:
    """The InvalidArgument an executor raises (``from exc``) when a plan step's kernel fails
    with an exception that is not already an InvalidArgument / ValidationError: it names the
    node (``step.name``), its kind and the original error."""
    return InvalidArgument(f"node {step.name!r} ({step.kind}) failed: {type(exc).__name__}: {exc}")
