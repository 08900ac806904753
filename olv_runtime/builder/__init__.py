"""GraphBuilder with encoded values, struct types and persistent bindings; standard-ONNX export
(seed 002 "Quantized values in GraphBuilder"; seed 000 PR03 and PR04a).

* :class:`GraphBuilder` - authoring and rewriting (``from_model`` / ``to_model`` / ``to_graph``).
* :class:`ShapesContext`, :class:`SymTensor`, :class:`SymSequence`, :class:`SymEncodedValue` -
  the one source of truth for value information, updated incrementally.
* :mod:`olv_runtime.builder.passes` - dead-node removal, initializer de-duplication, renames and
  removals that keep persistent bindings consistent.
* :func:`export_standard` / :func:`save_standard` - lowering to standard ONNX (affine values to
  ``DequantizeLinear``, struct values to their decoder's nodes, persistent bindings to
  caller-managed feedback on request).

See ``docs/builder.md``.
"""
from olv_runtime.builder.context import (  # noqa: F401
    EncodedLayoutRef,
    ShapesContext,
    SymEncodedValue,
    SymSequence,
    SymTensor,
    SymType,
)
from olv_runtime.builder.errors import (  # noqa: F401
    BoundValueError,
    BuilderError,
    ConflictingTypeError,
    DuplicateValueError,
    EncodedInputError,
    InferenceError,
    StandaloneGraphError,
    StandardExportError,
    UnavailableValueError,
)
from olv_runtime.builder.export import (  # noqa: F401
    FEEDBACK_METADATA_KEY,
    export_standard,
    save_standard,
    to_onnx,
)
from olv_runtime.builder.graph import GraphBuilder  # noqa: F401
from olv_runtime.builder.inference import infer_graph, infer_node, make_sym_encoded  # noqa: F401
