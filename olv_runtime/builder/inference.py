"""Incremental type/shape inference over a :class:`~olv_runtime.builder.context.ShapesContext`.

:func:`infer_node` computes the descriptors of one node's outputs from the descriptors already in
the context (seed 002 "Inference"); the GraphBuilder calls it as each node is added, and
:func:`infer_graph` runs it over an imported graph (If branches, function bodies).

* ``olv.Decode(encoded) -> tensor``: the encoded value's logical tensor. The value must have a
  decoder (affine: DequantizeLinear; struct: a FunctionProto decoder on the root declaration or a
  native decoder registered for its type_id) and a logical type.
* Calls of model-local functions: a ``"function"`` scope (catalogue, no outer values); formal
  inputs are bound to complete copies of the actual descriptors (an encoded input stays a
  :class:`SymEncodedValue`), the body is inferred, the formal outputs are bound back.
* ``If``: each branch graph is inferred in a ``"subgraph"`` scope (outer values visible); the
  outputs take the then-branch descriptors where the branches agree.
* Any other operator given a :class:`SymEncodedValue` fails (:class:`EncodedInputError`): a
  tensor operator never receives the logical tensor implicitly.
* Standard operators: the operator schema's own inference function (``onnx.shape_inference.
  infer_node_outputs``), with small constant int64 initializers as data for ``Reshape`` & co.
  Operators without a schema (other domains) get outputs of unknown type.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import defs as onnx_defs

from olv_runtime.builder.context import (
    EncodedLayoutRef,
    ShapesContext,
    Sym,
    SymEncodedValue,
    SymSequence,
    SymTensor,
    SymType,
    copy_message,
    sym_from_type,
)
from olv_runtime.builder.errors import BuilderError, EncodedInputError, InferenceError
from olv_runtime.errors import (
    DecoderError,
    EncodingError,
    MissingDecoderError,
    PayloadError,
    RecordCountError,
)
from olv_runtime.proto import (
    AttributeProto,
    EncodedValueProto,
    GraphProto,
    NodeProto,
    TensorProto,
    TypeProto,
)
from olv_runtime.structs.catalogue import Catalogue, RootType
from olv_runtime.structs.initializers import (
    DTYPE_TO_ONNX,
    NP_DTYPE,
    affine_value,
    param_tensor,
    tensor_type_shape,
)

#: (domain, op_type) of operators whose schema accepts an encoded input.
ENCODED_CONSUMERS = {("olv", "Decode")}
_STD_DOMAINS = ("", "ai.onnx")


def node_label(node: NodeProto) -> str:
    op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    return f"node {node.name!r} ({op})" if node.name else f"{op} node"


def _canon(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def subgraphs(node: NodeProto):
    """(attribute name, GraphProto) of every graph attribute of a node."""
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.name, a.g
        elif a.type == AttributeProto.GRAPHS:
            for g in a.graphs:
                yield a.name, g


def infer_node(ctx: ShapesContext, node: NodeProto) -> list:
    """Descriptors of ``node``'s outputs (None for omitted ``""`` outputs).

    Raises
    ------
    UnavailableValueError
        An input is not in scope.
    EncodedInputError
        A tensor operator reads an encoded value.
    MissingDecoderError
        ``olv.Decode`` of a value without a decoder or without a logical type.
    InferenceError
        The operator schema rejects the operand types.
    """
    label = node_label(node)
    ins: list[Sym | None] = [ctx.require(n, label) if n else None for n in node.input]
    key = (_canon(node.domain), node.op_type)
    if key == ("olv", "Decode"):
        return [_infer_decode(ins, node, label)] + [None] * (len(node.output) - 1)
    fn = ctx.functions.get(key)
    if fn is not None:
        return _infer_call(ctx, node, fn, ins, label)
    for name, sym in zip(node.input, ins):
        if isinstance(sym, SymEncodedValue) and key not in ENCODED_CONSUMERS:
            raise EncodedInputError(
                f"{label} reads encoded value {name!r} ({sym.layout.describe()}); a tensor operator "
                "never receives an encoded value implicitly: decode it first with olv.Decode"
            )
    if key == ("", "If"):
        return _infer_if(ctx, node, label)
    for _, g in subgraphs(node):  # Loop/Scan bodies: check availability of outer reads only
        _check_subgraph_reads(ctx, g, label)
    return _infer_schema(ctx, node, ins, label)


def _infer_decode(ins, node, label) -> SymTensor:
    if len(ins) != 1 or len(node.output) != 1:
        raise InferenceError(f"{label}: olv.Decode takes one input and has one output")
    sym = ins[0]
    if not isinstance(sym, SymEncodedValue):
        raise EncodedInputError(
            f"{label}: olv.Decode needs an encoded value, {node.input[0]!r} is "
            f"{sym.describe() if sym is not None else 'missing'}"
        )
    if not sym.has_decoder():
        raise MissingDecoderError(
            f"{label}: encoded value {sym.name!r} ({sym.layout.describe()}) has no decoder: its "
            "struct type declares no decoder FunctionProto and no native decoder is registered "
            "for its type_id"
        )
    lt = sym.logical_tensor
    if lt is None:
        raise MissingDecoderError(
            f"{label}: encoded value {sym.name!r} has no logical tensor type to decode to"
        )
    return lt


def _infer_call(ctx: ShapesContext, node, fn, ins, label) -> list:
    opsets = {_canon(o.domain): int(o.version) for o in fn.opset_import} or None
    fctx = ctx.child("function", opsets=opsets)
    if len(ins) > len(fn.input):
        raise InferenceError(
            f"{label}: function {fn.name!r} takes {len(fn.input)} inputs, got {len(ins)}"
        )
    for formal, sym in zip(fn.input, ins):
        if sym is not None:
            fctx.set_value(formal, sym.renamed(formal) if isinstance(sym, SymEncodedValue) else sym)
    for inner in fn.node:
        outs = infer_node(fctx, inner)
        for name, sym in zip(inner.output, outs):
            if name and sym is not None:
                fctx.set_value(name, sym, replace=True)
    result = []
    for i, name in enumerate(node.output):
        if not name:
            result.append(None)
            continue
        if i >= len(fn.output):
            raise InferenceError(
                f"{label}: function {fn.name!r} has {len(fn.output)} outputs, node names "
                f"{len(node.output)}"
            )
        sym = fctx.lookup(fn.output[i]) or SymTensor()
        result.append(sym.renamed(name) if isinstance(sym, SymEncodedValue) else sym)
    return result


def infer_graph(ctx: ShapesContext, graph: GraphProto) -> None:
    """Seed and infer a whole graph into ``ctx`` (inputs, initializers, encoded initializers via
    :func:`make_sym_encoded`, then nodes in order)."""
    for vi in graph.input:
        ctx.set_value(vi.name, sym_from_type(vi.type), replace=True)
    for t in graph.initializer:
        ctx.set_value(t.name, SymTensor(int(t.data_type), tuple(int(d) for d in t.dims)),
                      replace=True)
    for s in graph.sparse_initializer:
        ctx.set_value(s.values.name, SymTensor(int(s.values.data_type),
                                               tuple(int(d) for d in s.dims)), replace=True)
    for ev in graph.encoded_initializer:
        ctx.set_encoded_value(ev.name, make_sym_encoded(ev, ctx.catalogue), replace=True)
    for node in graph.node:
        for name, sym in zip(node.output, infer_node(ctx, node)):
            if name and sym is not None:
                ctx.set_value(name, sym, replace=True)


def _check_subgraph_reads(ctx, g: GraphProto, label) -> None:
    sub = ctx.child("subgraph")
    for vi in g.input:
        sub.set_value(vi.name, sym_from_type(vi.type), replace=True)
    for t in g.initializer:
        sub.set_value(t.name, SymTensor(int(t.data_type), tuple(int(d) for d in t.dims)), replace=True)
    for n in g.node:
        for name in n.input:
            if name:
                sub.require(name, f"{label} body {node_label(n)}")
        for name in n.output:
            if name:
                sub.set_value(name, SymTensor(), replace=True)


def _infer_if(ctx: ShapesContext, node, label) -> list:
    branches = {name: g for name, g in subgraphs(node)}
    outs_by_branch = []
    for bname in ("then_branch", "else_branch"):
        g = branches.get(bname)
        if g is None:
            raise InferenceError(f"{label}: If without {bname}")
        if len(g.output) != len(node.output):
            raise InferenceError(
                f"{label}: {bname} has {len(g.output)} outputs, the node {len(node.output)}"
            )
        sub = ctx.child("subgraph")
        infer_graph(sub, g)
        syms = []
        for vi in g.output:
            declared = sym_from_type(vi.type) if vi.type.WhichOneof("value") else None
            got = sub.require(vi.name, f"{label} {bname} output")
            syms.append(got if declared is None or not getattr(declared, "known", True)
                        else declared)
        outs_by_branch.append(syms)
    result = []
    for a, b in zip(*outs_by_branch):
        if isinstance(a, SymTensor) and isinstance(b, SymTensor):
            if a.elem_type and b.elem_type and a.elem_type != b.elem_type:
                raise InferenceError(
                    f"{label}: branches produce different element types ({a.describe()} vs "
                    f"{b.describe()})"
                )
            shape = a.shape if a.shape == b.shape else (
                tuple(x if x == y else None for x, y in zip(a.shape, b.shape))
                if a.shape is not None and b.shape is not None and len(a.shape) == len(b.shape)
                else None)
            result.append(SymTensor(a.elem_type or b.elem_type, shape))
        elif isinstance(a, SymEncodedValue) and isinstance(b, SymEncodedValue) \
                and a.profile() == b.profile():
            result.append(a)
        else:
            result.append(a)
    return result


def _onnx_type(sym):
    if isinstance(sym, SymTensor):
        if not sym.elem_type:
            return None
        return onnx.helper.make_tensor_type_proto(
            sym.elem_type, None if sym.shape is None else list(sym.shape))
    if isinstance(sym, (SymSequence, SymType)):
        return onnx.TypeProto.FromString(sym.to_type().SerializeToString())
    return None


_SCHEMAS: dict = {}


def _schema(op_type: str, version: int, domain: str):
    key = (op_type, version, domain)
    if key not in _SCHEMAS:
        try:
            _SCHEMAS[key] = onnx_defs.get_schema(op_type, version, domain)
        except onnx_defs.SchemaError:
            _SCHEMAS[key] = None
    return _SCHEMAS[key]


def _infer_schema(ctx: ShapesContext, node, ins, label) -> list:
    domain = _canon(node.domain)
    unknown = [SymTensor() if n else None for n in node.output]
    version = ctx.opsets.get(domain)
    if version is None:
        if domain in ("",):
            raise InferenceError(f"{label}: the default domain is not imported (opset_import)")
        return unknown
    schema = _schema(node.op_type, version, domain)
    if schema is None:
        if domain == "":
            raise InferenceError(
                f"{label}: no ONNX operator {node.op_type!r} exists in opset {version}"
            )
        return unknown
    types = {}
    for name, sym in zip(node.input, ins):
        if not name:
            continue
        t = _onnx_type(sym)
        if t is None:
            return unknown  # an operand of unknown type: outputs unknown
        types[name] = t
    data = {n: ctx_constant(ctx, n) for n in node.input if n and ctx_constant(ctx, n) is not None}
    onode = onnx.NodeProto.FromString(node.SerializeToString())
    try:
        got = onnx.shape_inference.infer_node_outputs(
            schema, onode, types, data or None,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in ctx.opsets.items()])
    except Exception as exc:  # onnx raises InferenceError / ValidationError / RuntimeError
        raise InferenceError(f"{label}: {str(exc).strip()}") from None
    result = []
    for name in node.output:
        if not name:
            result.append(None)
            continue
        tp = got.get(name)
        result.append(sym_from_type(tp) if tp is not None and tp.WhichOneof("value") else SymTensor())
    if node.op_type == "Constant" and domain == "" and node.output:
        _record_constant(ctx, node)
    return result


def ctx_constant(ctx: ShapesContext, name: str):
    c = ctx
    while c is not None:
        if name in c.constants:
            return c.constants[name]
        if c.local(name) is not None:
            return None
        c = c.parent if c.kind == "subgraph" else None
    return None


def _record_constant(ctx, node) -> None:
    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR and len(a.t.dims) <= 1 \
                and (not a.t.dims or a.t.dims[0] <= 64):
            t = onnx.TensorProto.FromString(a.t.SerializeToString())
            t.name = node.output[0]
            ctx.constants[node.output[0]] = t
        elif a.name == "value_ints":
            ctx.constants[node.output[0]] = onnx.helper.make_tensor(
                node.output[0], onnx.TensorProto.INT64, [len(a.ints)], list(a.ints))


# -- encoded values: layout, byte extent, size rules, decoder output ----------------------------
def encoded_byte_extent(ev: EncodedValueProto, what: str) -> tuple[int, bool]:
    """(payload bytes, external?) of an encoded value, without reading the payload.

    Raises
    ------
    PayloadError
        raw_data together with external data; EXTERNAL without location or explicit length; a
        bad length.
    """
    external = ev.data_location == TensorProto.EXTERNAL
    if ev.external_data and not external:
        raise PayloadError(f"{what}: external_data is set but data_location is not EXTERNAL")
    if not external:
        return len(ev.raw_data), False
    if ev.HasField("raw_data"):
        raise PayloadError(f"{what}: raw_data and external_data are mutually exclusive")
    entries = {e.key: e.value for e in ev.external_data}
    if not entries.get("location"):
        raise PayloadError(f"{what}: EXTERNAL payload without 'location'")
    if "length" not in entries:
        raise PayloadError(f"{what}: EXTERNAL payload needs an explicit 'length' (seed 000)")
    try:
        length = int(entries["length"])
    except ValueError:
        raise PayloadError(f"{what}: bad external length {entries['length']!r}") from None
    if length < 0:
        raise PayloadError(f"{what}: negative external length {length}")
    return length, True


def make_sym_encoded(ev: EncodedValueProto, catalogue: Catalogue) -> SymEncodedValue:
    """Validate one ``EncodedValueProto`` and describe it (seed 002 "Inference" steps 1-5).

    1. resolve the built-in layout or the inline / ID-referenced struct type;
    2. take the inline byte length or validate the explicit external extent;
    3. check the layout's size rules (struct: whole records, counted by exact division; affine:
       ``ceil(n * bits / 8)`` bytes and DequantizeLinear parameter shapes);
    4. check the logical type (concrete tensor for affine; a tensor type for struct values, whose
       FunctionProto decoder must read only leaf/constant paths and return one output);
    5. return the :class:`SymEncodedValue`.

    The payload is never read except, for an inline affine payload, its last byte (unused high
    bits must be zero).

    Raises
    ------
    EncodingError, AffineLayoutError, LayoutError, PayloadError, RecordCountError,
    CatalogueError, DecoderError
    """
    what = f"encoded value {ev.name!r}"
    if not ev.name:
        raise EncodingError("an encoded value needs a name")
    size, external = encoded_byte_extent(ev, what)
    kind = ev.WhichOneof("layout")
    if kind == "affine":
        a = ev.affine
        params = []
        for part in (a.scale, a.zero_point):
            if part.data_location == TensorProto.EXTERNAL:
                # external parameters (olv compile writes them so): only their type and shape
                # matter here, the payload is never read
                dt = NP_DTYPE.get(part.data_type, np.dtype(np.int8))
                params.append(np.broadcast_to(np.zeros((), dt), tuple(int(d) for d in part.dims)))
            else:
                params.append(None)
        scale = params[0] if params[0] is not None else param_tensor(a.scale)
        zp = None
        if a.HasField("zero_point"):
            zp = params[1] if params[1] is not None else param_tensor(a.zero_point)
        if external:  # extent only: a zero-stride view of the right length (no allocation)
            codes = np.broadcast_to(np.zeros(1, np.uint8), (size,))
        else:
            codes = np.frombuffer(ev.raw_data, np.uint8) if size else np.zeros(0, np.uint8)
        affine_value(ev, codes, scale, zp)  # AffineLayoutError with the numbers
        logical = TypeProto()
        logical.CopyFrom(ev.logical_type)
        return SymEncodedValue(ev.name, EncodedLayoutRef("affine", affine=copy_message(a)), size, None,
                               logical, external)
    if kind == "struct_type":
        root = catalogue.root(ev.struct_type, what)
        rb = root.record_bytes
        if size % rb:
            raise RecordCountError(
                f"{what} ({root.describe()}): payload bytes {size} are not a whole number of "
                f"{rb}-byte records ({size // rb} records + {size % rb} bytes)"
            )
        logical = None
        if ev.HasField("logical_type"):
            tensor_type_shape(ev.logical_type, what)
            logical = TypeProto()
            logical.CopyFrom(ev.logical_type)
        decl = root.declaration
        if decl.HasField("decoder"):
            fn = decl.decoder
            paths = set(root.layout.paths())
            unknown = [i for i in fn.input if i not in paths]
            if unknown:
                raise DecoderError(
                    f"{what}: decoder {fn.name!r} of {root.describe()} reads {unknown}, which are "
                    f"no leaf or constant paths of the record (paths: {sorted(paths)})"
                )
            if len(fn.output) != 1:
                raise DecoderError(
                    f"{what}: decoder {fn.name!r} must have exactly one output (the logical "
                    f"tensor), has {len(fn.output)}"
                )
            if logical is not None:
                _check_decoder_output(what, root, size // rb, logical)
        return SymEncodedValue(ev.name, EncodedLayoutRef("struct", root=root), size, size // rb,
                               logical, external)
    raise EncodingError(f"{what}: no layout (affine or struct_type) set")


def _check_decoder_output(what: str, root: RootType, records: int, logical: TypeProto) -> None:
    """Infer the FunctionProto decoder over the field shapes olv_runtime binds
    (``[records, *field_shape]``, constants with their own shape) and compare its output with
    the logical type wherever inference knows it."""
    fn = root.declaration.decoder
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in fn.opset_import}
    fctx = ShapesContext(opsets=opsets or {"": 21})
    for path in fn.input:
        leaf = root.layout.leaf(path)
        if leaf is not None:
            et = DTYPE_TO_ONNX.get(np.dtype(leaf.dtype).newbyteorder("="), 0)
            fctx.set_value(path, SymTensor(et, (records, *leaf.shape)))
        else:
            c = root.layout.constant(path)
            et = DTYPE_TO_ONNX.get(c.value.dtype.newbyteorder("="), 0)
            fctx.set_value(path, SymTensor(et, tuple(c.value.shape)))
    try:
        for n in fn.node:
            for name, sym in zip(n.output, infer_node(fctx, n)):
                if name and sym is not None:
                    fctx.set_value(name, sym, replace=True)
    except BuilderError as exc:
        raise DecoderError(f"{what}: decoder {fn.name!r}: {exc}") from None
    got = fctx.lookup(fn.output[0])
    want = SymTensor.from_type(logical)
    if not isinstance(got, SymTensor):
        return
    if got.elem_type and got.elem_type != want.elem_type or (
            got.shape is not None and all(isinstance(d, int) for d in got.shape)
            and tuple(got.shape) != tuple(want.shape)):
        raise DecoderError(
            f"{what}: decoder {fn.name!r} of {root.describe()} produces {got.describe()} for "
            f"{records} records, but logical_type is {want.describe()}"
        )


# -- what a node or a graph reads -------------------------------------------------------------
def node_reads(node: NodeProto) -> set[str]:
    """Names a node reads: its inputs plus outer-scope names read inside its subgraphs."""
    names = {n for n in node.input if n}
    for _, g in subgraphs(node):
        names |= graph_outer_reads(g)
    return names


def graph_outer_reads(g: GraphProto) -> set[str]:
    """Names read by a subgraph that it does not define itself."""
    defined = {vi.name for vi in g.input} | {t.name for t in g.initializer} | \
        {e.name for e in g.encoded_initializer}
    reads: set[str] = set()
    for n in g.node:
        reads |= {x for x in node_reads(n) if x not in defined}
        defined |= set(n.output)
    reads |= {vi.name for vi in g.output if vi.name not in defined}
    return reads
