"""GraphBuilder: authoring and rewriting graphs without losing what the model says (seed 002,
seed 000 "GraphBuilder, shape inference and serialization", PR03/PR04a).

A :class:`GraphBuilder` holds one graph: inputs, outputs, nodes, dense and encoded initializers
(payloads stored unchanged, external payloads stay external), the struct-type catalogue, local
functions, persistent bindings and opset imports. Every value's description lives in its
:class:`~olv_runtime.builder.context.ShapesContext` (``builder.ctx``), updated as each node is
added (incremental inference). ``ModelProto -> GraphBuilder -> ModelProto`` preserves payloads,
types, byte extents, logical shapes and type_ids.

::

    b = GraphBuilder("g", opsets={"": 23, "olv": 1})
    b.add_struct_type(examples.codebook2_1101())
    b.add_struct_type(examples.scaled_codebook2_1102())
    w = b.make_encoded_initializer(build.make_struct_encoded("w", 1102, payload, ("FLOAT", [64])))
    x = b.add_input("x", "FLOAT", [64])
    wd = b.make_node("Decode", [w], ["w_dec"], domain="olv")     # FLOAT[64], inferred at once
    b.add_output(b.make_node("Mul", [x, wd], ["y"]))
    model = b.to_model()
"""
from __future__ import annotations

import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from olv_runtime.builder import passes
from olv_runtime.builder.context import (
    ShapesContext,
    SymEncodedValue,
    SymTensor,
    sym_from_type,
)
from olv_runtime.builder.errors import (
    BuilderError,
    DuplicateValueError,
    StandaloneGraphError,
)
from olv_runtime.builder.inference import (
    infer_node,
    make_sym_encoded,
    node_label,
    node_reads,
    subgraphs,
)
from olv_runtime.errors import BindingError
from olv_runtime.io import Model, as_model, save
from olv_runtime.proto import (
    AttributeProto,
    EncodedValueProto,
    FunctionProto,
    GraphProto,
    ModelProto,
    NodeProto,
    StructTypeProto,
    TensorProto,
    TypeProto,
    ValueInfoProto,
)
from olv_runtime.proto.helper import make_node, make_tensor, make_tensor_type
from olv_runtime.state.bindings import resolve_bindings

__all__ = ["GraphBuilder", "struct_refs", "inline_struct"]

DEFAULT_OPSETS = {"": 23}
_GRAPH_LISTS = ("node", "initializer", "sparse_initializer", "encoded_initializer", "input",
                "output", "value_info", "persistent_bindings")
_SMALL_CONSTANT = 64  # elements of an int64 initializer kept as inference data


def _value_info(name: str, type_or_elem, shape) -> ValueInfoProto:
    vi = ValueInfoProto(name=name)
    if isinstance(type_or_elem, ValueInfoProto):
        vi.CopyFrom(type_or_elem)
        vi.name = name
    elif isinstance(type_or_elem, TypeProto):
        vi.type.CopyFrom(type_or_elem)
    elif isinstance(type_or_elem, StructTypeProto):
        vi.type.struct_type.CopyFrom(type_or_elem)
    elif type_or_elem is not None:
        vi.type.CopyFrom(make_tensor_type(type_or_elem, shape))
    return vi


class GraphBuilder:
    """Build or rewrite one graph (the root graph of a model, or an ``If`` branch).

    Parameters
    ----------
    name : str
        Graph name.
    opsets : dict or sequence of (domain, version), optional
        Opset imports (default ``{"": 23}``); root graphs only.
    ir_version : int
        ``ModelProto.ir_version`` written by :meth:`to_model`.

    Attributes
    ----------
    ctx : ShapesContext
        The value descriptions (tensors, sequences, encoded values), the catalogue, opsets and
        functions.
    source_path : pathlib.Path or None
        The file an imported model came from; external payloads are relative to its directory.
    """

    def __init__(self, name: str = "graph", opsets=None, *, ir_version: int = 10,
                 _parent: "GraphBuilder | None" = None):
        self._model = ModelProto()
        self.graph = self._model.graph
        self.graph.name = name
        self.parent = _parent
        if _parent is None:
            ops = dict(opsets.items() if isinstance(opsets, dict) else opsets) \
                if opsets is not None else dict(DEFAULT_OPSETS)
            self.ctx = ShapesContext(opsets={("" if d == "ai.onnx" else d): int(v)
                                             for d, v in ops.items()})
            self._model.ir_version = int(ir_version)
        else:
            self.ctx = _parent.ctx.child("subgraph")
        self._nodes: list[NodeProto] = []
        self._node_names: set[str] = set()
        self._producer: dict[str, NodeProto] = {}
        self._inits: dict[str, str] = {}  # name -> "dense" | "sparse" | "encoded"
        self._bindings: list[tuple[str, str]] = []
        self._functions: list[FunctionProto] = []
        self._auto = 0
        self._released = False
        self.source_path: pathlib.Path | None = None

    # ------------------------------------------------------------------ opsets, types, functions
    @property
    def opsets(self) -> dict[str, int]:
        """Opset imports, domain -> version (shared with subgraphs)."""
        return self.ctx.opsets

    def set_opset(self, domain: str, version: int) -> None:
        """Import ``domain`` at ``version`` (replacing a previous import)."""
        self.ctx.opsets["" if domain == "ai.onnx" else domain] = int(version)

    def add_struct_type(self, st: StructTypeProto) -> int:
        """Add a catalogue declaration (``ModelProto.struct_types``); returns its type_id.

        Adding the identical declaration again is a no-op; a different declaration under an
        existing ID raises :class:`~olv_runtime.builder.errors.ConflictingTypeError` (never
        renumbered). Referenced types must already be present (or use :meth:`add_struct_types`).
        """
        return self.ctx.add_struct_type(st)

    def add_struct_types(self, sts: Iterable[StructTypeProto]) -> list[int]:
        """Add several declarations that may reference each other in any order."""
        return self.ctx.add_struct_types(sts)

    def get_struct_type(self, type_id: int) -> StructTypeProto:
        """The declaration of ``type_id`` (UnresolvedTypeRefError if absent)."""
        return self.ctx.get_struct_type(type_id)

    def add_function(self, fn: FunctionProto) -> tuple[str, str]:
        """Add a model-local function (``ModelProto.functions``); nodes of ``(fn.domain,
        fn.name)`` then call it. Returns that key.

        Raises
        ------
        DuplicateValueError
            A function with the same domain and name exists.
        """
        self._root_only("local functions")
        key = ("" if fn.domain == "ai.onnx" else fn.domain, fn.name)
        if key in self.ctx.functions:
            raise DuplicateValueError(f"function {fn.domain}::{fn.name} is already defined")
        copy = FunctionProto()
        copy.CopyFrom(fn)
        self.ctx.functions[key] = copy
        self._functions.append(copy)
        if key[0] and key[0] not in self.ctx.opsets:
            self.ctx.opsets[key[0]] = 1
        return key

    @property
    def functions(self) -> list[FunctionProto]:
        return list(self._functions)

    # ------------------------------------------------------------------ inputs and outputs
    def add_input(self, name: str, type_or_elem, shape: Sequence | None = None) -> str:
        """Declare a graph input.

        Parameters
        ----------
        name : str
        type_or_elem : TypeProto, StructTypeProto, ValueInfoProto, int or str
            A full type, a struct type (``TypeProto.struct_type``), or a tensor element type.
        shape : sequence of (int, str, None), optional
            Tensor dims when ``type_or_elem`` is an element type.

        Returns
        -------
        str
            ``name``.
        """
        vi = _value_info(name, type_or_elem, shape)
        if any(i.name == name for i in self.graph.input):
            raise DuplicateValueError(f"graph input {name!r} is already declared")
        if vi.type.WhichOneof("value") == "struct_type":
            self.ctx.catalogue.check_type(vi.type, f"graph input {name!r}")
        if name in self._inits:  # an initializer that may be overridden by a feed
            self.graph.input.append(vi)
            return name
        self.ctx.set_value(name, sym_from_type(vi.type))
        self.graph.input.append(vi)
        return name

    def add_output(self, name: str, type_or_elem=None, shape: Sequence | None = None) -> str:
        """Declare a graph output; its type defaults to the inferred descriptor.

        Raises
        ------
        UnavailableValueError
            ``name`` is not defined in the graph.
        BuilderError
            The output is an encoded value and no type is given.
        """
        sym = self.ctx.require(name, f"graph output {name!r}")
        if any(o.name == name for o in self.graph.output):
            raise DuplicateValueError(f"graph output {name!r} is already declared")
        if type_or_elem is None:
            if isinstance(sym, SymEncodedValue):
                raise BuilderError(
                    f"graph output {name!r} is an encoded value; declare its type explicitly"
                )
            vi = ValueInfoProto(name=name)
            vi.type.CopyFrom(sym.to_type())
        else:
            vi = _value_info(name, type_or_elem, shape)
        self.graph.output.append(vi)
        return name

    def add_value_info(self, vi: ValueInfoProto) -> None:
        """Record a ``value_info`` entry (kept verbatim)."""
        self.graph.value_info.append(vi)

    @property
    def inputs(self) -> list[str]:
        return [vi.name for vi in self.graph.input]

    @property
    def outputs(self) -> list[str]:
        return [vi.name for vi in self.graph.output]

    # ------------------------------------------------------------------ initializers
    def make_initializer(self, name: str, value) -> str:
        """Add a dense initializer from a numpy array or a ``TensorProto`` (kept unchanged,
        external data included). Returns ``name``.

        Raises
        ------
        DuplicateValueError
            The name is already an initializer or node output.
        """
        if isinstance(value, TensorProto):
            t = value
            if t.name != name:
                t = TensorProto()
                t.CopyFrom(value)
                t.name = name
        else:
            t = make_tensor(name, np.asarray(value))
        self._claim_init(name, "dense")
        self.graph.initializer.append(t)
        self._describe_init(name, SymTensor(int(t.data_type), tuple(int(d) for d in t.dims)))
        if t.data_type == TensorProto.INT64 and len(t.dims) <= 1 and \
                int(np.prod(t.dims or [1])) <= _SMALL_CONSTANT and \
                t.data_location != TensorProto.EXTERNAL:
            import onnx

            self.ctx.constants[name] = onnx.TensorProto.FromString(t.SerializeToString())
        return name

    def make_encoded_initializer(self, value: EncodedValueProto) -> str:
        """Add an encoded initializer (``GraphProto.encoded_initializer``), stored unchanged.

        The value is validated and described through the same helper model import uses
        (:func:`~olv_runtime.builder.context.make_sym_encoded`): layout resolved (affine or
        inline / referenced struct type), byte extent (inline length or the explicit external
        length), record count by exact division, logical type. External payloads stay external.

        Returns
        -------
        str
            The value's name.

        Raises
        ------
        DuplicateValueError, EncodingError, LayoutError, PayloadError, RecordCountError,
        CatalogueError, DecoderError
        """
        sym = make_sym_encoded(value, self.ctx.catalogue)
        name = value.name
        self._claim_init(name, "encoded")
        self.graph.encoded_initializer.append(value)
        self._describe_init(name, sym)
        return name

    def _claim_init(self, name: str, kind: str) -> None:
        if not name:
            raise BuilderError(f"a {kind} initializer needs a name")
        if name in self._inits:
            raise DuplicateValueError(
                f"initializer name {name!r} is already used by a {self._inits[name]} initializer "
                "(names are unique across dense, sparse and encoded initializers)"
            )
        if name in self._producer:
            raise DuplicateValueError(f"{name!r} is already the output of "
                                      f"{node_label(self._producer[name])}")
        self._inits[name] = kind

    def _describe_init(self, name: str, sym) -> None:
        if name in self.inputs:  # an input overridden by an initializer: keep the declared type
            return
        self.ctx.set_value(name, sym)

    def initializer(self, name: str):
        """The stored TensorProto / EncodedValueProto named ``name`` (None if absent)."""
        kind = self._inits.get(name)
        if kind is None:
            return None
        if kind == "dense":
            seq = self.graph.initializer
        elif kind == "encoded":
            seq = self.graph.encoded_initializer
        else:
            return next(s for s in self.graph.sparse_initializer if s.values.name == name)
        return next(t for t in seq if t.name == name)

    @property
    def initializer_names(self) -> dict[str, str]:
        """name -> "dense" / "sparse" / "encoded"."""
        return dict(self._inits)

    # ------------------------------------------------------------------ nodes
    def _auto_name(self, op_type: str) -> str:
        while True:
            self._auto += 1
            name = f"{op_type}_{self._auto}"
            if name not in self._node_names:
                return name

    def make_node(self, op_type: str, inputs: Sequence[str], outputs=1, *, name: str | None = None,
                  domain: str = "", **attrs):
        """Add a node; its outputs are inferred at once.

        Parameters
        ----------
        op_type : str
        inputs : sequence of str
            Value names (``""`` for an omitted optional input); each must be available.
        outputs : int or sequence of str
            Output names, or a count (names ``<node name>/output_<i>``).
        name : str, optional
            Node name (unique; generated when omitted).
        domain : str
        **attrs
            Attributes (see :func:`olv_runtime.proto.helper.make_attribute`); a ``GraphBuilder`` or
            ``GraphProto`` value becomes a GRAPH attribute.

        Returns
        -------
        str or tuple of str
            The output name (one output) or names.
        """
        node_name = name if name is not None else self._auto_name(op_type)
        if isinstance(outputs, int):
            outputs = [f"{node_name}/output_{i}" for i in range(outputs)]
        graphs = {k: v for k, v in attrs.items() if isinstance(v, (GraphBuilder, GraphProto))}
        plain = {k: v for k, v in attrs.items() if k not in graphs}
        node = make_node(op_type, list(inputs), list(outputs), name=node_name, domain=domain, **plain)
        for key in sorted(graphs):
            g = graphs[key]
            a = AttributeProto(name=key, type=AttributeProto.GRAPH)
            a.g.CopyFrom(g._graph_proto() if isinstance(g, GraphBuilder) else g)
            node.attribute.append(a)
        self.add_node(node)
        return node.output[0] if len(node.output) == 1 else tuple(node.output)

    def add_node(self, node: NodeProto) -> NodeProto:
        """Add a prebuilt node (copied); returns the stored node.

        Raises
        ------
        DuplicateValueError
            Node name already used; an output already defined.
        UnavailableValueError, EncodedInputError, MissingDecoderError, InferenceError
            See :func:`~olv_runtime.builder.inference.infer_node`.
        """
        self._check_open()
        if node.name and node.name in self._node_names:
            raise DuplicateValueError(f"node name {node.name!r} is already used")
        for out in node.output:
            if not out:
                continue
            if out in self._producer or out in self._inits or self.ctx.local(out) is not None:
                raise DuplicateValueError(
                    f"{node_label(node)} output {out!r} is already defined (values are assigned once)"
                )
        for _, g in subgraphs(node):
            self._reject_nested_bindings(g, node)
        syms = infer_node(self.ctx, node)
        stored = NodeProto()
        stored.CopyFrom(node)
        for out, sym in zip(stored.output, syms):
            if out:
                self.ctx.set_value(out, sym if sym is not None else SymTensor())
                self._producer[out] = stored
        if stored.name:
            self._node_names.add(stored.name)
        self._nodes.append(stored)
        return stored

    @staticmethod
    def _reject_nested_bindings(g: GraphProto, node) -> None:
        if len(g.persistent_bindings):
            raise BindingError(
                f"{node_label(node)}: a subgraph declares persistent_bindings; bindings in "
                "control-flow subgraphs are rejected until scoped state is supported (seed 000)"
            )
        for n in g.node:
            for _, sub in subgraphs(n):
                GraphBuilder._reject_nested_bindings(sub, n)

    def subgraph(self, name: str) -> "GraphBuilder":
        """A builder for an ``If`` branch: sees this graph's values (encoded ones included) and
        the catalogue; declares its results with :meth:`add_output`."""
        return GraphBuilder(name, _parent=self)

    def make_if(self, cond: str, then_branch: "GraphBuilder", else_branch: "GraphBuilder",
                outputs: Sequence[str] | int, *, name: str | None = None):
        """Add ``If(cond)`` with two branch builders from :meth:`subgraph`."""
        n = len(then_branch.graph.output)
        if isinstance(outputs, int):
            if outputs != n:
                raise BuilderError(f"If: {outputs} outputs requested, then_branch has {n}")
        return self.make_node("If", [cond], outputs, name=name, then_branch=then_branch,
                              else_branch=else_branch)

    @property
    def nodes(self) -> list[NodeProto]:
        """The nodes in order (the stored objects: edit through the builder's passes)."""
        return list(self._nodes)

    def node(self, name: str) -> NodeProto:
        for n in self._nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r}")

    def producer(self, value: str) -> NodeProto | None:
        """The node producing ``value`` (None for inputs and initializers)."""
        return self._producer.get(value)

    def consumers(self, value: str) -> list[NodeProto]:
        """Nodes reading ``value`` (directly, or from inside one of their subgraphs)."""
        return [n for n in self._nodes if value in node_reads(n)]

    def value(self, name: str):
        """The descriptor of ``name`` (SymTensor, SymSequence, SymEncodedValue or SymType)."""
        return self.ctx.require(name, "GraphBuilder.value")

    # ------------------------------------------------------------------ persistent bindings
    def add_binding(self, input_name: str, output_name: str) -> None:
        """Declare ``input_name <- output_name`` (``GraphProto.persistent_bindings``).

        Names are exact whole input/output names. Checked immediately for existence and
        duplicates; type compatibility is checked against the final graph by :meth:`to_model`.

        Raises
        ------
        BindingError
            In a subgraph; unknown input/output; input or output already selected.
        """
        if self.parent is not None:
            raise BindingError(
                f"persistent binding {input_name!r} <- {output_name!r}: bindings in control-flow "
                "subgraphs are rejected until scoped state is supported (seed 000)"
            )
        what = f"persistent binding {input_name!r} <- {output_name!r}"
        if input_name not in self.inputs:
            raise BindingError(f"{what}: {input_name!r} is not a graph input")
        if output_name not in self.outputs:
            raise BindingError(f"{what}: {output_name!r} is not a graph output")
        for i, o in self._bindings:
            if i == input_name:
                raise BindingError(f"{what}: input {input_name!r} is already bound (<- {o!r})")
            if o == output_name:
                raise BindingError(f"{what}: output {output_name!r} is already bound ({i!r} <-)")
        self._bindings.append((input_name, output_name))

    def remove_binding(self, input_name: str) -> tuple[str, str]:
        """Remove the binding of ``input_name`` explicitly; returns it."""
        for k, (i, o) in enumerate(self._bindings):
            if i == input_name:
                return self._bindings.pop(k)
        raise BindingError(f"no persistent binding selects input {input_name!r}")

    @property
    def bindings(self) -> list[tuple[str, str]]:
        """(input_name, output_name) pairs in declaration order."""
        return list(self._bindings)

    def binding_of(self, name: str) -> tuple[str, str] | None:
        """The binding selecting ``name`` as input or output, if any."""
        for b in self._bindings:
            if name in b:
                return b
        return None

    # ------------------------------------------------------------------ passes (see passes.py)
    def remove_dead_nodes(self, *, initializers: bool = True) -> int:
        return passes.remove_dead_nodes(self, initializers=initializers)

    def dedup_initializers(self) -> dict[str, str]:
        return passes.dedup_initializers(self)

    def rename_value(self, old: str, new: str) -> None:
        passes.rename_value(self, old, new)

    def remove_node(self, name: str) -> NodeProto:
        return passes.remove_node(self, name)

    def remove_output(self, name: str, *, drop_binding: bool = False) -> None:
        passes.remove_output(self, name, drop_binding=drop_binding)

    def remove_input(self, name: str, *, drop_binding: bool = False) -> None:
        passes.remove_input(self, name, drop_binding=drop_binding)

    def replace_uses(self, old: str, new: str) -> int:
        return passes.replace_uses(self, old, new)

    # ------------------------------------------------------------------ import
    @classmethod
    def from_model(cls, model) -> "GraphBuilder":
        """Import a model (Model, olv or onnx ModelProto, or path) through the builder's own
        methods: struct types are registered before the graph, encoded initializers go through
        :meth:`make_encoded_initializer`, nodes through :meth:`add_node`.

        Raises
        ------
        OlvError
            Anything the builder rejects (the message names the value or node).
        """
        m = as_model(model)
        src = m.proto
        b = cls(src.graph.name, opsets=[(o.domain, o.version) for o in src.opset_import],
                ir_version=src.ir_version)
        b.source_path = m.path
        for fd, val in src.ListFields():
            if fd.name in ("graph", "struct_types", "opset_import", "functions"):
                continue
            _copy_field(b._model, fd, val)
        b.add_struct_types(src.struct_types)
        for fn in src.functions:
            b.add_function(fn)
        b._import_graph(src.graph)
        for pb in src.graph.persistent_bindings:
            b.add_binding(pb.input_name, pb.output_name)
        return b

    def _import_graph(self, g: GraphProto) -> None:
        for fd, val in g.ListFields():
            if fd.name in _GRAPH_LISTS:
                continue
            _copy_field(self.graph, fd, val)
        for vi in g.input:
            self.add_input(vi.name, vi)
        for t in g.initializer:
            self.make_initializer(t.name, t)
        for s in g.sparse_initializer:
            self._claim_init(s.values.name, "sparse")
            self.graph.sparse_initializer.append(s)
            self._describe_init(s.values.name, SymTensor(int(s.values.data_type),
                                                         tuple(int(d) for d in s.dims)))
        for ev in g.encoded_initializer:
            self.make_encoded_initializer(ev)
        for node in g.node:
            self.add_node(node)
        for vi in g.output:
            self.add_output(vi.name, vi)
        for vi in g.value_info:
            self.add_value_info(vi)

    # ------------------------------------------------------------------ export
    def _check_open(self) -> None:
        if self._released:
            raise BuilderError("this GraphBuilder was released by to_model(release=True)")

    def _root_only(self, what: str) -> None:
        if self.parent is not None:
            raise BuilderError(f"{what} belong to the model, not to a subgraph")

    def _graph_proto(self, release: bool = False) -> GraphProto:
        self._check_open()
        if release:
            g = self.graph
            self._released = True
        else:
            g = GraphProto()
            g.CopyFrom(self.graph)
        del g.node[:]
        g.node.extend(self._nodes)
        del g.persistent_bindings[:]
        for i, o in self._bindings:
            g.persistent_bindings.add(input_name=i, output_name=o)
        return g

    def validate_bindings(self) -> None:
        """Check the bindings against the current graph (names, duplicates, types).

        Raises
        ------
        BindingError
        """
        if not self._bindings:
            return
        probe = ModelProto()
        for st in self.ctx.struct_types:
            probe.struct_types.append(st)
        g = probe.graph
        g.input.extend(self.graph.input)
        g.output.extend(self.graph.output)
        for i, o in self._bindings:
            g.persistent_bindings.add(input_name=i, output_name=o)
        for name, kind in self._inits.items():  # names only: an initializer is not a free input
            if name in self.inputs:
                if kind == "encoded":
                    g.encoded_initializer.add(name=name)
                else:
                    g.initializer.add(name=name)
        resolve_bindings(Model(probe))

    def to_model(self, *, compact_types: bool = False, release: bool = False) -> ModelProto:
        """Write the model: ``ModelProto`` (olv_runtime's class).

        Parameters
        ----------
        compact_types : bool
            Drop catalogue entries no value, type or other used entry references (type_ids of
            the remaining entries are unchanged).
        release : bool
            Hand over the builder's storage instead of copying payloads (for large models); the
            builder cannot be used afterwards.

        Raises
        ------
        BindingError
            A binding no longer matches the graph (validated against the final graph).
        """
        self._root_only("to_model")
        self.validate_bindings()
        types = self.ctx.struct_types
        if compact_types:
            used = self.used_type_ids()
            types = [st for st in types if int(st.type_id) in used]
        if release:
            self._graph_proto(release=True)
            model = self._model
        else:
            model = ModelProto()
            for fd, val in self._model.ListFields():
                if fd.name != "graph":
                    _copy_field(model, fd, val)
            model.graph.CopyFrom(self._graph_proto())
        del model.opset_import[:]
        for d, v in self.ctx.opsets.items():
            model.opset_import.add(domain=d, version=v)
        del model.struct_types[:]
        model.struct_types.extend(types)
        del model.functions[:]
        model.functions.extend(self._functions)
        return model

    def to_graph(self, *, inline_types: bool = False) -> GraphProto:
        """A standalone ``GraphProto`` (no model catalogue).

        Parameters
        ----------
        inline_types : bool
            Replace every ``type_ref`` by an inline copy of its declaration (without type_id).

        Raises
        ------
        StandaloneGraphError
            A model-level type reference remains and ``inline_types`` is false.
        """
        g = self._graph_proto()
        cat = self.ctx.catalogue
        holders = [(f"encoded value {ev.name!r}", ev, "struct_type") for ev in g.encoded_initializer]
        for section in ("input", "output", "value_info"):
            holders += [(f"graph {section} {vi.name!r}", vi, "type") for vi in getattr(g, section)]
        for what, msg, field in holders:
            refs = struct_refs(getattr(msg, field))
            if not refs:
                continue
            if not inline_types:
                raise StandaloneGraphError(
                    f"{what} references model-level struct type(s) {sorted(refs)}; a standalone "
                    "graph has no model catalogue: export with inline_types=True"
                )
            inlined = inline_struct(getattr(msg, field), cat)
            getattr(msg, field).CopyFrom(inlined)
        return g

    def save(self, path, **kwargs) -> pathlib.Path:
        """Write :meth:`to_model` with :func:`olv_runtime.save`; external payloads of an
        imported model resolve against its original directory."""
        return save(Model(self.to_model(), self.source_path), path, **kwargs)

    def used_type_ids(self) -> set[int]:
        """type_ids referenced by encoded values, graph/function value types, and
        (transitively) by the declarations so referenced."""
        roots: set[int] = set()
        g = self.graph
        for ev in g.encoded_initializer:
            roots |= struct_refs(ev.struct_type) if ev.HasField("struct_type") else set()
            if ev.HasField("logical_type"):
                roots |= struct_refs(ev.logical_type)
        for section in (g.input, g.output, g.value_info):
            for vi in section:
                roots |= struct_refs(vi.type)
        for n in self._nodes:
            roots |= _node_type_refs(n)
        for fn in self._functions:
            for n in fn.node:
                roots |= _node_type_refs(n)
            for vi in fn.value_info:
                roots |= struct_refs(vi.type)
        decls = {int(st.type_id): st for st in self.ctx.struct_types}
        used: set[int] = set()
        todo = list(roots)
        while todo:
            tid = todo.pop()
            if tid in used or tid not in decls:
                continue
            used.add(tid)
            todo.extend(struct_refs(decls[tid], top=False))
        return used


# -------------------------------------------------------------------- helpers
def _copy_field(dst, fd, val) -> None:
    if fd.is_repeated:
        getattr(dst, fd.name).extend(val)
    elif fd.message_type is not None:
        getattr(dst, fd.name).CopyFrom(val)
    else:
        setattr(dst, fd.name, val)


def _node_type_refs(node: NodeProto) -> set[int]:
    out: set[int] = set()
    for _, g in subgraphs(node):
        for ev in g.encoded_initializer:
            out |= struct_refs(ev.struct_type)
        for section in (g.input, g.output, g.value_info):
            for vi in section:
                out |= struct_refs(vi.type)
        for n in g.node:
            out |= _node_type_refs(n)
    return out


def struct_refs(msg, top: bool = True) -> set[int]:
    """type_ids referenced (``type_ref``) anywhere inside a StructTypeProto or TypeProto."""
    out: set[int] = set()
    if isinstance(msg, StructTypeProto):
        kind = msg.WhichOneof("kind")
        if kind == "type_ref":
            out.add(int(msg.type_ref))
        elif kind == "structure":
            for f in msg.structure.field:
                if f.WhichOneof("content") == "type":
                    out |= struct_refs(f.type)
        elif kind == "array":
            out |= struct_refs(msg.array.element_type)
    elif isinstance(msg, TypeProto):
        kind = msg.WhichOneof("value")
        if kind == "struct_type":
            out |= struct_refs(msg.struct_type)
        elif kind == "sequence_type":
            out |= struct_refs(msg.sequence_type.elem_type)
        elif kind == "map_type":
            out |= struct_refs(msg.map_type.value_type)
        elif kind == "optional_type":
            out |= struct_refs(msg.optional_type.elem_type)
    return out


def inline_struct(msg, catalogue):
    """A copy of a StructTypeProto / TypeProto with every ``type_ref`` replaced by an inline
    declaration (the catalogue entry without its type_id), recursively."""
    out = type(msg)()
    out.CopyFrom(msg)
    _inline_in_place(out, catalogue)
    return out


def _inline_in_place(msg, catalogue) -> None:
    if isinstance(msg, StructTypeProto):
        if msg.WhichOneof("kind") == "type_ref":
            decl = catalogue.get(msg.type_ref)
            msg.CopyFrom(decl)
            msg.ClearField("type_id")
        kind = msg.WhichOneof("kind")
        if kind == "structure":
            for f in msg.structure.field:
                if f.WhichOneof("content") == "type":
                    _inline_in_place(f.type, catalogue)
        elif kind == "array":
            _inline_in_place(msg.array.element_type, catalogue)
    elif isinstance(msg, TypeProto):
        kind = msg.WhichOneof("value")
        if kind == "struct_type":
            _inline_in_place(msg.struct_type, catalogue)
        elif kind == "sequence_type":
            _inline_in_place(msg.sequence_type.elem_type, catalogue)
        elif kind == "map_type":
            _inline_in_place(msg.map_type.value_type, catalogue)
        elif kind == "optional_type":
            _inline_in_place(msg.optional_type.elem_type, catalogue)
