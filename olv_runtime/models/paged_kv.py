"""Paged KV graphs: rewrite a converted causal LM's contiguous KV cache into per-layer paged
cache structs (``olv convert --kv paged|paged-int8|paged-f16|paged-int4|paged-mixed``).

The contiguous graph of ``docs/qwen_graph.md`` has, per layer ``i``, inputs ``past_key.i`` /
``past_value.i``, an ``Attention`` node reading them and outputs ``present_key.i`` /
``present_value.i`` bound back by ``persistent_bindings``. :func:`to_paged` replaces them by

* one input ``cache.i`` of type ``PagedKVCache`` (``TypeProto.struct_type = {type_ref: 3001}``,
  declared with ``KVBlock`` 3002 in ``ModelProto.struct_types``) and one output
  ``present_cache.i`` of the same type, bound ``cache.i <- present_cache.i``;
* ``Y, present_cache.i = olv.PagedAttention(Q, K, V, cache.i)`` with the Attention's head
  counts, scale and causality plus the seal policy of the preset;
* the past length (``Shape(past_key.0, start=2, end=3)`` in the position subgraph) read from the
  cache: ``Unsqueeze(olv.StructGet(cache.0, fields=["length"]), [0])``.

Everything else (weights, RoPE, MLP) is unchanged. See ``docs/kv_cache.md``.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import ConversionError
from olv_runtime.kv import paged
from olv_runtime.proto import ModelProto, ValueInfoProto
from olv_runtime.proto.helper import make_node, make_tensor
from olv_runtime.structs.examples import codebook2_1101, scaled_codebook2_1102

__all__ = ["KV_KINDS", "to_paged"]

#: Values of ``--kv`` / ``kv=``.
KV_KINDS = ("contiguous",) + tuple(paged.PRESETS)


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return a
    return default


def _attention_layers(g) -> tuple:
    """The graph's Attention nodes with their past/present KV names, ``(node, past_key,
    past_value, present_key, present_value)`` each, and the KV geometry ``(kv heads, head_dim)``
    all of them share (ConversionError otherwise)."""
    inputs = {vi.name: vi for vi in g.input}
    attn = [n for n in g.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not attn:
        raise ConversionError("the graph has no Attention node to page")
    layers = []
    geom = None
    for node in attn:
        if len(node.input) < 6 or len(node.output) < 3 or not node.input[4]:
            raise ConversionError(f"Attention node {node.name!r} has no past_key/past_value")
        pk_name, pv_name = node.input[4], node.input[5]
        vi = inputs.get(pk_name)
        if vi is None:
            raise ConversionError(f"Attention node {node.name!r}: {pk_name!r} is not a graph input")
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        kvh, d = int(dims[1]), int(dims[3])
        if geom is not None and geom != (kvh, d):
            raise ConversionError("layers with different KV geometries are not supported")
        geom = (kvh, d)
        layers.append((node, pk_name, pv_name, node.output[1], node.output[2]))
    return layers, geom


def _declare_types(model: ModelProto, spec: str, kvh: int, block_size: int, d: int) -> None:
    """Declare the KV block and cache struct types (and the codebook types a codebook2 policy
    needs) and the ``olv`` opset."""
    have = {st.type_id for st in model.struct_types}
    for tid in (paged.KV_CACHE_TYPE_ID, paged.KV_BLOCK_TYPE_ID):
        if tid in have:
            raise ConversionError(f"struct type_id {tid} is already declared")
    model.struct_types.append(paged.kv_block_type(kvh, block_size, d))
    model.struct_types.append(paged.kv_cache_type())
    if "codebook2" in spec:
        for st in (codebook2_1101(), scaled_codebook2_1102()):
            if st.type_id not in have:
                model.struct_types.append(st)
    if not any(o.domain == "olv" for o in model.opset_import):
        model.opset_import.add(domain="olv", version=1)


def _rewire_io(g, n_layers: int, removed_in: set, removed_out: set) -> None:
    """Replace the past/present KV inputs and outputs by one cache struct per layer and bind
    ``cache.i`` to ``present_cache.i``."""
    def cache_vi(name: str) -> ValueInfoProto:
        vi = ValueInfoProto(name=name)
        vi.type.struct_type.type_ref = paged.KV_CACHE_TYPE_ID
        return vi

    keep_in = [vi for vi in g.input if vi.name not in removed_in]
    keep_out = [vi for vi in g.output if vi.name not in removed_out]
    del g.input[:]
    g.input.extend(keep_in + [cache_vi(f"cache.{i}") for i in range(n_layers)])
    del g.output[:]
    g.output.extend(keep_out + [cache_vi(f"present_cache.{i}") for i in range(n_layers)])
    keep_vi = [vi for vi in g.value_info if vi.name not in removed_in | removed_out]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    del g.persistent_bindings[:]
    for i in range(n_layers):
        g.persistent_bindings.add(input_name=f"cache.{i}", output_name=f"present_cache.{i}")


def to_paged(model: ModelProto, kv: str, *, block_size: int = paged.DEFAULT_BLOCK_SIZE,
             policy: str | None = None, open_format: str = "float32",
             scales: str = "token") -> ModelProto:
    """Rewrite ``model`` (in place) to use paged KV caches; returns it.

    Parameters
    ----------
    model : ModelProto
        A converted model (contiguous KV, ``docs/qwen_graph.md``).
    kv : str
        One of :data:`KV_KINDS` other than ``contiguous`` (selects the seal policy).
    block_size : int
        Tokens per block.
    policy : str, optional
        Overrides the preset's seal policy (``SealPolicy`` syntax, applied to K and V).
    open_format, scales : str
        See :class:`olv_runtime.kv.paged.SealPolicy`.

    Raises
    ------
    ConversionError
        Unknown ``kv``; a graph that does not follow the contiguous contract.
    """
    if kv not in paged.PRESETS:
        raise ConversionError(f"unknown kv kind {kv!r}; supported: {', '.join(KV_KINDS)}")
    spec = policy or paged.PRESETS[kv]
    paged.SealPolicy(spec, spec, open_format, scales)  # validates the spec
    g = model.graph
    layers, (kvh, d) = _attention_layers(g)
    if "codebook2" in spec and d % 32:
        raise ConversionError(f"codebook2 KV blocks need head_dim % 32 == 0, got {d}")
    if "int4" in spec and d % 2:
        raise ConversionError(f"int4 KV blocks need an even head_dim, got {d}")

    _declare_types(model, spec, kvh, block_size, d)

    removed_in, removed_out = set(), set()
    renames = {}  # past_key name -> cache name
    new_nodes = []
    for i, (node, pkn, pvn, prk, prv) in enumerate(layers):
        cache, present = f"cache.{i}", f"present_cache.{i}"
        removed_in |= {pkn, pvn}
        removed_out |= {prk, prv}
        renames[pkn] = cache
        renames[pvn] = cache
        h = _attr(node, "q_num_heads")
        kvh_attr = _attr(node, "kv_num_heads")
        scale = _attr(node, "scale")
        causal = _attr(node, "is_causal")
        if h is None or kvh_attr is None:
            raise ConversionError(f"Attention node {node.name!r}: 3-D inputs with q_num_heads/"
                                  "kv_num_heads are required")
        attrs = dict(q_num_heads=h.i, kv_num_heads=kvh_attr.i,
                     is_causal=causal.i if causal is not None else 0, block_size=block_size,
                     key_policy=spec, value_policy=spec, open_format=open_format, scales=scales)
        if scale is not None:
            attrs["scale"] = scale.f
        new_nodes.append((node, make_node(
            "PagedAttention", [node.input[0], node.input[1], node.input[2], cache],
            [node.output[0], present], name=(node.name or f"attention.{i}") + "/paged",
            domain="olv", **attrs)))
    replace = {id(old): new for old, new in new_nodes}

    # the past-length readers (Shape(past_key.*, start=2, end=3))
    axes = "const.paged_axes_0"
    out_nodes = []
    for node in g.node:
        if id(node) in replace:
            out_nodes.append(replace[id(node)])
            continue
        used = [n for n in node.input if n in removed_in]
        if not used:
            out_nodes.append(node)
            continue
        start, end = _attr(node, "start"), _attr(node, "end")
        if node.op_type != "Shape" or len(node.input) != 1 or start is None or start.i != 2 \
                or end is None or end.i != 3:
            raise ConversionError(f"node {node.name!r} ({node.op_type}) reads {used[0]!r}; the "
                                  "paged rewrite knows only Attention and Shape(start=2, end=3)")
        scalar = node.output[0] + "/length"
        out_nodes.append(make_node("StructGet", [renames[node.input[0]]], [scalar],
                                   name=node.name + "/StructGet", domain="olv", fields=["length"]))
        out_nodes.append(make_node("Unsqueeze", [scalar, axes], [node.output[0]],
                                   name=node.name + "/Unsqueeze"))
    del g.node[:]
    g.node.extend(out_nodes)
    if not any(t.name == axes for t in g.initializer):
        g.initializer.append(make_tensor(axes, np.asarray([0], np.int64)))

    _rewire_io(g, len(layers), removed_in, removed_out)
    for key, value in (("olv.kv", kv), ("olv.kv_block_size", block_size), ("olv.kv_policy", spec)):
        entry = model.metadata_props.add()
        entry.key = key
        entry.value = str(value)
    return model
