"""Rewrites over a :class:`~olv_runtime.builder.GraphBuilder` (the argument ``b`` of every pass:
graph.py calls them, so this module does not import it) that keep every declaration
consistent (seed 000 "GraphBuilder, shape inference and serialization", seed 002 "Serialization
and passes").

* :func:`remove_dead_nodes` - nodes whose outputs nothing reads (graph outputs, other nodes, and
  subgraphs count as readers), then unread dense / sparse / encoded initializers.
* :func:`dedup_initializers` - merge initializers that are truly the same value: dense ones with
  equal element type, dims and bytes; encoded ones with equal resolved layout (affine descriptor
  incl. scale/zero_point, or type_id / inline declaration), byte extent, record count, logical
  type and payload bytes. Equal bytes alone are not enough.
* :func:`rename_value` - renames a value everywhere, including graph inputs/outputs and the
  persistent bindings that select them.
* :func:`remove_node`, :func:`remove_output`, :func:`remove_input` - refuse to drop a value a
  persistent binding selects unless the binding is dropped explicitly and consistently.
"""
from __future__ import annotations

import hashlib

from olv_runtime.builder.context import SymEncodedValue
from olv_runtime.builder.errors import (
    BoundValueError,
    BuilderError,
    DuplicateValueError,
)
from olv_runtime.builder.inference import (
    graph_outer_reads,
    node_label,
    node_reads,
    subgraphs,
)
from olv_runtime.io import Model
from olv_runtime.proto import GraphProto, ModelProto, TensorProto

__all__ = ["remove_dead_nodes", "dedup_initializers", "rename_value", "replace_uses",
           "remove_node", "remove_output", "remove_input"]


def remove_dead_nodes(b, *, initializers: bool = True) -> int:
    """Remove nodes no graph output depends on; then (``initializers``) unread initializers that
    are not graph inputs. Returns the number of nodes removed."""
    live = set(b.outputs)
    keep = []
    for node in reversed(b._nodes):
        if any(o and o in live for o in node.output):
            keep.append(node)
            live |= node_reads(node)
    removed = [n for n in b._nodes if not any(n is k for k in keep)]
    keep.reverse()
    b._nodes = keep
    for n in removed:
        for o in n.output:
            if o:
                b._producer.pop(o, None)
                b.ctx.remove(o)
        b._node_names.discard(n.name)
    if initializers:
        dead = [name for name in b._inits if name not in live and name not in b.inputs]
        _drop_initializers(b, dead)
    return len(removed)


def _drop_initializers(b, names) -> None:
    names = set(names)
    if not names:
        return
    for field, key in (("initializer", lambda t: t.name), ("encoded_initializer", lambda t: t.name),
                       ("sparse_initializer", lambda s: s.values.name)):
        seq = getattr(b.graph, field)
        for i in reversed([i for i, t in enumerate(seq) if key(t) in names]):
            del seq[i]
    for name in names:
        b._inits.pop(name, None)
        if name not in b.inputs:
            b.ctx.remove(name)


def _payload(b, msg) -> bytes | tuple:
    """The payload bytes, read through the source model for external data; without a source,
    the external location triple itself (then only identical references merge)."""
    if msg.data_location == TensorProto.EXTERNAL:
        if b.source_path is None:
            return tuple((e.key, e.value) for e in msg.external_data)
        model = getattr(b, "_payload_model", None)
        if model is None:
            model = b._payload_model = Model(ModelProto(), b.source_path)
        return bytes(model.payload(msg))
    return msg.raw_data


def dedup_initializers(b) -> dict[str, str]:
    """Merge duplicate initializers (see the module docstring); returns ``{removed: kept}``.

    Initializers that are graph inputs (overridable by feeds) or graph outputs are never merged.
    Uses of a removed name (nodes and subgraphs) are redirected to the kept one.
    """
    protected = set(b.inputs) | set(b.outputs)
    groups: dict[tuple, list[str]] = {}
    payloads: dict[str, object] = {}
    for t in b.graph.initializer:
        if t.name in protected:
            continue
        meta = TensorProto()
        meta.CopyFrom(t)
        meta.name = ""
        for f in ("raw_data", "external_data", "data_location"):
            meta.ClearField(f)
        data = _payload(b, t) if (t.HasField("raw_data") or
                                  t.data_location == TensorProto.EXTERNAL) else b""
        payloads[t.name] = data
        digest = hashlib.blake2b(data if isinstance(data, bytes) else repr(data).encode(),
                                 digest_size=16).digest()
        key = ("dense", meta.SerializeToString(deterministic=True), digest)
        groups.setdefault(key, []).append(t.name)
    for ev in b.graph.encoded_initializer:
        if ev.name in protected:
            continue
        sym = b.ctx.local(ev.name)
        assert isinstance(sym, SymEncodedValue)
        data = _payload(b, ev)
        payloads[ev.name] = data
        digest = hashlib.blake2b(data if isinstance(data, bytes) else repr(data).encode(),
                                 digest_size=16).digest()
        key = ("encoded", sym.profile(), ev.doc_string, digest)
        groups.setdefault(key, []).append(ev.name)
    merged: dict[str, str] = {}
    for names in groups.values():
        kept = [names[0]]
        for name in names[1:]:
            target = next((k for k in kept if payloads[k] == payloads[name]), None)
            if target is None:  # hash collision: keep both
                kept.append(name)
                continue
            merged[name] = target
    for old, new in merged.items():
        replace_uses(b, old, new)
    _drop_initializers(b, merged)
    return merged


def replace_uses(b, old: str, new: str) -> int:
    """Redirect every read of ``old`` (node inputs, subgraph outer reads) to ``new``; returns
    the number of nodes changed. Graph outputs are not changed (use :func:`rename_value`)."""
    count = 0
    for node in b._nodes:
        if _rename_reads(node, old, new):
            count += 1
    return count


def _rename_reads(node, old: str, new: str) -> bool:
    changed = False
    for i, name in enumerate(node.input):
        if name == old:
            node.input[i] = new
            changed = True
    for _, g in subgraphs(node):
        if old in graph_outer_reads(g):
            _rename_in_subgraph(g, old, new)
            changed = True
    return changed


def _rename_in_subgraph(g: GraphProto, old: str, new: str) -> None:
    for n in g.node:
        _rename_reads(n, old, new)
    for vi in g.output:
        if vi.name == old:
            vi.name = new


def rename_value(b, old: str, new: str) -> None:
    """Rename a value (input, initializer or node output) everywhere: producers, readers,
    graph inputs/outputs, value_info, and the persistent bindings selecting it.

    Raises
    ------
    UnavailableValueError
        ``old`` is not defined.
    DuplicateValueError
        ``new`` is already in use.
    """
    b.ctx.require(old, f"rename {old!r} -> {new!r}")
    if b.ctx.lookup(new) is not None or new in b._inits:
        raise DuplicateValueError(f"cannot rename {old!r} to {new!r}: {new!r} is already defined")
    node = b._producer.pop(old, None)
    if node is not None:
        for i, o in enumerate(node.output):
            if o == old:
                node.output[i] = new
        b._producer[new] = node
    kind = b._inits.pop(old, None)
    if kind is not None:
        b._inits[new] = kind
        for t in b.graph.initializer:
            if t.name == old:
                t.name = new
        for ev in b.graph.encoded_initializer:
            if ev.name == old:
                ev.name = new
        for s in b.graph.sparse_initializer:
            if s.values.name == old:
                s.values.name = new
    for section in (b.graph.input, b.graph.output, b.graph.value_info):
        for vi in section:
            if vi.name == old:
                vi.name = new
    replace_uses(b, old, new)
    b._bindings = [(new if i == old else i, new if o == old else o) for i, o in b._bindings]
    b.ctx.rename(old, new)


def remove_node(b, name: str):
    """Remove the node named ``name``; returns it.

    Raises
    ------
    BoundValueError
        The node produces a graph output selected by a persistent binding.
    BuilderError
        The node produces a graph output, or values other nodes still read.
    KeyError
        No such node.
    """
    node = b.node(name)
    outs = [o for o in node.output if o]
    for o in outs:
        bound = b.binding_of(o)
        if bound is not None and bound[1] == o:
            raise BoundValueError(
                f"cannot remove {node_label(node)}: it produces {o!r}, the graph output selected "
                f"by persistent binding {bound[0]!r} <- {bound[1]!r}; rewire the output or remove "
                "the binding explicitly first"
            )
        if o in b.outputs:
            raise BuilderError(f"cannot remove {node_label(node)}: it produces graph output {o!r}")
        readers = [n for n in b._nodes if n is not node and o in node_reads(n)]
        if readers:
            raise BuilderError(
                f"cannot remove {node_label(node)}: {o!r} is read by "
                f"{', '.join(node_label(r) for r in readers[:3])}"
            )
    b._nodes = [n for n in b._nodes if n is not node]
    for o in outs:
        b._producer.pop(o, None)
        b.ctx.remove(o)
    b._node_names.discard(node.name)
    return node


def remove_output(b, name: str, *, drop_binding: bool = False) -> None:
    """Remove graph output ``name``. A bound output needs ``drop_binding=True``, which removes
    its binding in the same step (never silently)."""
    _remove_io(b, "output", name, drop_binding)


def remove_input(b, name: str, *, drop_binding: bool = False) -> None:
    """Remove graph input ``name`` (no node may still read it). A bound input needs
    ``drop_binding=True``."""
    bound = b.binding_of(name)
    if not (bound is not None and bound[0] == name and not drop_binding) and \
            any(name in node_reads(n) for n in b._nodes) and name not in b._inits:
        raise BuilderError(f"cannot remove graph input {name!r}: nodes still read it")
    _remove_io(b, "input", name, drop_binding)
    if name not in b._inits:
        b.ctx.remove(name)


def _remove_io(b, section: str, name: str, drop_binding: bool) -> None:
    seq = getattr(b.graph, section)
    idx = [i for i, vi in enumerate(seq) if vi.name == name]
    if not idx:
        raise BuilderError(f"{name!r} is not a graph {section}")
    bound = b.binding_of(name)
    if bound is not None and bound[0 if section == "input" else 1] == name:
        if not drop_binding:
            raise BoundValueError(
                f"cannot remove graph {section} {name!r}: persistent binding {bound[0]!r} <- "
                f"{bound[1]!r} selects it (pass drop_binding=True to remove both)"
            )
        b._bindings.remove(bound)
    del seq[idx[0]]
