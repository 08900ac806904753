"""com.microsoft operators against onnxruntime (the implementation that defines them).

GatherBlockQuantized (with and without zero points), SimplifiedLayerNormalization,
SkipSimplifiedLayerNormalization (all four outputs), RotaryEmbedding, GroupQueryAttention
(separate and packed QKV, rotary, prefill then decode steps with the present fed back, softcap and
local window on the general path) and the clear errors for what is not supported.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from olv_runtime.errors import InvalidArgument, ValidationError
from olv_runtime.executor.session import InferenceSession

MS = "com.microsoft"


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                               helper.make_opsetid(MS, 1)], ir_version=10)


def _both(model, feeds):
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    got = InferenceSession(model).run(None, feeds)
    return got, ref


def _vi(name, et, shape):
    return helper.make_tensor_value_info(name, et, shape)


@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_gather_block_quantized(zp, block):
    rng = np.random.default_rng(block + zp)
    v, d = 10, 128
    nb = d // block
    data = rng.integers(0, 256, (v, d // 2), dtype=np.uint8)
    scales = (rng.random((v, nb)) * 0.1 + 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(data, "data"), numpy_helper.from_array(scales, "scales")]
    ins = ["data", "ids", "scales"]
    if zp:
        zps = rng.integers(0, 256, (v, (nb + 1) // 2), dtype=np.uint8)
        inits.append(numpy_helper.from_array(zps, "zp"))
        ins.append("zp")
    node = helper.make_node("GatherBlockQuantized", ins, ["y"], domain=MS, block_size=block,
                            gather_axis=0, quantize_axis=1)
    m = _model([node], [_vi("ids", TensorProto.INT64, [2, 3])],
               [_vi("y", TensorProto.FLOAT, [2, 3, d])], inits)
    ids = np.array([[0, 9, 3], [3, 1, -1]], np.int64)
    (got,), (ref,) = _both(m, {"ids": np.where(ids < 0, ids + v, ids)})
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


def test_simplified_layer_norms():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    skip = rng.standard_normal((2, 3, 16)).astype(np.float32)
    gamma = rng.standard_normal(16).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(bias, "bias")]
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y0"], epsilon=1e-6,
                         axis=-1),
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"],
                         ["y1", "", "inv", "sum"], domain=MS, epsilon=1e-6),
    ]
    outs = [_vi("y0", TensorProto.FLOAT, None), _vi("y1", TensorProto.FLOAT, None),
            _vi("inv", TensorProto.FLOAT, None), _vi("sum", TensorProto.FLOAT, None)]
    m = _model(nodes, [_vi("x", TensorProto.FLOAT, [2, 3, 16]),
                       _vi("skip", TensorProto.FLOAT, [2, 3, 16])], outs, inits)
    got, ref = _both(m, {"x": x, "skip": skip})
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r.reshape(g.shape), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_ms(interleaved):
    rng = np.random.default_rng(2)
    b, s, h, d = 1, 5, 2, 8
    x = rng.standard_normal((b, s, h * d)).astype(np.float32)
    ang = rng.random((32, d // 2)).astype(np.float32) * 3
    cos, sin = np.cos(ang), np.sin(ang)
    pos = np.array([[3, 4, 5, 6, 7]], np.int64)
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain=MS,
                            interleaved=interleaved, num_heads=h)
    m = _model([node], [_vi("x", TensorProto.FLOAT, [b, s, h * d]),
                        _vi("pos", TensorProto.INT64, [b, s])],
               [_vi("y", TensorProto.FLOAT, None)],
               [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")])
    (got,), (ref,) = _both(m, {"x": x, "pos": pos})
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def _gqa_model(h, kvh, d, packed, rotary, softcap=0.0, window=-1):
    ins = ["q", "" if packed else "k", "" if packed else "v", "pk", "pv", "seqlens", "total"]
    inits = []
    if rotary:
        ang = np.random.default_rng(3).random((64, d // 2)).astype(np.float32) * 3
        inits = [numpy_helper.from_array(np.cos(ang), "cos"),
                 numpy_helper.from_array(np.sin(ang), "sin")]
        ins += ["cos", "sin"]
    node = helper.make_node("GroupQueryAttention", ins, ["y", "present_k", "present_v"],
                            domain=MS, num_heads=h, kv_num_heads=kvh, do_rotary=int(rotary),
                            softcap=softcap, local_window_size=window)
    width = (h + 2 * kvh) * d if packed else h * d
    inputs = [_vi("q", TensorProto.FLOAT, [1, None, width])]
    if not packed:
        inputs += [_vi("k", TensorProto.FLOAT, [1, None, kvh * d]),
                   _vi("v", TensorProto.FLOAT, [1, None, kvh * d])]
    inputs += [_vi("pk", TensorProto.FLOAT, [1, kvh, None, d]),
               _vi("pv", TensorProto.FLOAT, [1, kvh, None, d]),
               _vi("seqlens", TensorProto.INT32, [1]), _vi("total", TensorProto.INT32, [])]
    outs = [_vi("y", TensorProto.FLOAT, None), _vi("present_k", TensorProto.FLOAT, None),
            _vi("present_v", TensorProto.FLOAT, None)]
    return _model([node], inputs, outs, inits)


@pytest.mark.parametrize("packed,rotary,softcap,window", [
    (False, True, 0.0, -1), (True, True, 0.0, -1), (False, False, 0.0, -1),
    (True, True, 30.0, -1), (False, True, 0.0, 3)])
def test_group_query_attention_prefill_and_decode(packed, rotary, softcap, window):
    h, kvh, d = 4, 2, 16
    m = _gqa_model(h, kvh, d, packed, rotary, softcap, window)
    o = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    sess = InferenceSession(m)
    rng = np.random.default_rng(4)
    past_o = past_s = (np.zeros((1, kvh, 0, d), np.float32),) * 2
    for s in (5, 1, 1, 2):
        p = past_o[0].shape[2]
        feeds = {"seqlens": np.array([p + s - 1], np.int32), "total": np.array(p + s, np.int32)}
        if packed:
            feeds["q"] = rng.standard_normal((1, s, (h + 2 * kvh) * d)).astype(np.float32)
        else:
            feeds["q"] = rng.standard_normal((1, s, h * d)).astype(np.float32)
            feeds["k"] = rng.standard_normal((1, s, kvh * d)).astype(np.float32)
            feeds["v"] = rng.standard_normal((1, s, kvh * d)).astype(np.float32)
        ref = o.run(None, {**feeds, "pk": past_o[0], "pv": past_o[1]})
        got = sess.run(None, {**feeds, "pk": np.ascontiguousarray(past_s[0]),
                              "pv": np.ascontiguousarray(past_s[1])})
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
        past_o, past_s = (ref[1], ref[2]), (got[1], got[2])


def test_group_query_attention_rejects_padded_rows():
    m = _gqa_model(4, 2, 16, False, True)
    sess = InferenceSession(m)
    feeds = {"q": np.zeros((1, 3, 64), np.float32), "k": np.zeros((1, 3, 32), np.float32),
             "v": np.zeros((1, 3, 32), np.float32), "pk": np.zeros((1, 2, 0, 16), np.float32),
             "pv": np.zeros((1, 2, 0, 16), np.float32), "seqlens": np.array([1], np.int32),
             "total": np.array(3, np.int32)}
    with pytest.raises(InvalidArgument, match="seqlens_k must be past"):
        sess.run(None, feeds)


def test_matmul_nbits_rejects_g_idx_and_float_zero_points():
    n, k = 8, 32
    b = numpy_helper.from_array(np.zeros((n, 1, 16), np.uint8), "B")
    s = numpy_helper.from_array(np.ones(n, np.float32), "S")
    g = numpy_helper.from_array(np.zeros(k, np.int32), "G")
    zf = numpy_helper.from_array(np.ones(n, np.float32), "ZF")
    x = _vi("x", TensorProto.FLOAT, [1, k])
    y = _vi("y", TensorProto.FLOAT, None)
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "", "G"], ["y"], domain=MS, K=k, N=n,
                            bits=4, block_size=32)
    with pytest.raises(ValidationError, match="g_idx"):
        InferenceSession(_model([node], [x], [y], [b, s, g]))
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "ZF"], ["y"], domain=MS, K=k, N=n,
                            bits=4, block_size=32)
    with pytest.raises(ValidationError, match="floating-point zero_points"):
        InferenceSession(_model([node], [x], [y], [b, s, zf]))
    node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain=MS, K=k, N=n,
                            bits=3, block_size=32)
    with pytest.raises(ValidationError, match="bits must be 4 or 8"):
        InferenceSession(_model([node], [x], [y], [b, s]))


def test_gather_block_quantized_through_reshape_of_tied_weight():
    """Tied embeddings as the genai builder writes them: GatherBlockQuantized reads
    Reshape(lm_head B [V, blocks, blob] -> [V, blocks * blob]); the table is the same bytes."""
    rng = np.random.default_rng(7)
    v, d, block = 12, 64, 32
    b = rng.integers(0, 256, (v, d // block, block // 2), dtype=np.uint8)
    scales = (rng.random((v, d // block)) * 0.1 + 0.01).astype(np.float32)
    shape = np.array([v, d // 2], np.int64)
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S"),
             numpy_helper.from_array(shape, "shape")]
    nodes = [helper.make_node("Reshape", ["B", "shape"], ["table"]),
             helper.make_node("GatherBlockQuantized", ["table", "ids", "S"], ["y"], domain=MS,
                              block_size=block, gather_axis=0, quantize_axis=1)]
    m = _model(nodes, [_vi("ids", TensorProto.INT64, [1, 4])],
               [_vi("y", TensorProto.FLOAT, None)], inits)
    (got,), (ref,) = _both(m, {"ids": np.array([[0, 11, 5, 5]], np.int64)})
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


def test_gather_block_quantized_scalar_index():
    """A 0-d index gathers one row of shape [D], as onnxruntime (and ONNX Gather) give: the fused
    EncodedGather path keeps the index's rank."""
    rng = np.random.default_rng(7)
    v, d, block = 10, 64, 32
    data = rng.integers(0, 256, (v, d // 2), dtype=np.uint8)
    scales = (rng.random((v, d // block)) * 0.1 + 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(data, "data"), numpy_helper.from_array(scales, "scales")]
    node = helper.make_node("GatherBlockQuantized", ["data", "ids", "scales"], ["y"], domain=MS,
                            block_size=block, gather_axis=0, quantize_axis=1)
    m = _model([node], [_vi("ids", TensorProto.INT64, [])], [_vi("y", TensorProto.FLOAT, [d])],
               inits)
    (got,), (ref,) = _both(m, {"ids": np.array(4, np.int64)})
    assert got.shape == ref.shape == (d,)
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
