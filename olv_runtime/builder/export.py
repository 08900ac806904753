"""Standard-ONNX export: lower the seed 000 extensions or fail naming what cannot be lowered.

:func:`export_standard` imports a model into a :class:`~olv_runtime.builder.GraphBuilder`,
rewrites it, and re-imports the result (so the exported graph passes the builder's inference):

* **Affine encoded initializers** become a ``TensorProto`` of the storage type (INT8, UINT8,
  INT4, UINT4, INT2, UINT2; same row-major LSB-first packing as ``raw_data``, and an external
  payload stays external with the same location/offset/length) under the value's own name, plus
  ``<name>::scale`` (and ``<name>::zero_point``) initializers; each ``olv.Decode(name)`` becomes
  ``DequantizeLinear(name, <name>::scale[, <name>::zero_point], axis, block_size)``. Needs the
  default-domain opset of DequantizeLinear for the form: 10 (per-tensor 8-bit), 13 (per-axis),
  21 (blocked, INT4/UINT4), 25 (INT2/UINT2); a FLOAT value over a FLOAT16 scale (the converter's
  default INT4 form) adds ``output_dtype=FLOAT`` and needs opset 23.
* **Struct encoded initializers with a FunctionProto decoder** become one dense initializer per
  decoder input, ``<name>::<leaf path>`` (the field array ``[records, *field_shape]``, sub-byte
  integers widened to INT8/UINT8 exactly as olv_runtime binds them; constants with their own
  shape), and each ``olv.Decode(name)`` is replaced by the decoder's nodes (values renamed
  ``<decode output>::<name>``). The decoder's nodes are read under the model's opset imports,
  which must be at least the decoder's.
* **Persistent bindings** make the export fail unless ``feedback=True``: then the graph is the
  same stateless graph (bound inputs stay inputs, bound outputs stay outputs), the bindings are
  removed from the graph and recorded in ``metadata_props[FEEDBACK_METADATA_KEY]`` as JSON
  ``[{"input": ..., "output": ...}]``, and the caller runs the feedback loop (docs/builder.md).
* Anything else fails with :class:`~olv_runtime.builder.errors.StandardExportError` naming the
  value or node: struct values without a FunctionProto decoder (native decoders have no ONNX
  form), encoded values read by anything but ``olv.Decode``, struct-typed graph inputs/outputs,
  remaining ``olv`` nodes (e.g. inside local functions), DOUBLE affine scales.
"""
from __future__ import annotations

import json

import numpy as np

from olv_runtime.builder.context import SymEncodedValue
from olv_runtime.builder.errors import StandardExportError
from olv_runtime.builder.graph import GraphBuilder
from olv_runtime.builder.inference import node_label, subgraphs
from olv_runtime.io import Model, as_model, save
from olv_runtime.proto import AttributeProto, ModelProto, NodeProto, TensorProto
from olv_runtime.proto.helper import make_node, make_tensor
from olv_runtime.structs.value import encoded_value

__all__ = ["export_standard", "save_standard", "to_onnx", "FEEDBACK_METADATA_KEY",
           "lower_to_standard"]

#: metadata_props key of the feedback lowering: JSON list of {"input", "output"} pairs.
FEEDBACK_METADATA_KEY = "olv.feedback"
_OLV = "olv"


def _widened(sym: SymEncodedValue) -> bool:
    """FLOAT logical type over a FLOAT16 scale: DequantizeLinear with output_dtype=FLOAT."""
    return (sym.layout.affine.scale.data_type == TensorProto.FLOAT16
            and sym.logical_tensor.elem_type == TensorProto.FLOAT)


def _dq_opset(sym: SymEncodedValue) -> int:
    base = _dq_opset_form(sym)
    return max(base, 23) if _widened(sym) else base  # output_dtype needs opset 23


def _dq_opset_form(sym: SymEncodedValue) -> int:
    a = sym.layout.affine
    st = a.storage_type
    if st in (TensorProto.INT2, TensorProto.UINT2):
        return 25
    if st in (TensorProto.INT4, TensorProto.UINT4) or a.HasField("block_size"):
        return 21
    if a.HasField("axis"):
        return 13
    return 10


def export_standard(model, *, feedback: bool = False) -> Model:
    """The model as standard ONNX (see the module docstring).

    Parameters
    ----------
    model : Model, ModelProto, onnx.ModelProto, path or GraphBuilder
        Not modified.
    feedback : bool
        Lower persistent bindings to caller-managed past/present feedback (documented in
        ``docs/builder.md``); without it a model with bindings is rejected.

    Returns
    -------
    Model
        In memory (olv_runtime's ModelProto, no extension fields set); its ``path`` is the
        source's, so external payloads still resolve for :func:`olv_runtime.save`.

    Raises
    ------
    StandardExportError
        Something has no standard-ONNX form; the message names it.
    """
    if isinstance(model, GraphBuilder):
        src = Model(model.to_model(), model.source_path)
    else:
        src = as_model(model)
    b = GraphBuilder.from_model(src)
    lower_to_standard(b, feedback=feedback)
    proto = b.to_model(compact_types=True)
    out = Model(proto, src.path)
    GraphBuilder.from_model(out)  # the lowered graph passes the builder's inference
    _assert_standard(proto)
    return out


def save_standard(model, path, *, feedback: bool = False, external_data: bool | None = None):
    """:func:`export_standard`, then :func:`olv_runtime.save` to ``path``."""
    return save(export_standard(model, feedback=feedback), path, external_data=external_data)


def to_onnx(model):
    """An ``onnx.ModelProto`` of a standard export (or any model): re-parsed from its bytes."""
    import onnx

    proto = as_model(model).proto
    return onnx.ModelProto.FromString(proto.SerializeToString())


def lower_to_standard(b: GraphBuilder, *, feedback: bool = False) -> None:
    """Rewrite a builder in place into standard ONNX (see :func:`export_standard`)."""
    _lower_bindings(b, feedback)
    for section in ("input", "output", "value_info"):
        for vi in getattr(b.graph, section):
            if vi.type.WhichOneof("value") == "struct_type":
                raise StandardExportError(
                    f"graph {section} {vi.name!r} has a struct type; standard ONNX has no struct "
                    "values (decode it inside the graph or pass its fields separately)"
                )
    lowered: dict[str, object] = {}
    for ev in list(b.graph.encoded_initializer):
        sym = b.ctx.local(ev.name)
        assert isinstance(sym, SymEncodedValue)
        lowered[ev.name] = _lower_affine(b, ev, sym) if sym.layout.kind == "affine" \
            else _lower_struct(b, ev, sym)
    b._nodes = _lower_nodes(b._nodes, lowered, b)
    del b.graph.encoded_initializer[:]
    for fn in b._functions:
        for n in fn.node:
            _reject_olv(n, f"function {fn.domain}::{fn.name} ")
    if _OLV in b.ctx.opsets and not any(_uses_domain(n, _OLV) for n in b._nodes):
        del b.ctx.opsets[_OLV]


def _lower_bindings(b: GraphBuilder, feedback: bool) -> None:
    pairs = b.bindings
    if not pairs:
        return
    listed = ", ".join(f"{i!r} <- {o!r}" for i, o in pairs[:4]) + (" ..." if len(pairs) > 4 else "")
    if not feedback:
        raise StandardExportError(
            f"the model declares {len(pairs)} persistent binding(s) ({listed}); standard ONNX has "
            "no persistent state. Export with feedback=True (olv export-standard --feedback) to "
            "lower them to caller-managed past/present feedback (docs/builder.md)"
        )
    b.validate_bindings()
    for i, _ in pairs:
        b.remove_binding(i)
    props = b._model.metadata_props
    for k in reversed([k for k, p in enumerate(props) if p.key == FEEDBACK_METADATA_KEY]):
        del props[k]
    props.add(key=FEEDBACK_METADATA_KEY,
              value=json.dumps([{"input": i, "output": o} for i, o in pairs]))


def _lower_affine(b: GraphBuilder, ev, sym: SymEncodedValue):
    a = sym.layout.affine
    name = ev.name
    need = _dq_opset(sym)
    have = b.ctx.opsets.get("", 0)
    if have < need:
        raise StandardExportError(
            f"encoded value {name!r} ({sym.layout.describe()}): DequantizeLinear of this form "
            f"needs default-domain opset {need}, the model imports {have}"
        )
    if a.scale.data_type == TensorProto.DOUBLE:
        raise StandardExportError(
            f"encoded value {name!r}: a DOUBLE scale has no DequantizeLinear equivalent"
        )
    codes = TensorProto(name=name, data_type=a.storage_type)
    codes.dims.extend(sym.logical_tensor.shape)
    if ev.data_location == TensorProto.EXTERNAL:  # external stays external
        codes.data_location = TensorProto.EXTERNAL
        codes.external_data.extend(ev.external_data)
    else:
        codes.raw_data = ev.raw_data
    if ev.doc_string:
        codes.doc_string = ev.doc_string
    b.graph.initializer.append(codes)
    b._inits[name] = "dense"
    inputs = [name, _param(b, f"{name}::scale", a.scale)]
    if a.HasField("zero_point"):
        inputs.append(_param(b, f"{name}::zero_point", a.zero_point))
    attrs = {}
    if a.HasField("axis"):
        attrs["axis"] = int(a.axis)
    if a.HasField("block_size"):
        attrs["block_size"] = int(a.block_size)
    if _widened(sym):
        attrs["output_dtype"] = TensorProto.FLOAT
    return ("affine", inputs, attrs)


def _param(b: GraphBuilder, name: str, t: TensorProto) -> str:
    if name in b._inits or b.ctx.lookup(name) is not None:
        raise StandardExportError(f"cannot name the lowered parameter {name!r}: already in use")
    p = TensorProto()
    p.CopyFrom(t)
    p.name = name
    b.graph.initializer.append(p)
    b._inits[name] = "dense"
    return name


def _lower_struct(b: GraphBuilder, ev, sym: SymEncodedValue):
    root = sym.layout.root
    decl = root.declaration
    if not decl.HasField("decoder"):
        raise StandardExportError(
            f"encoded value {ev.name!r} ({root.describe()}) has no FunctionProto decoder; a "
            "native decoder has no standard-ONNX form"
        )
    fn = decl.decoder
    for imp in fn.opset_import:
        d = "" if imp.domain == "ai.onnx" else imp.domain
        have = b.ctx.opsets.get(d)
        if have is None or have < imp.version:
            raise StandardExportError(
                f"encoded value {ev.name!r}: decoder {fn.name!r} imports {d or 'ai.onnx'} "
                f"{imp.version}, the model imports {have if have is not None else 'nothing'}"
            )
    value = encoded_value(Model(ModelProto(), b.source_path), ev, b.ctx.catalogue)
    fields = {}
    for path in fn.input:
        init = f"{ev.name}::{path}"
        if init in b._inits or b.ctx.lookup(init) is not None:
            raise StandardExportError(f"cannot name the field initializer {init!r}: already in use")
        arr = np.ascontiguousarray(value.field(path, copy=True))
        b.graph.initializer.append(make_tensor(init, arr))
        b._inits[init] = "dense"
        fields[path] = init
    return ("struct", fn, fields)


def _is_decode(n: NodeProto) -> bool:
    return n.domain == _OLV and n.op_type == "Decode"


def _lower_nodes(nodes, lowered: dict, b: GraphBuilder) -> list:
    out = []
    for n in nodes:
        if _is_decode(n):
            src = n.input[0]
            how = lowered.get(src)
            if how is None:
                raise StandardExportError(
                    f"{node_label(n)} decodes {src!r}, which is not an encoded initializer of the "
                    "model (encoded graph inputs have no standard-ONNX form)"
                )
            out.extend(_decode_nodes(n, how))
            continue
        for name in n.input:
            how = lowered.get(name)
            if how is not None and how[0] == "struct":
                raise StandardExportError(
                    f"{node_label(n)} reads struct-encoded value {name!r} directly; only "
                    "olv.Decode of it can be lowered"
                )
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                _lower_graph(a.g, lowered, b)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    _lower_graph(g, lowered, b)
        out.append(n)
    return out


def _lower_graph(g, lowered, b) -> None:
    inner = {k: v for k, v in lowered.items()
             if k not in {e.name for e in g.initializer} | {vi.name for vi in g.input}}
    if len(g.encoded_initializer):
        raise StandardExportError(
            f"subgraph {g.name!r} has its own encoded initializers "
            f"({[e.name for e in g.encoded_initializer][:3]}); move them to the root graph"
        )
    nodes = _lower_nodes(list(g.node), inner, b)
    del g.node[:]
    g.node.extend(nodes)


def _decode_nodes(n: NodeProto, how) -> list:
    if how[0] == "affine":
        _, inputs, attrs = how
        return [make_node("DequantizeLinear", inputs, [n.output[0]], name=n.name or None, **attrs)]
    _, fn, fields = how
    out_name = n.output[0]
    rename = dict(fields)
    rename[fn.output[0]] = out_name
    result = []
    for k, inner in enumerate(fn.node):
        if inner.domain not in ("", "ai.onnx"):
            raise StandardExportError(
                f"{node_label(n)}: decoder {fn.name!r} uses {node_label(inner)} outside the "
                "default ONNX domain"
            )
        if any(a.ref_attr_name for a in inner.attribute) or any(True for _ in subgraphs(inner)):
            raise StandardExportError(
                f"{node_label(n)}: decoder {fn.name!r} node {node_label(inner)} has attribute "
                "references or subgraphs, which the lowering does not inline"
            )
        m = NodeProto()
        m.CopyFrom(inner)
        m.name = f"{n.name or out_name}::{inner.name or f'{inner.op_type}_{k}'}"
        for i, x in enumerate(m.input):
            if x:
                m.input[i] = rename.get(x, f"{out_name}::{x}")
        for i, x in enumerate(m.output):
            if x:
                m.output[i] = rename.get(x, f"{out_name}::{x}")
        result.append(m)
    return result


def _reject_olv(n: NodeProto, where: str = "") -> None:
    if n.domain == _OLV:
        raise StandardExportError(
            f"{where}{node_label(n)} is an olv operator with no standard-ONNX lowering here"
        )
    for _, g in subgraphs(n):
        for m in g.node:
            _reject_olv(m, where)


def _uses_domain(n: NodeProto, domain: str) -> bool:
    if n.domain == domain:
        return True
    return any(_uses_domain(m, domain) for _, g in subgraphs(n) for m in g.node)


def _assert_standard(proto: ModelProto) -> None:
    g = proto.graph
    for n in g.node:
        _reject_olv(n)
    assert not len(g.encoded_initializer) and not len(g.persistent_bindings)
    assert not len(proto.struct_types)
