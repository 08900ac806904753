"""Standard-ONNX export (``olv export-standard``): lowering of affine and struct-encoded values,
the caller-managed feedback lowering of persistent bindings, and the errors for what has no
standard form.

Oracles: ``onnx.checker.check_model(full_check=True)`` and onnxruntime (1.32, opset 23
RMSNormalization / RotaryEmbedding / Attention, DequantizeLinear-21+ blocked INT4), compared with
olv_runtime's own session and decoders.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import olv_runtime
from olv_runtime.builder import GraphBuilder, StandardExportError
from olv_runtime.builder.export import FEEDBACK_METADATA_KEY, export_standard, to_onnx
from olv_runtime.cli import main as cli_main
from olv_runtime.proto.helper import make_affine_encoded
from olv_runtime.proto import TensorProto
from olv_runtime.structs.quantize import pack_codes
from olv_runtime.structs import build as B
from olv_runtime.structs import examples as X

import onnxruntime as ort  # noqa: E402  (test extra)

PROMPT = [5, 17, 99, 3, 42, 64, 7]
N_DECODE = 8


def ort_session(model):
    om = to_onnx(model)
    onnx.checker.check_model(om, full_check=True)
    return ort.InferenceSession(om.SerializeToString(), providers=["CPUExecutionProvider"])


def ort_run(sess, feeds):
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


# -------------------------------------------------------------------- the converted Qwen model
@pytest.mark.parametrize("ckpt", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_qwen_int4_feedback_export_matches_olv_runtime(request, tmp_path, ckpt):
    path = tmp_path / "model.onnx"
    olv_runtime.convert(request.getfixturevalue(ckpt), path, weights="int4-block32")
    std = export_standard(path, feedback=True)
    g = std.graph
    assert not len(g.encoded_initializer) and not len(g.persistent_bindings)
    assert not len(std.proto.struct_types)
    assert {o.domain for o in std.proto.opset_import} == {""}
    assert sum(n.op_type == "DequantizeLinear" for n in g.node) == \
        sum(n.op_type == "Decode" for n in olv_runtime.load(path).graph.node)
    codes = {t.name: t for t in g.initializer}["model.embed_tokens.weight"]
    assert codes.data_type == TensorProto.INT4
    pairs = json.loads(std.metadata()[FEEDBACK_METADATA_KEY])
    assert pairs[0] == {"input": "past_key.0", "output": "present_key.0"}
    sess = ort_session(std)  # checker(full_check=True) inside

    model = olv_runtime.load(path)
    state = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    kvh, d = int(model.metadata()["olv.num_kv_heads"]), int(model.metadata()["olv.head_dim"])
    # the documented caller-managed loop: feed bound inputs from the previous bound outputs
    past = {p["input"]: np.zeros((1, kvh, 0, d), np.float32) for p in pairs}
    feed = np.array([PROMPT], np.int64)
    ids_ort, ids_olv, worst = [], [], 0.0
    for _ in range(N_DECODE + 1):
        r = ort_run(sess, {"input_ids": feed, **past})
        o = state.run({"input_ids": feed})
        worst = max(worst, float(np.max(np.abs(r["logits"] - o["logits"]))))
        ids_ort.append(int(np.argmax(r["logits"][0, -1])))
        ids_olv.append(int(np.argmax(o["logits"][0, -1])))
        past = {p["input"]: r[p["output"]] for p in pairs}
        feed = np.array([[ids_ort[-1]]], np.int64)
    assert worst <= 1e-4, f"max |logit difference| {worst:.3g}"
    assert ids_ort == ids_olv


def test_bindings_reject_standard_export_without_feedback(tiny_qwen2_dir, tmp_path):
    path = tmp_path / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    with pytest.raises(StandardExportError, match=r"persistent binding.*'past_key.0' <- "
                                                  r"'present_key.0'.*feedback=True"):
        export_standard(path)
    out = tmp_path / "std.onnx"
    assert cli_main(["export-standard", str(path), str(out)]) == 2
    assert not out.exists()
    assert cli_main(["export-standard", str(path), str(out), "--feedback"]) == 0
    om = onnx.load(str(out))
    onnx.checker.check_model(om, full_check=True)
    assert {p.key for p in om.metadata_props} >= {FEEDBACK_METADATA_KEY, "olv.num_layers"}


# -------------------------------------------------------------------- affine forms
AFFINE_CASES = {
    "int4_blocked": dict(storage=TensorProto.INT4, shape=(6, 64), axis=1, block_size=32),
    "uint4_blocked_zp": dict(storage=TensorProto.UINT4, shape=(6, 64), axis=1, block_size=16,
                             zp=True),
    "int8_per_axis": dict(storage=TensorProto.INT8, shape=(5, 7), axis=0),
    "uint8_per_tensor_zp": dict(storage=TensorProto.UINT8, shape=(3, 9), zp=True),
    "int4_odd_count": dict(storage=TensorProto.INT4, shape=(3, 5), axis=1, block_size=4),
}


def _affine_value(name, storage, shape, axis=None, block_size=None, zp=False, seed=0):
    rng = np.random.default_rng(seed)
    bits = 4 if storage in (TensorProto.INT4, TensorProto.UINT4) else 8
    signed = storage in (TensorProto.INT4, TensorProto.INT8)
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    codes = rng.integers(lo, hi, size=shape)
    if axis is None:
        pshape = ()
    elif block_size is None:
        pshape = (shape[axis],)
    else:
        pshape = list(shape)
        pshape[axis] = -(-shape[axis] // block_size)
    scale = rng.uniform(0.01, 0.1, size=pshape).astype(np.float32)
    zpa = rng.integers(lo, hi, size=pshape) if zp else None
    return make_affine_encoded(name, pack_codes(codes, bits).tobytes(), storage, list(shape),
                               scale, zpa, axis=axis, block_size=block_size)


@pytest.mark.parametrize("case", sorted(AFFINE_CASES))
def test_affine_lowers_to_dequantize_linear(case):
    b = GraphBuilder("g", opsets={"": 23, "olv": 1})
    b.make_encoded_initializer(_affine_value("w", **AFFINE_CASES[case]))
    b.add_output(b.make_node("Decode", ["w"], ["y"], domain="olv"))
    model = b.to_model()
    std = export_standard(model)
    (node,) = std.graph.node
    assert node.op_type == "DequantizeLinear" and node.output[0] == "y"
    got = ort_run(ort_session(std), {})["y"]
    np.testing.assert_array_equal(got, olv_runtime.decode_value(model, "w"))


def test_affine_needs_opset_of_its_dequantize_linear_form():
    b = GraphBuilder("g", opsets={"": 19, "olv": 1})
    b.make_encoded_initializer(_affine_value("w4", TensorProto.INT4, (2, 32), 1, 32))
    b.add_output(b.make_node("Decode", ["w4"], ["y"], domain="olv"))
    with pytest.raises(StandardExportError, match=r"'w4'.*opset 21.*imports 19"):
        export_standard(b)


def test_external_affine_payload_stays_external(tmp_path):
    b = GraphBuilder("g", opsets={"": 23, "olv": 1})
    b.make_encoded_initializer(_affine_value("w", TensorProto.INT4, (64, 64), 1, 32))
    b.add_output(b.make_node("Decode", ["w"], ["y"], domain="olv"))
    src = tmp_path / "m.onnx"
    olv_runtime.save(b.to_model(), src, external_data=True, threshold=1)
    std = export_standard(src)
    codes = {t.name: t for t in std.graph.initializer}["w"]
    ev = olv_runtime.load(src).graph.encoded_initializer[0]
    assert codes.data_location == TensorProto.EXTERNAL
    assert list(codes.external_data) == list(ev.external_data)
    out = tmp_path / "std" / "std.onnx"
    olv_runtime.save(std, out, external_data=True, threshold=1)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {})[0], olv_runtime.decode_value(src, "w"))


# -------------------------------------------------------------------- struct-encoded values
def test_codebook_struct_weight_runs_in_onnxruntime():
    rng = np.random.default_rng(1)
    records = 8  # 8 blocks of 32 -> a [4, 64] weight
    idx = rng.integers(0, 4, size=(records, 32))
    scales = rng.uniform(0.5, 2.0, size=records).astype(np.float32)
    payload = b"".join(pack_codes(idx[r], 2).tobytes() + scales[r].tobytes()
                       for r in range(records))
    b = GraphBuilder("g", opsets={"": 23, "olv": 1})
    b.add_struct_types([X.scaled_codebook2_1102(), X.codebook2_1101()])  # any order
    b.make_encoded_initializer(B.make_struct_encoded("w", 1102, payload, ("FLOAT", [256])))
    x = b.add_input("x", "FLOAT", [2, 64])
    wd = b.make_node("Decode", ["w"], ["w_flat"], domain="olv")
    w2 = b.make_node("Reshape", [wd, b.make_initializer("shape", np.array([4, 64]))], ["w2"])
    wt = b.make_node("Transpose", [w2], ["wt"], perm=[1, 0])
    b.add_output(b.make_node("MatMul", [x, wt], ["y"]))
    b.add_output(wd)
    model = b.to_model()
    std = export_standard(model)
    names = {t.name for t in std.graph.initializer}
    assert {"w::quantized.codes.index", "w::quantized.codebook", "w::scale"} <= names
    sess = ort_session(std)
    xv = rng.standard_normal((2, 64)).astype(np.float32)
    got = ort_run(sess, {"x": xv})
    decoded = olv_runtime.decode_value(model, "w")
    np.testing.assert_array_equal(got["w_flat"], decoded)  # equals olv_runtime's decode
    want = X.codebook2_1101().structure.field[1].constant
    table = np.frombuffer(want.raw_data, np.float32)
    np.testing.assert_array_equal(decoded, (scales[:, None] * table[idx]).reshape(-1))
    ref = olv_runtime.InferenceSession(model).run(["y"], {"x": xv})[0]
    np.testing.assert_allclose(got["y"], ref, rtol=1e-6, atol=1e-6)


def test_struct_without_function_decoder_fails_naming_the_value():
    from olv_runtime.decoding import register_native_decoder, unregister_native_decoder

    b = GraphBuilder("g", opsets={"": 23, "olv": 1})
    b.add_struct_type(X.int4_block_2001())
    register_native_decoder(2001, lambda v: np.zeros(32, np.float32), lambda root: None, "test")
    try:
        b.make_encoded_initializer(B.make_struct_encoded("blk", 2001, bytes(20), ("FLOAT", [32])))
        b.add_output(b.make_node("Decode", ["blk"], ["y"], domain="olv"))
        with pytest.raises(StandardExportError, match=r"'blk'.*2001.*no FunctionProto decoder"):
            export_standard(b)
    finally:
        unregister_native_decoder(2001)


def test_struct_typed_graph_input_fails():
    b = GraphBuilder("g", opsets={"": 23})
    b.add_struct_type(X.int4_block_2001())
    b.add_input("cache", B.ref(2001))
    b.add_input("x", "FLOAT", [1])
    b.add_output(b.make_node("Identity", ["x"], ["y"]))
    with pytest.raises(StandardExportError, match="'cache'.*struct type"):
        export_standard(b)
