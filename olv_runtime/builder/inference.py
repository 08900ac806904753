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

import onnx
from onnx import defs as onnx_defs

from olv_runtime.builder.context import (
    ShapesContext,
    Sym,
    SymEncodedValue,
    SymSequence,
    SymTensor,
    SymType,
    sym_from_type,
)
from olv_runtime.builder.errors import EncodedInputError, InferenceError
from olv_runtime.errors import MissingDecoderError
from olv_runtime.proto import AttributeProto, GraphProto, NodeProto

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
    :func:`~olv_runtime.builder.context.make_sym_encoded`, then nodes in order)."""
    from olv_runtime.builder.context import make_sym_encoded

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
