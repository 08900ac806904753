"""onnxruntime-genai model folders (``model.onnx``, ``model.onnx.data``, ``genai_config.json``).

``python -m onnxruntime_genai.models.builder -i CKPT -o DIR -p int4 -e cpu`` writes a decoder whose
KV cache is fed back by the caller: ``past_key_values.%d.key`` / ``present.%d.key`` (names from
``genai_config.json``: ``model.decoder.inputs.past_key_names`` and
``model.decoder.outputs.present_key_names``), plus an ``attention_mask`` input ``[B, total]``.
When :func:`olv_runtime.load` opens such a ``model.onnx`` it applies :func:`adapt` to the parsed
message in memory (the file and its external data are not touched; payloads stay memory-mapped,
0 payload bytes copied):

* one ``persistent_binding`` per layer and side, past input <- present output, so
  ``make_state``, ``generate``, ``olv generate`` and ``olv bench`` carry the cache;
* the symbolic KV dimensions (``kv_cache_dim``, the head count) get their values from the config
  so :func:`~olv_runtime.empty_cache` can build the empty cache;
* ``attention_mask`` (and ``position_ids`` when the graph has it) stop being graph inputs: they
  are computed in the graph from the cache length and ``input_ids`` — all ones
  ``[B, past + S]`` and ``past .. past + S - 1`` — which is what onnxruntime-genai feeds for
  unpadded sequences. Padded batches are therefore not expressible (GroupQueryAttention rejects
  unequal row lengths anyway).

Source: onnxruntime-genai ``genai_config.json`` as written by its model builder (0.18).
"""
from __future__ import annotations

import json
import pathlib

from olv_runtime.errors import ModelFormatError
from olv_runtime.proto import NodeProto, TensorProto

GENAI_CONFIG = "genai_config.json"
#: metadata key recording that the model was adapted (value: the config path)
ADAPTED_KEY = "olv.genai_config"
#: Largest genai_config.json read (the builder writes a few KB), bytes.
CONFIG_MAX_BYTES = 16 << 20
#: Longest KV name pattern (``past_key_values.%d.key``) accepted, characters.
NAME_MAX_CHARS = 1024


def genai_config_for(path: pathlib.Path) -> dict | None:
    """The parsed ``genai_config.json`` beside ``path`` when its decoder file is ``path``.

    Raises
    ------
    ModelFormatError
        A config over :data:`CONFIG_MAX_BYTES`, not JSON (nesting too deep included), or whose
        ``model`` / ``model.decoder`` is not an object.
    """
    cfg_path = path.parent / GENAI_CONFIG
    if not cfg_path.is_file():
        return None
    size = cfg_path.stat().st_size
    if size > CONFIG_MAX_BYTES:
        raise ModelFormatError(f"{cfg_path}: {size} bytes; an onnxruntime-genai config of at "
                               f"most {CONFIG_MAX_BYTES} bytes is read")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ModelFormatError(f"{cfg_path}: not an onnxruntime-genai config (not JSON: "
                               f"{type(exc).__name__}: {str(exc)[:200]})") from None
    model = cfg.get("model") if isinstance(cfg, dict) else None
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise ModelFormatError(
            f"{cfg_path}: not an onnxruntime-genai config (expected an object with an object "
            f"'model' holding an object 'decoder', got "
            f"{type(cfg).__name__} / {type(model).__name__} / {type(decoder).__name__})")
    if decoder.get("filename", "model.onnx") != path.name:
        return None
    return cfg


def _count(dec: dict, key: str, where: str, lo: int, hi: int, default=None) -> int:
    """Integer ``decoder.key`` in [lo, hi] (ModelFormatError naming it otherwise)."""
    v = dec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFormatError(f"{where}: decoder.{key} must be an integer in [{lo}, {hi}], got "
                               f"{type(v).__name__} {str(v)[:40]}")
    return v


def _pattern(table, key: str, where: str, side: str) -> str:
    """A KV name pattern such as ``past_key_values.%d.key``: a string of at most
    :data:`NAME_MAX_CHARS` characters with exactly one ``%d`` and no other conversion."""
    v = table.get(key) if isinstance(table, dict) else None
    if not isinstance(v, str) or len(v) > NAME_MAX_CHARS or v.replace("%%", "").count("%") != 1 \
            or "%d" not in v.replace("%%", ""):
        raise ModelFormatError(
            f"{where}: decoder.{side}.{key} must be a name pattern of at most {NAME_MAX_CHARS} "
            f"characters with one %d, got {type(v).__name__} {str(v)[:60]!r}"
            + (f" ({len(v)} characters)" if isinstance(v, str) else ""))
    return v


def adapt(model, cfg: dict | None = None) -> bool:
    """Apply a genai config's KV feedback and mask handling to ``model`` in memory.

    Parameters
    ----------
    model : olv_runtime.io.Model
        Loaded from a genai folder (``model.path`` set).
    cfg : dict, optional
        The parsed config (read from beside the model file when omitted).

    Returns
    -------
    bool
        True when the model was adapted; False when there is no config for it or the graph
        already declares persistent bindings.

    Raises
    ------
    ModelFormatError
        The config names inputs/outputs the graph does not have, or a KV input with an
        unexpected rank.
    """
    if model.path is None:
        return False
    cfg = cfg if cfg is not None else genai_config_for(model.path)
    g = model.proto.graph
    if cfg is None or len(g.persistent_bindings):
        return False
    dec = cfg["model"]["decoder"]
    where = f"{model.path.parent / GENAI_CONFIG}"
    # every layer needs a past key and value input: the graph bounds the layer count
    layers = _count(dec, "num_hidden_layers", where, 1, max(len(g.input) // 2, 1))
    head = _count(dec, "head_size", where, 1, 1 << 16)
    kvh = _count(dec, "num_key_value_heads", where, 1, 1 << 16,
                 dec.get("num_attention_heads"))
    ins, outs = dec.get("inputs"), dec.get("outputs")
    if not isinstance(ins, dict) or not isinstance(outs, dict):
        raise ModelFormatError(f"{where}: decoder.inputs and decoder.outputs must be objects, "
                               f"got {type(ins).__name__} / {type(outs).__name__}")
    pairs = []
    for side in ("key", "value"):
        past = _pattern(ins, f"past_{side}_names", where, "inputs")
        present = _pattern(outs, f"present_{side}_names", where, "outputs")
        for i in range(layers):
            pairs.append((past % i, present % i))
    inputs = {vi.name: vi for vi in g.input}
    outputs = {vi.name for vi in g.output}
    for past, present in pairs:
        if past not in inputs or present not in outputs:
            raise ModelFormatError(
                f"{where}: KV names {past!r} / {present!r} are not a graph input / output of "
                f"{model.path.name}")
        dims = inputs[past].type.tensor_type.shape.dim
        if len(dims) != 4:
            raise ModelFormatError(f"{model.path.name}: KV input {past!r} must be 4-D, got {len(dims)}")
        for axis, value in ((1, kvh), (3, head)):
            if dims[axis].dim_param or not dims[axis].dim_value:
                dims[axis].Clear()
                dims[axis].dim_value = value
    for past, present in pairs:
        b = g.persistent_bindings.add()
        b.input_name = past
        b.output_name = present
    ids_name = ins.get("input_ids", "input_ids")
    mask_name = ins.get("attention_mask")
    pos_name = ins.get("position_ids")
    for key, v in (("input_ids", ids_name), ("attention_mask", mask_name),
                   ("position_ids", pos_name)):
        if v is not None and (not isinstance(v, str) or len(v) > NAME_MAX_CHARS):
            raise ModelFormatError(f"{where}: decoder.inputs.{key} must be a name of at most "
                                   f"{NAME_MAX_CHARS} characters, got {type(v).__name__} "
                                   f"{str(v)[:60]!r}")
    first_past = pairs[0][0]
    synth = [n for n in (mask_name, pos_name) if n and n in inputs]
    if synth:
        if ids_name not in inputs:
            raise ModelFormatError(f"{model.path.name}: no {ids_name!r} input to derive "
                                   f"{synth} from")
        _synthesize(model.proto, first_past, ids_name, mask_name if mask_name in inputs else None,
                    pos_name if pos_name in inputs else None, inputs)
    meta = model.proto.metadata_props.add()
    meta.key = ADAPTED_KEY
    meta.value = where
    eos = cfg["model"].get("eos_token_id")
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < 1 << 31 \
            and "olv.eos_token_id" not in {p.key for p in model.proto.metadata_props}:
        m = model.proto.metadata_props.add()
        m.key = "olv.eos_token_id"
        m.value = str(eos)
    return True


def _synthesize(proto, past_name: str, ids_name: str, mask_name, pos_name, inputs) -> None:
    """Nodes computing attention_mask = ones([B, past + S]) and position_ids = past + arange(S)."""
    g = proto.graph
    opset = max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:
        raise ModelFormatError(f"genai adaptation needs default-domain opset >= 13, got {opset}")
    p = "olv.genai/"

    def const(name, values):
        t = g.initializer.add()
        t.name = p + name
        t.data_type = TensorProto.INT64
        t.dims.append(len(values))
        t.int64_data.extend(values)
        return t.name

    def node(op, ins, out, **attrs):
        n = NodeProto(op_type=op, name=p + out)
        n.input.extend(ins)
        n.output.append(p + out if not out.startswith("=") else out[1:])
        for k, v in attrs.items():
            a = n.attribute.add()
            a.name = k
            if isinstance(v, TensorProto):
                a.type = a.TENSOR
                a.t.CopyFrom(v)
        g.node.append(n)
        return n.output[0]

    c0, c1, c2, c3 = const("0", [0]), const("1", [1]), const("2", [2]), const("3", [3])
    kshape = node("Shape", [past_name], "kv_shape")
    past = node("Slice", [kshape, c2, c3], "past_len")
    ishape = node("Shape", [ids_name], "ids_shape")
    batch = node("Slice", [ishape, c0, c1], "batch")
    seq = node("Slice", [ishape, c1, c2], "seq_len")
    total = node("Add", [past, seq], "total_len")
    if mask_name:
        et = inputs[mask_name].type.tensor_type.elem_type
        one = TensorProto(data_type=et, dims=[1])
        if et in (TensorProto.INT64,):
            one.int64_data.append(1)
        elif et in (TensorProto.INT32,):
            one.int32_data.append(1)
        else:
            raise ModelFormatError(f"attention_mask element type {et} is not INT32/INT64")
        mshape = node("Concat", [batch, total], "mask_shape")
        ax = g.node[-1].attribute.add()
        ax.name, ax.type, ax.i = "axis", ax.INT, 0
        node("ConstantOfShape", [mshape], "=" + mask_name, value=one)
    if pos_name:
        start = node("Squeeze", [past, c0], "past_scalar")
        stop = node("Squeeze", [total, c0], "total_scalar")
        one_s = node("Squeeze", [c1, c0], "one_scalar")
        rng = node("Range", [start, stop, one_s], "positions")
        row = node("Unsqueeze", [rng, c0], "positions_row")
        pshape = node("Concat", [batch, seq], "pos_shape")
        ax = g.node[-1].attribute.add()
        ax.name, ax.type, ax.i = "axis", ax.INT, 0
        et = inputs[pos_name].type.tensor_type.elem_type
        expanded = node("Expand", [row, pshape], "positions_expanded")
        if et == TensorProto.INT64:
            node("Identity", [expanded], "=" + pos_name)
        else:
            n = node("Cast", [expanded], "=" + pos_name)
            a = g.node[-1].attribute.add()
            a.name, a.type, a.i = "to", a.INT, et
    keep = [vi for vi in g.input if vi.name not in (mask_name, pos_name)]
    del g.input[:]
    g.input.extend(keep)
