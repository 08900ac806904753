"""Standard ONNX exports and QDQ INT4 models from other tools (issue 12 items 1 and 4).

* ``torch.onnx.export`` fp32 graphs at opsets 17 and 18: a small MLP (Gemm, LayerNormalization,
  Gelu) and a tiny random Qwen2 decoder; olv matches onnxruntime within 1e-4.
* onnxruntime's ``MatMulNBitsQuantizer(bits=4, block_size=32 or 128, is_symmetric=False,
  quant_format=QDQ)`` on that Qwen2 export writes ``DequantizeLinear(UINT4 B, scale,
  zero_point, axis=0, block_size) -> MatMul``; olv fuses every one onto the INT4 linear kernels
  with zero points (the plan shows Linear steps and no DequantizeLinear/MatMul, 0 bytes
  dequantized) and matches onnxruntime (QDQ fusion with accuracy level 0, float activations)
  within 1e-4.
* com.microsoft ``MatMulNBits`` with 4 and 8 bits, block sizes 16-128, with and without zero
  points, against onnxruntime.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from onnx import TensorProto, helper

from olv_runtime.executor.session import InferenceSession, SessionOptions

IDS = np.array([[3, 17, 42, 99, 5, 7]], np.int64)


def _ort(path_or_model, feeds, accuracy_level0=True):
    so = ort.SessionOptions()
    if accuracy_level0:  # QDQ -> MatMulNBits fusion with float activations (default is 4)
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    src = path_or_model if isinstance(path_or_model, str) else path_or_model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


@pytest.mark.parametrize("opset", [17, 18, 20])
def test_torch_exported_mlp(tmp_path, opset):
    torch.manual_seed(0)
    path = str(tmp_path / f"mlp{opset}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_MLP().eval(), (torch.randn(4, 16),), path, opset_version=opset,
                          input_names=["x"], output_names=["y"], dynamo=False)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"Gemm", "LayerNormalization"} <= ops or {"Gemm"} <= ops, ops
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    (ref,) = _ort(path, {"x": x}, accuracy_level0=False)
    (got,) = InferenceSession(path).run(None, {"x": x})
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def qwen2_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("texport")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    out = {}
    for opset in (17, 18):
        path = str(root / f"qwen2_{opset}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Logits(model), (torch.tensor(IDS),), path, opset_version=opset,
                              input_names=["input_ids"], output_names=["logits"], dynamo=True)
        out[opset] = path
    # a variable sequence length (what a decoder export normally declares): the dynamo graph
    # builds its causal mask with CumSum and GatherND
    path = str(root / "qwen2_dyn.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(model), (torch.tensor(IDS),), path, opset_version=18,
                          input_names=["input_ids"], output_names=["logits"], dynamo=True,
                          dynamic_axes={"input_ids": {1: "seq"}})
    out["dyn"] = path
    return out


@pytest.mark.parametrize("opset", [17, 18])
def test_torch_exported_qwen2(qwen2_exports, opset):
    path = qwen2_exports[opset]
    (ref,) = _ort(path, {"input_ids": IDS}, accuracy_level0=False)
    (got,) = InferenceSession(path).run(None, {"input_ids": IDS})
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_torch_exported_qwen2_variable_length(qwen2_exports):
    path = qwen2_exports["dyn"]
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"CumSum", "GatherND"} <= ops, ops
    sess = InferenceSession(path)
    rng = np.random.default_rng(3)
    for length in (1, 3, 7, 12):
        ids = rng.integers(0, 256, (1, length))
        (ref,) = _ort(path, {"input_ids": ids}, accuracy_level0=False)
        (got,) = sess.run(None, {"input_ids": ids})
        assert got.shape == (1, length, 256)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("block", [32, 128])
def test_qdq_int4_with_zero_points_is_fused(qwen2_exports, tmp_path, block):
    from onnxruntime.quantization import matmul_nbits_quantizer as mq
    from onnxruntime.quantization.quant_utils import QuantFormat

    q = mq.MatMulNBitsQuantizer(onnx.load(qwen2_exports[18]), bits=4, block_size=block,
                                is_symmetric=False, quant_format=QuantFormat.QDQ)
    q.process()
    path = str(tmp_path / f"qdq{block}.onnx")
    onnx.save(q.model.model, path)
    g = q.model.model.graph
    dq = [n for n in g.node if n.op_type == "DequantizeLinear"]
    assert dq and all(len(n.input) == 3 for n in dq)  # asymmetric: zero points
    inits = {t.name: t for t in g.initializer}
    assert {inits[n.input[0]].data_type for n in dq} == {TensorProto.UINT4}
    (ref,) = _ort(path, {"input_ids": IDS})
    sess = InferenceSession(path)
    (got,) = sess.run(None, {"input_ids": IDS})
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    kinds = [k for k, _ in sess.plan()]
    assert "DequantizeLinear" not in kinds  # every DQ -> MatMul pair is one Linear step
    assert kinds.count("Linear") >= 9
    snap = sess.counters.snapshot()
    assert snap["bytes_dequantized"] == 0 and snap["bytes_repacked"] > 0
    # the reference mode (no fusion) decodes and agrees
    (slow,) = InferenceSession(path, SessionOptions(enable_fusion=False)).run(
        None, {"input_ids": IDS})
    np.testing.assert_allclose(slow, ref, atol=1e-4, rtol=0)


def _matmul_nbits_model(n, k, bits, block, zero_points, bias, rng):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = rng.standard_normal((k, n)).astype(np.float32) * 0.1
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y" if bias is None else "mm"])]
    inits = [onnx.numpy_helper.from_array(w, "w")]
    if bias is not None:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"]))
        inits.append(onnx.numpy_helper.from_array(bias, "b"))
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                          opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    q = MatMulNBitsQuantizer(m, bits=bits, block_size=block, is_symmetric=not zero_points)
    q.process()
    return q.model.model


@pytest.mark.parametrize("bits,block,zp", [(4, 32, False), (4, 32, True), (4, 16, True),
                                           (4, 64, True), (4, 128, False), (8, 32, True),
                                           (8, 128, False)])
def test_matmul_nbits_against_onnxruntime(bits, block, zp):
    rng = np.random.default_rng(bits * 1000 + block + zp)
    k = 160 if block < 128 else 256
    model = _matmul_nbits_model(24, k, bits, block, zp, None, rng)
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)
    x = rng.standard_normal((3, k)).astype(np.float32)
    (ref,) = _ort(model, {"x": x})
    sess = InferenceSession(model)
    (got,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-5)
    kinds = [kd for kd, _ in sess.plan()]
    if bits == 4:
        assert kinds == ["Linear"] and sess.counters.snapshot()["bytes_dequantized"] == 0
    else:  # 8-bit weights: decoded once, counted
        assert kinds == ["MatMulNBits"]
        assert sess.counters.snapshot()["bytes_dequantized"] == 24 * k * 4


@pytest.mark.parametrize("ckpt", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_export_standard_output_runs_on_the_packed_kernels(request, tmp_path, ckpt):
    """olv's own ``export-standard`` output (INT4 initializers under DequantizeLinear,
    Transpose -> MatMul, Gather) runs in olv with the same logits as the olv model, every
    DequantizeLinear fused (linear steps and encoded gathers, 0 bytes dequantized)."""
    import json

    import olv_runtime
    from olv_runtime.builder.export import FEEDBACK_METADATA_KEY, export_standard

    src = tmp_path / "model.onnx"
    olv_runtime.convert(request.getfixturevalue(ckpt), src, weights="int4-block32")
    std_path = tmp_path / "standard.onnx"
    olv_runtime.save(export_standard(src, feedback=True), std_path)
    model = olv_runtime.load(src)
    kvh, d = int(model.metadata()["olv.num_kv_heads"]), int(model.metadata()["olv.head_dim"])
    sess = InferenceSession(str(std_path))
    pairs = json.loads(sess.get_modelmeta()[FEEDBACK_METADATA_KEY])
    feeds = {"input_ids": IDS, **{p["input"]: np.zeros((1, kvh, 0, d), np.float32)
                                  for p in pairs}}
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    state = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    ref = state.run({"input_ids": IDS})["logits"]
    np.testing.assert_allclose(got["logits"], ref, atol=1e-4, rtol=0)
    kinds = [k for k, _ in sess.plan()]
    # the linears run fused: as Linear steps, or inside the compiled decoder stack that
    # groups them (fusion.DecoderStack, issue 10)
    assert "DequantizeLinear" not in kinds and "MatMul" not in kinds and "EncodedGather" in kinds
    assert "Linear" in kinds or "DecoderStack" in kinds
    assert sess.counters.snapshot()["bytes_dequantized"] == 0
