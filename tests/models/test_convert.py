"""Checkpoint reading, INT4 quantization and the checkpoint → ONNX converter.

Oracles: torch/transformers state dicts for checkpoint reading; a hand-written scalar quantizer
and bit unpacker for the INT4 format; the standard ``onnx`` package for the graph structure
(extension fields parse as unknown fields); ``onnx.reference.ReferenceEvaluator`` +
transformers for the numerics of the converted graph.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct

import numpy as np
import onnx
import pytest
import torch

from olv_runtime.errors import ConversionError, OlvError
from olv_runtime.proto.helper import (
    make_affine_encoded,
    make_node,
    make_tensor,
    make_tensor_value_info,
    tensor_to_array,
)
from olv_runtime.models.checkpoint import Checkpoint
from olv_runtime.models.hf import build_model, compute_inv_freq, convert
from olv_runtime.proto import AttributeProto, ModelProto, TensorProto
from olv_runtime.structs import quantize as quantize_mod
from olv_runtime.structs.quantize import pack_codes, quantize_int4_blockwise

ALL_DIRS = ["tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen2_untied_dir", "tiny_llama_dir"]


# --------------------------------------------------------------------------- helpers


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _unpack_int4_reference(payload: bytes, count: int) -> np.ndarray:
    """Independent scalar unpacker: signed 4-bit codes, low nibble first."""
    out = []
    for byte in payload:
        for nib in (byte & 0x0F, (byte >> 4) & 0x0F):
            out.append(nib - 16 if nib >= 8 else nib)
    return np.array(out[:count], dtype=np.int64)


def _quantize_reference(w: np.ndarray, block: int = 32, scale_dtype=np.float32):
    """Scalar reference of the symmetric block quantizer (codes int [N, K], scale [N, nb] of
    ``scale_dtype``; with float16 the scale is rounded first and the codes use the rounded one)."""
    n, k = w.shape
    nb = -(-k // block)
    codes = np.zeros((n, k), dtype=np.int64)
    scale = np.zeros((n, nb), dtype=scale_dtype)
    for r in range(n):
        for b in range(nb):
            vals = [np.float32(v) for v in w[r, b * block:(b + 1) * block]]
            m = np.float32(0)
            for v in vals:
                if abs(v) > abs(m):
                    m = v
            d = np.float32(m / np.float32(-8))
            d = np.float32(scale_dtype(d))
            scale[r, b] = d
            for j, v in enumerate(vals):
                q = 0 if d == 0 else int(np.clip(np.rint(np.float32(v / d)), -8, 7))
                codes[r, b * block + j] = q
    return codes, scale


def _decode_encoded(ev) -> np.ndarray:
    """Independent decoder of the converter's INT4 affine values."""
    n, k = (d.dim_value for d in ev.logical_type.tensor_type.shape.dim)
    codes = _unpack_int4_reference(ev.raw_data, n * k).reshape(n, k)
    scale = tensor_to_array(ev.affine.scale)
    return (codes * np.repeat(scale, ev.affine.block_size, axis=1)[:, :k]).astype(np.float32)


def _meta(model) -> dict:
    return {p.key: p.value for p in model.metadata_props}


def _run_reference(onnx_model: onnx.ModelProto, ids: np.ndarray, split: int) -> np.ndarray:
    """Run the graph twice with onnx's ReferenceEvaluator, feeding present_* back as past_*."""
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(onnx_model)
    meta = {p.key: p.value for p in onnx_model.metadata_props}
    L, kvh, d = int(meta["olv.num_layers"]), int(meta["olv.num_kv_heads"]), int(meta["olv.head_dim"])
    names = ["logits"] + [f"present_{k}.{i}" for i in range(L) for k in ("key", "value")]
    past = {f"past_{k}.{i}": np.zeros((ids.shape[0], kvh, 0, d), np.float32)
            for i in range(L) for k in ("key", "value")}
    logits = []
    for chunk in (ids[:, :split], ids[:, split:]):
        outs = ref.run(names, {"input_ids": chunk, **past})
        logits.append(outs[0])
        for j, name in enumerate(names[1:], start=1):
            past[name.replace("present_", "past_")] = outs[j]
        assert outs[1].shape == (ids.shape[0], kvh, sum(x.shape[1] for x in logits), d)
    return np.concatenate(logits, axis=1)


def _int4_as_float_onnx(model: ModelProto) -> onnx.ModelProto:
    """Replace encoded initializers by their decoded floats and Decode nodes by Identity."""
    m = ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for ev in g.encoded_initializer:
        g.initializer.append(make_tensor(ev.name, _decode_encoded(ev)))
    g.ClearField("encoded_initializer")
    for node in g.node:
        if node.domain == "olv" and node.op_type == "Decode":
            node.op_type = "Identity"
            node.domain = ""
    keep = [op for op in m.opset_import if op.domain != "olv"]
    del m.opset_import[:]
    m.opset_import.extend(keep)
    return onnx.ModelProto.FromString(m.SerializeToString())


# --------------------------------------------------------------------------- helper.py


def test_helper_make_node_attributes():
    t = make_tensor("c", np.arange(3, dtype=np.int64))
    node = make_node("Foo", ["a", ""], ["b"], name="n", domain="olv",
                     i=3, f=0.5, s="x", ints=[1, 2], floats=[1.0, 2.5], t=t, skip=None)
    onode = onnx.NodeProto.FromString(node.SerializeToString())
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in onode.attribute}
    assert onode.domain == "olv" and onode.name == "n" and list(onode.input) == ["a", ""]
    assert attrs["i"] == 3 and attrs["f"] == 0.5 and attrs["s"] == b"x"
    assert attrs["ints"] == [1, 2] and attrs["floats"] == [1.0, 2.5]
    assert "skip" not in attrs
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(attrs["t"]), [0, 1, 2])
    types = {a.name: a.type for a in node.attribute}
    assert types["i"] == AttributeProto.INT and types["floats"] == AttributeProto.FLOATS


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int32, np.int8,
                                   np.uint8, np.bool_])
def test_helper_tensor_roundtrip(dtype):
    arr = (np.arange(12).reshape(3, 4) % 5).astype(dtype)
    t = make_tensor("x", arr)
    np.testing.assert_array_equal(tensor_to_array(t), arr)
    assert tensor_to_array(t).dtype == arr.dtype
    # onnx agrees on the wire encoding.
    np.testing.assert_array_equal(
        onnx.numpy_helper.to_array(onnx.TensorProto.FromString(t.SerializeToString())), arr)


def test_helper_tensor_to_array_typed_fields():
    ot = onnx.helper.make_tensor("f", onnx.TensorProto.FLOAT, [2], [1.5, -2.0])
    t = TensorProto.FromString(ot.SerializeToString())
    np.testing.assert_array_equal(tensor_to_array(t), np.array([1.5, -2.0], np.float32))
    ot = onnx.helper.make_tensor("i", onnx.TensorProto.INT64, [3], [1, -2, 3])
    np.testing.assert_array_equal(tensor_to_array(TensorProto.FromString(ot.SerializeToString())),
                                  [1, -2, 3])
    ot = onnx.helper.make_tensor("h", onnx.TensorProto.FLOAT16, [2], np.array([0.5, 3.0], np.float16))
    np.testing.assert_array_equal(tensor_to_array(TensorProto.FromString(ot.SerializeToString())),
                                  np.array([0.5, 3.0], np.float16))


def test_helper_value_info_and_encoded():
    vi = make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, None])
    ovi = onnx.ValueInfoProto.FromString(vi.SerializeToString())
    dims = ovi.type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == 3
    assert not dims[2].HasField("dim_value") and not dims[2].HasField("dim_param")

    scale = np.array([[0.5], [2.0]], np.float32)
    ev = make_affine_encoded("w", b"\x12\x34", TensorProto.INT4, [2, 2], scale,
                             np.array([[1], [-2]]), axis=1, block_size=32)
    assert ev.name == "w" and ev.raw_data == b"\x12\x34"
    assert ev.affine.storage_type == TensorProto.INT4
    assert ev.affine.axis == 1 and ev.affine.block_size == 32
    np.testing.assert_array_equal(tensor_to_array(ev.affine.scale), scale)
    assert ev.affine.zero_point.data_type == TensorProto.INT4
    assert ev.affine.zero_point.raw_data == bytes([0xE1])  # packed over the tensor
    assert [d.dim_value for d in ev.logical_type.tensor_type.shape.dim] == [2, 2]
    assert ev.logical_type.tensor_type.elem_type == TensorProto.FLOAT


# --------------------------------------------------------------------------- quantize.py


def test_pack_codes_known_answers():
    assert pack_codes(np.array([-8, 4]), 4).tolist() == [0x48]
    assert pack_codes(np.array([1, 2, 3]), 4).tolist() == [0x21, 0x03]  # final high nibble 0
    assert pack_codes(np.array([[-1, 0], [7, -8]]), 4).tolist() == [0x0F, 0x87]
    assert pack_codes(np.array([1, 2, 3, -1, 1]), 2).tolist() == [0b11111001, 0b01]
    assert pack_codes(np.array([-1, 5]), 8).tolist() == [255, 5]
    assert pack_codes(np.array([], dtype=np.int64), 4).size == 0


def test_quantize_int4_known_answers():
    w = np.zeros((3, 36), np.float32)
    w[0, :4] = [-4.0, 2.0, 1.0, 0.5]           # m = -4 -> d = 0.5, q = [-8, 4, 2, 1]
    w[0, 32:36] = [0.0, 0.0, 0.0, 0.0]         # zero partial block -> scale 0, codes 0
    w[1, :6] = [8.0, -7.9, -2.5, -3.5, 2.5, 0.4]  # m = 8 -> d = -1; q = -x rounded half-even
    w[1, 32:34] = [1.0, -3.0]                  # partial block: m = -3 -> d = 0.375
    w[2, :2] = [4.0, -4.0]                     # tie: the first one wins -> d = -0.5
    payload, scale = quantize_int4_blockwise(w)
    assert payload.dtype == np.uint8 and payload.shape == (54,)
    assert scale.dtype == np.float32 and scale.shape == (3, 2)
    np.testing.assert_array_equal(scale, [[0.5, 0.0], [-1.0, 0.375], [-0.5, 0.0]])
    codes = _unpack_int4_reference(payload.tobytes(), 3 * 36).reshape(3, 36)
    assert codes[0, :4].tolist() == [-8, 4, 2, 1]
    assert codes[1, :6].tolist() == [-8, 7, 2, 4, -2, 0]
    assert codes[1, 32:34].tolist() == [3, -8]
    assert codes[2, :2].tolist() == [-8, 7]   # 4 / -0.5 = -8; -4 / -0.5 = 8 -> clipped to 7
    assert payload[0] == 0x48  # -8 low nibble, 4 high nibble


@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(5, 64), (7, 45), (3, 31), (1, 1), (9, 96)])
def test_quantize_int4_matches_scalar_reference(shape, scale_dtype):
    rng = np.random.default_rng(sum(shape))
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, : min(3, shape[1])] = 0.0
    payload, scale = quantize_int4_blockwise(w, 32, scale_dtype)
    assert scale.dtype == scale_dtype
    n, k = shape
    assert payload.size == -(-n * k // 2)
    if (n * k) % 2:
        assert payload[-1] >> 4 == 0
    ref_codes, ref_scale = _quantize_reference(w, scale_dtype=scale_dtype)
    np.testing.assert_array_equal(scale, ref_scale)
    scale = scale.astype(np.float32)
    codes = _unpack_int4_reference(payload.tobytes(), n * k).reshape(n, k)
    np.testing.assert_array_equal(codes, ref_codes)
    # Round trip: the decoded value is within half a step of the original, except where
    # +8 was clipped to 7 (then within one step).
    deq = codes * np.repeat(scale, 32, axis=1)[:, :k]
    step = np.abs(np.repeat(scale, 32, axis=1)[:, :k])
    err = np.abs(deq - w)
    # float16: the stored scale may be up to 2^-11 relative smaller than m / 8, so |x| / d can
    # exceed 8 by that much; +-1 step still bounds every code, half a step all but the clipped
    slack = 1e-6 + (8.0 * step * 2.0 ** -11 if scale_dtype == np.float16 else 0.0 * step)
    assert np.all(err <= step + slack)
    inner = (codes != 7) & (codes != -8)
    assert np.all(err[inner] <= step[inner] / 2 + slack[inner])
    np.testing.assert_array_equal(
        quantize_mod.dequantize_int4_blockwise(payload, scale, shape), deq.astype(np.float32))


def test_quantize_int4_float16_overflow_is_an_error(tmp_path):
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = 1e6  # scale 1.25e5 > 65504
    with pytest.raises(ValueError, match="overflows float16.*use float32"):
        quantize_int4_blockwise(w, 32, np.float16)
    payload, scale = quantize_int4_blockwise(w, 32, np.float32)
    assert scale[0, 0] == np.float32(-1.25e5)


def test_quantize_int4_chunking_is_invisible(monkeypatch):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((37, 45)).astype(np.float32)  # odd rows and odd K
    full_payload, full_scale = quantize_int4_blockwise(w)
    monkeypatch.setattr(quantize_mod, "_CHUNK_ELEMENTS", 100)  # 2 rows per chunk
    p, s = quantize_int4_blockwise(w)
    np.testing.assert_array_equal(p, full_payload)
    np.testing.assert_array_equal(s, full_scale)


# --------------------------------------------------------------------------- checkpoint.py


@pytest.mark.parametrize("fixture", ALL_DIRS)
def test_checkpoint_matches_torch_state_dict(fixture, request):
    path = request.getfixturevalue(fixture)
    from safetensors import safe_open

    with Checkpoint(path) as ckpt, safe_open(str(path / "model.safetensors"), "pt") as st:
        assert sorted(ckpt.keys()) == sorted(st.keys())
        expected_dtype = "BF16" if fixture == "tiny_qwen3_dir" else "F32"
        sd = _hf_model(path).state_dict()
        for name in ckpt.keys():
            assert ckpt.dtype(name) == expected_dtype
            arr = ckpt.get(name)
            assert arr.dtype == np.float32 and arr.shape == tuple(st.get_tensor(name).shape)
            np.testing.assert_array_equal(arr, st.get_tensor(name).float().numpy(), err_msg=name)
            np.testing.assert_array_equal(arr, sd[name].numpy(), err_msg=name)


def test_checkpoint_sharded(tmp_path, tiny_qwen2_untied_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_untied_dir))
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    with Checkpoint(tmp_path) as sharded, Checkpoint(tiny_qwen2_untied_dir) as single:
        assert sorted(sharded.keys()) == sorted(single.keys())
        for name in single.keys():
            np.testing.assert_array_equal(sharded.get(name), single.get(name))


def test_checkpoint_f16(tmp_path):
    from safetensors.numpy import save_file

    a = np.array([[1.5, -2.25], [65504.0, 1e-3]], np.float16)
    save_file({"a": a}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with Checkpoint(tmp_path) as ckpt:
        np.testing.assert_array_equal(ckpt.get("a"), a.astype(np.float32))


def test_checkpoint_errors(tmp_path, tiny_qwen2_dir):
    from safetensors.numpy import save_file

    with pytest.raises(ConversionError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(ConversionError, match="config.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match="safetensors"):
        Checkpoint(tmp_path)

    # Unsupported dtype: reported on access, naming the tensor and dtype.
    save_file({"i": np.arange(4, dtype=np.int32)}, str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ckpt:
        with pytest.raises(ConversionError, match=r"'i'.*I32"):
            ckpt.get("i")
        with pytest.raises(ConversionError, match="no tensor 'missing'"):
            ckpt.get("missing")

    # Truncated file.
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_qwen2_dir, trunc)
    f = trunc / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ConversionError, match="truncated"):
        Checkpoint(trunc)
    f.write_bytes(data[:5])
    with pytest.raises(ConversionError, match="truncated"):
        Checkpoint(trunc)
    f.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ConversionError, match="truncated"):
        Checkpoint(trunc)
    f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ConversionError, match="JSON"):
        Checkpoint(trunc)


# --------------------------------------------------------------------------- converter: structure


def _structure_checks(model: ModelProto, weights: str, tied: bool, qk_norm: bool, bias: bool):
    data = model.SerializeToString()
    om = onnx.ModelProto.FromString(data)   # standard onnx: extension fields are unknown fields
    assert om.ir_version == 10
    assert {(o.domain, o.version) for o in om.opset_import} == {("", 23), ("olv", 1)}
    meta = _meta(om)
    L, H, KVH, D = (int(meta[k]) for k in
                    ("olv.num_layers", "olv.num_heads", "olv.num_kv_heads", "olv.head_dim"))
    hidden, vocab = int(meta["olv.hidden_size"]), int(meta["olv.vocab_size"])
    assert meta["olv.weights"] == weights
    g = om.graph

    # Unique, non-empty node names.
    names = [n.name for n in g.node]
    assert all(names) and len(set(names)) == len(names)

    # Every node input is produced by a node, an initializer, an encoded initializer or an input.
    encoded = {ev.name: ev for ev in model.graph.encoded_initializer}
    available = ({i.name for i in g.input} | {t.name for t in g.initializer} | set(encoded))
    for node in g.node:  # nodes are written in topological order
        for x in node.input:
            assert x == "" or x in available, f"{node.name}: input {x!r} has no producer"
        available.update(node.output)
    for out in g.output:
        assert out.name in available
    # Encoded values and initializers do not overlap; int4 keeps no float copy.
    init_names = {t.name for t in g.initializer}
    assert not (init_names & set(encoded))

    # Inputs / outputs.
    assert [i.name for i in g.input] == ["input_ids"] + [
        f"past_{k}.{i}" for i in range(L) for k in ("key", "value")]
    assert [o.name for o in g.output] == ["logits"] + [
        f"present_{k}.{i}" for i in range(L) for k in ("key", "value")]
    pk = g.input[1].type.tensor_type
    assert pk.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in pk.shape.dim] == ["batch", KVH, "past_sequence", D]
    assert g.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64

    # persistent_bindings survive a round trip through onnx (unknown fields kept).
    back = ModelProto.FromString(om.SerializeToString())
    assert [(b.input_name, b.output_name) for b in back.graph.persistent_bindings] == [
        (f"past_{k}.{i}", f"present_{k}.{i}") for i in range(L) for k in ("key", "value")]
    assert len(back.graph.encoded_initializer) == len(encoded)

    # Op types.
    ops = [n.op_type for n in g.node]
    n_linear = 7 * L + 1
    assert ops.count("MatMul") == n_linear
    assert ops.count("Transpose") == n_linear
    assert ops.count("Attention") == L and ops.count("RotaryEmbedding") == 2 * L
    assert ops.count("RMSNormalization") == (2 + (2 if qk_norm else 0)) * L + 1
    assert ops.count("Gather") == 1 and ops.count("Range") == 1
    assert ops.count("Cos") == 1 and ops.count("Sin") == 1
    assert ops.count("Sigmoid") == L
    assert ops.count("Add") == 2 * L + (3 * L if bias else 0) + 1  # + total_len
    decodes = [n for n in g.node if n.op_type == "Decode"]
    if weights == "int4-block32":
        assert all(n.domain == "olv" for n in decodes)
        assert len(decodes) == n_linear + 1   # + the embedding Gather
    else:
        assert not decodes and not encoded
        assert "olv" not in {n.domain for n in g.node}

    producer = {o: n for n in g.node for o in n.output}
    linear_weights = []
    for mm in (n for n in g.node if n.op_type == "MatMul"):
        tr = producer[mm.input[1]]
        assert tr.op_type == "Transpose"
        assert onnx.helper.get_attribute_value(tr.attribute[0]) == [1, 0]
        src = tr.input[0]
        if weights == "int4-block32":
            dec = producer[src]
            assert dec.op_type == "Decode" and dec.domain == "olv"
            src = dec.input[0]
            assert src in encoded and src not in init_names
        else:
            assert src in init_names
        linear_weights.append(src)
    gather = next(n for n in g.node if n.op_type == "Gather")
    emb_src = gather.input[0]
    if weights == "int4-block32":
        assert producer[emb_src].op_type == "Decode"
        emb_src = producer[emb_src].input[0]
    assert emb_src == "model.embed_tokens.weight" and gather.input[1] == "input_ids"
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert linear_weights[-1] == head
    assert producer["logits"].op_type in ("MatMul", "Add")

    # Attention wiring.
    for i in range(L):
        att = producer[f"present_key.{i}"]
        assert att.op_type == "Attention" and list(att.input[3:]) == ["", f"past_key.{i}",
                                                                       f"past_value.{i}"]
        assert list(att.output) [1:] == [f"present_key.{i}", f"present_value.{i}"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in att.attribute}
        assert attrs["is_causal"] == 1 and attrs["q_num_heads"] == H and attrs["kv_num_heads"] == KVH
        assert math.isclose(attrs["scale"], 1 / math.sqrt(D), rel_tol=1e-6)
        for x, heads in zip(att.input[:2], (H, KVH)):
            rot = producer[x]
            assert rot.op_type == "RotaryEmbedding" and len(rot.input) == 3
            rattrs = {a.name: onnx.helper.get_attribute_value(a) for a in rot.attribute}
            assert rattrs["num_heads"] == heads and rattrs.get("interleaved", 0) == 0

    # Encoded values: layout of docs/qwen_graph.md.
    for name, ev in encoded.items():
        n, k = (d.dim_value for d in ev.logical_type.tensor_type.shape.dim)
        assert ev.logical_type.tensor_type.elem_type == TensorProto.FLOAT
        assert ev.affine.storage_type == TensorProto.INT4
        assert ev.affine.axis == 1 and ev.affine.block_size == 32
        assert not ev.affine.HasField("zero_point")
        assert ev.affine.scale.data_type == TensorProto.FLOAT16  # the default: 4.5 bits/weight
        assert list(ev.affine.scale.dims) == [n, -(-k // 32)]
        assert len(ev.raw_data) == -(-n * k // 2)
    if weights == "int4-block32":
        assert set(encoded) == set(linear_weights) | {"model.embed_tokens.weight"}
        assert ("lm_head.weight" in encoded) == (not tied)
        # Dense: norm weights, biases, inv_freq and int64 constants only.
        for t in g.initializer:
            assert t.name.endswith(("norm.weight", ".bias", "inv_freq")) or t.name.startswith("const.")
    return om


CASES = [  # fixture, tied, qk_norm, bias
    ("tiny_qwen2_dir", True, False, True),
    ("tiny_qwen3_dir", True, True, False),
    ("tiny_qwen2_untied_dir", False, False, True),
    ("tiny_llama_dir", False, False, False),
]


@pytest.mark.parametrize("weights", ["int4-block32", "float32"])
@pytest.mark.parametrize("fixture,tied,qk_norm,bias", CASES)
def test_graph_structure(fixture, tied, qk_norm, bias, weights, request):
    path = request.getfixturevalue(fixture)
    model = build_model(path, weights)
    _structure_checks(model, weights, tied, qk_norm, bias)
    cfg = json.loads((path / "config.json").read_text())
    meta = _meta(model)
    assert meta["olv.architecture"] == cfg["architectures"][0]
    assert meta["olv.num_layers"] == "2" and meta["olv.num_heads"] == "4"
    assert meta["olv.num_kv_heads"] == "2" and meta["olv.hidden_size"] == "64"
    assert meta["olv.vocab_size"] == "128"
    assert meta["olv.head_dim"] == ("32" if fixture == "tiny_qwen3_dir" else "16")


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen2_untied_dir"])
def test_float32_graph_passes_onnx_checker(fixture, request):
    model = build_model(request.getfixturevalue(fixture), "float32")
    om = onnx.ModelProto.FromString(model.SerializeToString())
    onnx.checker.check_model(om, full_check=True)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_int4_payloads_decode_to_quantized_checkpoint(fixture, request):
    path = request.getfixturevalue(fixture)
    model = build_model(path, "int4-block32")
    with Checkpoint(path) as ckpt:
        for ev in model.graph.encoded_initializer:
            w = ckpt.get(ev.name)
            codes, scale = _quantize_reference(w, scale_dtype=np.float16)  # the default
            got = tensor_to_array(ev.affine.scale)
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got, scale)
            np.testing.assert_array_equal(
                _unpack_int4_reference(ev.raw_data, w.size).reshape(w.shape), codes)
        # Dense values are the checkpoint's, exactly.
        for t in model.graph.initializer:
            if t.name in ckpt:
                np.testing.assert_array_equal(tensor_to_array(t), ckpt.get(t.name))


# --------------------------------------------------------------------------- converter: numerics


@pytest.mark.parametrize("fixture", ALL_DIRS)
def test_float32_graph_matches_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    om = onnx.ModelProto.FromString(build_model(path, "float32").SerializeToString())
    ids = np.array([[1, 5, 7, 9, 3, 100, 42], [4, 4, 8, 127, 0, 2, 64]], dtype=np.int64)
    got = _run_reference(om, ids, split=4)
    with torch.no_grad():
        want = _hf_model(path)(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen2_untied_dir", "tiny_qwen3_dir"])
def test_int4_graph_matches_transformers_with_dequantized_weights(fixture, request):
    path = request.getfixturevalue(fixture)
    model = build_model(path, "int4-block32")
    om = _int4_as_float_onnx(model)
    hf = _hf_model(path)
    sd = hf.state_dict()
    with torch.no_grad():
        for ev in model.graph.encoded_initializer:
            sd[ev.name].copy_(torch.from_numpy(_decode_encoded(ev)))
        if hf.config.tie_word_embeddings:
            assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = np.array([[3, 17, 99, 5, 6]], dtype=np.int64)
    got = _run_reference(om, ids, split=3)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("theta,dim", [(10000.0, 16), (1000000.0, 32), (10000.0, 64),
                                       (500000.0, 64), (1000000.0, 128)])
def test_inv_freq_matches_transformers(theta, dim):
    want = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64)
                             .to(dtype=torch.float) / dim))).numpy()
    got = compute_inv_freq(theta, dim)
    assert got.dtype == np.float32 and got.shape == (dim // 2,)
    # torch's float32 pow is within 1 ulp of the correctly rounded power computed here.
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    if dim <= 64:
        np.testing.assert_array_equal(got, want)


def test_inv_freq_in_graph(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = build_model(tiny_qwen3_dir, "float32")
    t = next(t for t in model.graph.initializer if t.name == "model.rotary_emb.inv_freq")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32)
    np.testing.assert_array_equal(tensor_to_array(t), hf.model.rotary_emb.inv_freq.numpy())


# --------------------------------------------------------------------------- convert()


def test_convert_writes_model_and_tokenizer(tmp_path, tiny_qwen2_dir):
    msgs = []
    out = tmp_path / "out" / "model.onnx"
    model = convert(tiny_qwen2_dir, out, progress=msgs.append)
    assert out.exists()
    for fname in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out.parent / fname).read_bytes() == (tiny_qwen2_dir / fname).read_bytes()
    assert sum(m.startswith("layer ") for m in msgs) == 2
    om = onnx.load(str(out))
    assert len(om.graph.node) == len(model.graph.node)
    back = ModelProto.FromString(om.SerializeToString())
    assert len(back.graph.encoded_initializer) == len(model.graph.encoded_initializer) > 0
    assert len(back.graph.persistent_bindings) == 4


def test_convert_errors(tmp_path, tiny_qwen2_dir):
    with pytest.raises(ConversionError, match="config.json"):
        convert(tmp_path, tmp_path / "x.onnx")
    with pytest.raises(ConversionError, match="does not exist"):
        convert(tmp_path / "missing", tmp_path / "x.onnx")

    def variant(name, **changes):
        d = tmp_path / name
        shutil.copytree(tiny_qwen2_dir, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    d = variant("gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConversionError, match=r"GPT2LMHeadModel.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        convert(d, tmp_path / "x.onnx")
    d = variant("yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ConversionError, match="yarn"):
        build_model(d)
    d = variant("gelu", hidden_act="gelu")
    with pytest.raises(ConversionError, match="gelu"):
        build_model(d)
    with pytest.raises(ConversionError, match="weights"):
        build_model(tiny_qwen2_dir, "int3")
    d = variant("untied_missing_head", tie_word_embeddings=False)
    with pytest.raises(ConversionError, match="lm_head.weight"):
        build_model(d)
    assert issubclass(ConversionError, OlvError)
    assert not (tmp_path / "x.onnx").exists()


def test_rope_theta_top_level_and_missing_tie(tmp_path, tiny_qwen2_dir):
    d = tmp_path / "legacy"
    shutil.copytree(tiny_qwen2_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.pop("tie_word_embeddings")
    cfg["rope_theta"] = 12345.0
    (d / "config.json").write_text(json.dumps(cfg))
    model = build_model(d, "float32")
    t = next(t for t in model.graph.initializer if t.name == "model.rotary_emb.inv_freq")
    np.testing.assert_array_equal(tensor_to_array(t), compute_inv_freq(12345.0, 16))
    assert _meta(model)["olv.tie_word_embeddings"] == "1"  # no lm_head.weight in the file
