"""Control flow and model-local functions: ``If`` (ONNX If-11..21) and calls of the
``FunctionProto`` entries of ``ModelProto.functions``.

Both run a small body (a branch graph or a function body) with the operator registry of the
session. Values cross the body boundary as the very objects that enter it: an ``If`` whose
branch is ``Identity`` and a function that passes its input through return the caller's buffer
itself, never a copy (seed 000 "Zero-copy ownership": "Functions, If and structured field
transport must preserve these owners rather than call deep-copy or serialization-based
detachment helpers").

The session resolves a node with :func:`resolve`: a model-local function named
``(domain, op_type)`` first, then the registry. An ``If`` exposes ``step_inputs`` — its condition
followed by the outer-scope values its branches read — so the session plans and keeps those
values alive like explicit inputs.

Persistent bindings declared inside a branch are rejected with
:class:`~olv_runtime.errors.BindingError` (seed 000: "persistent bindings in control-flow
subgraphs are rejected explicitly until scoped state is supported").
"""
from __future__ import annotations

import contextvars
import weakref
from typing import Any, Sequence

import numpy as np

from olv_runtime.errors import BindingError, UnsupportedOperatorError, ValidationError
from olv_runtime.ops.registry import Op, canonical_domain, lookup, register
from olv_runtime.proto import NodeProto, TensorProto
from olv_runtime.structs.initializers import tensor_from_proto

#: > 0 while the ops of a body (branch, function) are being built.
_in_body: contextvars.ContextVar[int] = contextvars.ContextVar("olv_in_body", default=0)
#: functions being instantiated on this thread (recursion guard).
_active_functions: contextvars.ContextVar[tuple] = contextvars.ContextVar("olv_fn", default=())

_local_tables: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def local_functions(session) -> dict:
    """``{(domain, name): FunctionProto}`` of the session's model (built once per session).

    Raises
    ------
    ValidationError
        Two functions with the same (domain, name, overload).
    """
    table = _local_tables.get(session)
    if table is None:
        table = {}
        for fn in session.model.proto.functions:
            key = (canonical_domain(fn.domain), fn.name)
            if getattr(fn, "overload", ""):
                raise UnsupportedOperatorError(
                    f"model-local function {fn.domain}::{fn.name} has overload "
                    f"{fn.overload!r}; overloaded functions are not supported"
                )
            if key in table:
                raise ValidationError(
                    f"model-local function {fn.domain or 'ai.onnx'}::{fn.name} is declared twice"
                )
            table[key] = fn
        _local_tables[session] = table
    return table


def resolve(session, domain: str, op_type: str, opsets: dict | None = None):
    """The implementation factory ``(node, session) -> op`` for a node.

    A model-local function ``(domain, op_type)`` wins over a registered operator (ONNX: model
    functions extend the operator set of their domain).

    Raises
    ------
    UnsupportedOperatorError
        Neither a local function nor a registered operator (see
        :func:`~olv_runtime.ops.registry.lookup`).
    """
    domain = canonical_domain(domain)
    fn = local_functions(session).get((domain, op_type))
    if fn is not None:
        return lambda node, info: FunctionCall(node, info, fn)
    opsets = session.opsets if opsets is None else opsets
    if domain not in opsets:
        raise UnsupportedOperatorError(
            f"operator {domain or 'ai.onnx'}::{op_type}: the domain is not imported (opset_import)"
        )
    return lookup(domain, op_type, opsets[domain])


class Body:
    """A list of nodes run in order (ONNX bodies are topologically sorted).

    Parameters
    ----------
    name : str
        For error messages.
    nodes : sequence of NodeProto
    inputs : sequence of str
        Formal input names (function inputs; none for an ``If`` branch).
    outputs : sequence of str
        Names returned by :meth:`run`, in order.
    session : InferenceSession
        Supplies options, counters, the model (local functions) and the registry opsets.
    opsets : dict
        Domain → version for resolving the body's nodes.
    initializers : sequence of TensorProto
        Dense constants of a branch graph.
    outer_scope : bool
        Names not defined in the body are read from the enclosing scope (``If`` branches) and
        listed in :attr:`implicit`; without an outer scope (functions) they are errors.
    """

    def __init__(self, name: str, nodes: Sequence[NodeProto], inputs: Sequence[str],
                 outputs: Sequence[str], session, opsets: dict, initializers=(),
                 outer_scope: bool = False):
        self.name = name
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.consts: dict[str, Any] = {}
        for t in initializers:
            external = t.data_location == TensorProto.EXTERNAL
            payload = session.model.payload(t) if external else None
            self.consts[t.name] = tensor_from_proto(t, payload)
        available = set(self.inputs) | set(self.consts) | {""}
        implicit: list[str] = []

        def need(n: str, where: str) -> None:
            if n in available:
                return
            if not outer_scope:
                raise ValidationError(f"{self.name}: {where} reads {n!r}, which is not defined in it")
            implicit.append(n)
            available.add(n)

        self.steps: list[tuple[Any, tuple, tuple]] = []
        token = _in_body.set(_in_body.get() + 1)
        try:
            for node in nodes:
                impl = resolve(session, node.domain, node.op_type, opsets)(node, session)
                ins = tuple(getattr(impl, "step_inputs", node.input))
                for n in ins:
                    need(n, f"node {impl.name!r}")
                self.steps.append((impl.run, ins, tuple(node.output)))
                available.update(o for o in node.output if o)
        finally:
            _in_body.reset(token)
        for o in self.outputs:
            need(o, "output")
        self.implicit = tuple(implicit)

    def run(self, values: dict[str, Any]) -> tuple:
        """Run with ``values`` (formal inputs and implicit outer values); the outputs in order."""
        env = dict(self.consts)
        env.update(values)
        for fn, ins, outs in self.steps:
            results = fn(*[env[n] if n else None for n in ins])
            for n, v in zip(outs, results):
                if n:
                    env[n] = v
        return tuple(env[o] for o in self.outputs)


def _reject_bindings(owner: str, graph) -> None:
    if len(graph.persistent_bindings):
        b = graph.persistent_bindings[0]
        raise BindingError(
            f"{owner}: persistent binding {b.input_name!r} <- {b.output_name!r} is declared "
            "inside a control-flow subgraph; persistent bindings are supported on the model's "
            "root graph only (seed 000 \"Graph-level persistence declaration\")"
        )


@register("If", 1)
class If(Op):
    """ONNX If: run ``then_branch`` or ``else_branch`` on a one-element boolean condition.

    The branch outputs are returned as produced (a branch that forwards an outer value returns
    that very array).
    """

    attributes = {"then_branch": Op.REQUIRED, "else_branch": Op.REQUIRED}

    def setup(self, session) -> None:
        self.branches = []
        for key in ("then_branch", "else_branch"):
            g = self.attrs[key]
            _reject_bindings(f"node {self.name!r} (If) attribute {key!r}", g)
            body = Body(f"node {self.name!r} (If) {key}", g.node, (), [o.name for o in g.output],
                        session, session.opsets, g.initializer, outer_scope=True)
            if len(body.outputs) != len(self.node.output):
                raise ValidationError(
                    f"node {self.name!r} (If): {key} has {len(body.outputs)} outputs, the node "
                    f"has {len(self.node.output)}"
                )
            self.branches.append(body)
        implicit: list[str] = []
        for body in self.branches:
            implicit.extend(n for n in body.implicit if n not in implicit)
        if _in_body.get() == 0:  # a root-graph node: outer names are the root graph's values
            known = _root_names(session)
            for n in implicit:
                if n not in known:
                    raise ValidationError(
                        f"node {self.name!r} (If): a branch reads {n!r}, which is not a graph "
                        "input, initializer or node output"
                    )
        self.implicit = tuple(implicit)
        self.step_inputs = (self.node.input[0],) + self.implicit

    def run(self, cond, *outer):
        c = np.asarray(cond)
        if c.size != 1:
            raise self.fail(f"condition must have one element, got shape {list(c.shape)}")
        body = self.branches[0] if bool(c.reshape(())) else self.branches[1]
        return body.run(dict(zip(self.implicit, outer)))


def _root_names(session) -> set[str]:
    g = session.model.proto.graph
    names = set(session.constant_names) | set(session.input_infos)
    for node in g.node:
        names.update(o for o in node.output if o)
    return names


class FunctionCall:
    """A call of a model-local ``FunctionProto``: the body runs with the node's inputs bound to
    the function's formal inputs by position; attribute references (``ref_attr_name``) take the
    node's attribute or the function's default (``attribute_proto``).

    Raises
    ------
    ValidationError
        More actual inputs/outputs than formal ones, a recursive function, a body reading an
        undefined name.
    """

    def __init__(self, node: NodeProto, session, function):
        self.node = node
        self.function = function
        fname = f"{function.domain or 'ai.onnx'}::{function.name}"
        self.name = node.name or f"{fname}({', '.join(node.output)})"
        if len(node.input) > len(function.input) or len(node.output) > len(function.output):
            raise ValidationError(
                f"node {self.name!r}: function {fname} takes {len(function.input)} inputs and "
                f"{len(function.output)} outputs, the node has {len(node.input)} and "
                f"{len(node.output)}"
            )
        key = (function.domain, function.name)
        active = _active_functions.get()
        if key in active:
            raise ValidationError(f"node {self.name!r}: function {fname} calls itself (recursion)")
        opsets = dict(session.opsets)
        for o in function.opset_import:
            opsets[canonical_domain(o.domain)] = int(o.version)
        token = _active_functions.set(active + (key,))
        try:
            self.body = Body(f"function {fname} (node {self.name!r})",
                             _bind_attributes(node, function), function.input, function.output,
                             session, opsets)
        finally:
            _active_functions.reset(token)
        self._formals = tuple(function.input)
        self._n_out = len(node.output)

    def run(self, *args):
        values = {f: a for f, a in zip(self._formals, args)}
        for f in self._formals[len(args):]:
            values[f] = None  # omitted optional inputs
        return self.body.run(values)[: self._n_out]


def _bind_attributes(node: NodeProto, function) -> list[NodeProto]:
    """Body nodes with ``ref_attr_name`` attributes replaced by the caller's values."""
    given = {a.name: a for a in node.attribute}
    defaults = {a.name: a for a in function.attribute_proto}
    out = []
    for body_node in function.node:
        if not any(a.ref_attr_name for a in body_node.attribute):
            out.append(body_node)
            continue
        n = NodeProto()
        n.CopyFrom(body_node)  # node metadata only (small), never the model
        del n.attribute[:]
        for a in body_node.attribute:
            if not a.ref_attr_name:
                n.attribute.append(a)
                continue
            src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
            if src is None:
                continue  # ONNX: an unset referenced attribute is omitted
            b = n.attribute.add()
            b.CopyFrom(src)
            b.name = a.name
        out.append(n)
    return out
