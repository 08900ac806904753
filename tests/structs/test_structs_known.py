"""Seed 000 known answers: record sizes, record counts, decoded values, decoders in graphs,
native decoders, decode_value / to_decoded, olv inspect."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.cli import main as cli_main
from olv_runtime.errors import (
    DecoderBindingError,
    DecoderError,
    InvalidArgument,
    MissingDecoderError,
    RecordCountError,
    UnsupportedOperatorError,
)
from olv_runtime.proto.helper import make_node, make_tensor, make_tensor_value_info
from olv_runtime.io import Model
from olv_runtime.decoding import register_native_decoder, resolve, unregister_native_decoder
from olv_runtime.structs import StructValue
from olv_runtime.structs import build as B
from olv_runtime.structs import examples as X

T = pb.TensorProto
CODEBOOK = np.array([-1.0, -0.25, 0.25, 1.0], np.float32)


def make_model(struct_types, encoded, nodes=(), outputs=(), inputs=(), inits=()):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.struct_types.extend(struct_types)
    m.graph.encoded_initializer.extend(encoded)
    m.graph.node.extend(nodes)
    m.graph.output.extend(outputs)
    m.graph.input.extend(inputs)
    m.graph.initializer.extend(inits)
    return Model(m)


def pack(codes, bits):
    """Independent LSB-first packer (python ints)."""
    acc = 0
    for i, c in enumerate(codes):
        acc |= (int(c) & ((1 << bits) - 1)) << (i * bits)
    n = (len(codes) * bits + 7) // 8
    return acc.to_bytes(n, "little")


def decode_graph(name, logical_shape):
    return ([make_node("Decode", [name], ["y"], name="dec", domain="olv")],
            [make_tensor_value_info("y", T.FLOAT, list(logical_shape))])


# -- Int4Block 2001 ------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes,records", [(2560, 128), (5120, 256), (0, 0)])
def test_int4_block_record_counts(nbytes, records):
    ev = B.make_struct_encoded("w", 2001, bytes(nbytes), ("FLOAT", [records * 32]))
    v = resolve(make_model([X.int4_block_2001()], [ev])).values["w"]
    assert v.record_bytes == 20 and v.layout.bits == 160
    assert v.records == records
    assert v.field("codes").shape == (records, 32)
    assert v.field("scale").shape == (records,)


def test_int4_block_30_bytes_rejected():
    ev = B.make_struct_encoded("w", 2001, bytes(30), ("FLOAT", [32]))
    with pytest.raises(RecordCountError, match=r"'w'.*2001.*30.*20-byte records.*1 records \+ 10"):
        resolve(make_model([X.int4_block_2001()], [ev]))


def _int4_block_payload(rng, records):
    codes = rng.integers(-8, 8, size=(records, 32))
    scales = rng.standard_normal(records).astype(np.float32)
    payload = b"".join(pack(codes[r], 4) + struct.pack("<f", scales[r]) for r in range(records))
    return codes, scales, payload


def _native_2001(value):
    codes = value.field("codes").astype(np.float32)  # [records, 32] int8
    return (codes * value.field("scale")[:, None]).reshape(-1)


def _verify_2001(root):
    sig = root.layout.signature()
    want = {"codes": (T.INT4, 4, (32,), 0), "scale": (T.FLOAT, 32, (), 128)}
    if sig["bits"] != 160 or sig["leaves"] != want or sig["constants"]:
        return f"layout {sig} is not Int4Block"
    return None


@pytest.fixture
def native_2001():
    register_native_decoder(2001, _native_2001, _verify_2001, name="int4_block")
    yield
    unregister_native_decoder(2001)


def test_two_values_share_a_type_with_different_lengths_round_trip(tmp_path, native_2001):
    rng = np.random.default_rng(0)
    c1, s1, p1 = _int4_block_payload(rng, 128)
    c2, s2, p2 = _int4_block_payload(rng, 256)
    evs = [B.make_struct_encoded("a", 2001, p1, ("FLOAT", [4096])),
           B.make_struct_encoded("b", 2001, p2, ("FLOAT", [8192]))]
    path = tmp_path / "m.onnx"
    olv_runtime.save(make_model([X.int4_block_2001()], evs), path)
    back = olv_runtime.load(path)
    r = resolve(back)
    assert [r.values[n].records for n in "ab"] == [128, 256]
    for name, codes, scales in (("a", c1, s1), ("b", c2, s2)):
        v = r.values[name]
        np.testing.assert_array_equal(v.field("codes"), codes)
        np.testing.assert_array_equal(v.field("scale"), scales)
        want = (codes.astype(np.float32) * scales[:, None]).reshape(-1)
        np.testing.assert_array_equal(olv_runtime.decode_value(back, name), want)


def test_native_decoder_rejecting_the_declaration(native_2001):
    other = B.declare(2001, "NotInt4Block", B.structure(B.field("scale", B.scalar("FLOAT"))))
    ev = B.make_struct_encoded("w", 2001, bytes(4), ("FLOAT", [1]))
    with pytest.raises(DecoderBindingError, match=r"'w'.*int4_block.*type_id 2001.*rejected"):
        resolve(make_model([other], [ev]))


def test_native_decoder_rejected_falls_back_to_function_decoder():
    register_native_decoder(1003, lambda v: None, lambda root: "not mine", name="other")
    try:
        ev = B.make_struct_encoded("w", 1003, bytes(64), ("FLOAT", [128]))
        v = resolve(make_model([X.linear_int4_fixed_1003()], [ev])).values["w"]
        assert v.decoder.kind.startswith("function")
        np.testing.assert_array_equal(v.decode(), np.full(128, 0.5, np.float32))
    finally:
        unregister_native_decoder(1003)


def test_native_decoder_wrong_result_shape_is_an_error(native_2001):
    ev = B.make_struct_encoded("w", 2001, bytes(40), ("FLOAT", [32]))  # 2 records -> 64 values
    model = make_model([X.int4_block_2001()], [ev])
    with pytest.raises(DecoderError, match=r"float32 \[64\].*FLOAT \[32\].*2 records"):
        olv_runtime.decode_value(model, "w")


# -- 1003 / 1002 -------------------------------------------------------------------------------
def test_1003_fixed_parameters():
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, size=128)
    ev_a = B.make_struct_encoded("weight_a", 1003, pack(codes, 4), ("FLOAT", [128]))
    ev_b = B.make_struct_encoded("weight_b", 1003, pack(codes[::-1], 4), ("FLOAT", [128]))
    model = make_model([X.linear_int4_fixed_1003()], [ev_a, ev_b])
    r = resolve(model)
    a = r.values["weight_a"]
    assert a.record_bytes == 64 and a.records == 1
    assert a.field("scale").shape == () and a.field("zero_point").tolist() == -2
    np.testing.assert_array_equal(a.field("values")[0], codes)
    want = ((codes + 2) * 0.25).astype(np.float32)
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "weight_a"), want)
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "weight_b"), want[::-1])


def _payload_1002(codes, scale, zp):
    return pack(codes, 4) + struct.pack("<f", scale) + struct.pack("<q", zp)


def test_1002_per_value_parameters_unaligned_int64():
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, size=128)
    evs = [B.make_struct_encoded("v1", 1002, _payload_1002(codes, 0.125, 0), ("FLOAT", [128])),
           B.make_struct_encoded("v2", 1002, _payload_1002(codes, 0.25, -2), ("FLOAT", [128]))]
    model = make_model([X.linear_int4_params_1002()], evs)
    v2 = resolve(model).values["v2"]
    assert v2.record_bytes == 76
    zp_leaf = v2.layout.leaf("zero_point")
    assert (zp_leaf.offset, zp_leaf.bits, zp_leaf.signed) == (68 * 8, 64, True)
    zp = v2.field("zero_point")  # a zero-copy view at byte offset 68: not 8-byte aligned
    assert np.shares_memory(zp, v2.payload) and zp.tolist() == [-2]
    assert v2.field("zero_point", copy=True).tolist() == [-2]  # numba unaligned read
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "v1"),
                                  (codes * 0.125).astype(np.float32))
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "v2"),
                                  ((codes + 2) * 0.25).astype(np.float32))


def test_changed_constant_under_a_new_id_coexists():
    codes = np.arange(-8, 8).repeat(8)
    types = [X.linear_int4_fixed_1003(), X.linear_int4_fixed_1003(0.5, 1, type_id=1004)]
    evs = [B.make_struct_encoded("old", 1003, pack(codes, 4), ("FLOAT", [128])),
           B.make_struct_encoded("new", 1004, pack(codes, 4), ("FLOAT", [128]))]
    model = make_model(types, evs)
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "old"),
                                  ((codes + 2) * 0.25).astype(np.float32))
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "new"),
                                  ((codes - 1) * 0.5).astype(np.float32))


# -- 1101 / 1102 codebook --------------------------------------------------------------------------
E4_PAYLOAD = bytes([0xE4] * 8 + [0x00, 0x00, 0x00, 0x40])


def test_codebook_sizes_and_known_payload_in_a_graph():
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    nodes, outs = decode_graph("w", [32])
    model = make_model([X.codebook2_1101(), X.scaled_codebook2_1102()], [ev], nodes, outs)
    r = resolve(model)
    assert r.catalogue.layout(1101).record_bytes == 8
    v = r.values["w"]
    assert (v.record_bytes, v.records) == (12, 1)
    np.testing.assert_array_equal(v.field("quantized.codes.index")[0], [0, 1, 2, 3] * 8)
    np.testing.assert_array_equal(v.field("quantized.codebook"), CODEBOOK)
    sess = olv_runtime.InferenceSession(model)
    (y,) = sess.run(None, {})
    np.testing.assert_array_equal(y, np.array([-2.0, -0.5, 0.5, 2.0] * 8, np.float32))
    assert sess.counters["bytes_dequantized"] == 32 * 4


def test_codebook_1536_bytes_is_128_records_flattened_in_storage_order():
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 4, size=(128, 32))
    scales = rng.uniform(0.5, 2.0, 128).astype(np.float32)
    payload = b"".join(pack(idx[b], 2) + struct.pack("<f", scales[b]) for b in range(128))
    assert len(payload) == 1536
    ev = B.make_struct_encoded("w", 1102, payload, ("FLOAT", [4096]))
    model = make_model([X.scaled_codebook2_1102(), X.codebook2_1101()], [ev])
    v = resolve(model).values["w"]
    assert v.records == 128
    want = (scales[:, None] * CODEBOOK[idx]).reshape(-1)
    np.testing.assert_array_equal(olv_runtime.decode_value(model, "w"), want)


def test_codebook_decoder_matches_onnx_reference_on_the_same_function():
    """The FunctionProto decoder run by olv equals onnx.reference running the same nodes."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    fn = X.decode_scaled_codebook()
    rng = np.random.default_rng(4)
    feeds = {"quantized.codes.index": rng.integers(0, 4, (5, 32)).astype(np.uint8),
             "quantized.codebook": CODEBOOK, "scale": rng.standard_normal(5).astype(np.float32)}
    payload = b"".join(pack(feeds["quantized.codes.index"][b], 2)
                       + struct.pack("<f", feeds["scale"][b]) for b in range(5))
    ev = B.make_struct_encoded("w", 1102, payload, ("FLOAT", [160]))
    ours = olv_runtime.decode_value(make_model([X.codebook2_1101(), X.scaled_codebook2_1102()],
                                               [ev]), "w")
    g = onnx.helper.make_graph(
        [onnx.NodeProto.FromString(n.SerializeToString()) for n in fn.node], "g",
        [onnx.helper.make_tensor_value_info(k, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), None)
         for k, v in feeds.items()],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    ref = ReferenceEvaluator(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 21)]))
    np.testing.assert_array_equal(ours, ref.run(None, feeds)[0])


def test_catalogue_reordering_changes_nothing():
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    decls = X.seed_catalogue()
    a = resolve(make_model(decls, [ev]))
    b = resolve(make_model(decls[::-1], [ev]))
    assert a.values["w"].layout == b.values["w"].layout
    for tid in a.catalogue.ids():
        assert a.catalogue.layout(tid) == b.catalogue.layout(tid)
    np.testing.assert_array_equal(a.values["w"].decode(), b.values["w"].decode())


# -- decoders and sessions --------------------------------------------------------------------------
def test_missing_decoder_fails_at_session_creation_not_at_load(tmp_path):
    ev = B.make_struct_encoded("w", 1101, bytes(8), ("FLOAT", [32]))
    nodes, outs = decode_graph("w", [32])
    path = tmp_path / "m.onnx"
    olv_runtime.save(make_model([X.codebook2_1101()], [ev], nodes, outs), path)
    model = olv_runtime.load(path)  # fine: loading never needs a decoder
    v = resolve(model).values["w"]  # fine: not consumed yet
    assert v.decoder is None
    with pytest.raises(MissingDecoderError, match=r"'dec'.*'w'.*type_id 1101.*no decoder"):
        olv_runtime.InferenceSession(model)
    with pytest.raises(MissingDecoderError, match="'w'"):
        olv_runtime.decode_value(model, "w")


def test_unconsumed_value_without_decoder_does_not_block_a_session():
    ev = B.make_struct_encoded("w", 1101, bytes(8), None)
    x = make_tensor_value_info("x", T.FLOAT, [2])
    model = make_model([X.codebook2_1101()], [ev], [make_node("Neg", ["x"], ["y"])],
                       [make_tensor_value_info("y", T.FLOAT, [2])], [x])
    sess = olv_runtime.InferenceSession(model)
    np.testing.assert_array_equal(sess.run(None, {"x": np.ones(2, np.float32)})[0], [-1, -1])


def test_tensor_only_op_given_a_struct_value_fails():
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    model = make_model([X.codebook2_1101(), X.scaled_codebook2_1102()], [ev],
                       [make_node("Neg", ["w"], ["y"], name="neg")],
                       [make_tensor_value_info("y", T.FLOAT, [32])])
    with pytest.raises(MissingDecoderError, match=r"'neg'.*tensor-only.*'w'.*olv.Decode"):
        olv_runtime.InferenceSession(model)


def test_tensor_only_op_given_a_structured_graph_input_fails():
    vi = pb.ValueInfoProto(name="cache")
    vi.type.struct_type.type_ref = 1102
    model = make_model([X.codebook2_1101(), X.scaled_codebook2_1102()], [],
                       [make_node("Neg", ["cache"], ["y"], name="neg")],
                       [make_tensor_value_info("y", T.FLOAT, [32])], [vi])
    with pytest.raises(MissingDecoderError, match=r"'neg'.*structured graph input"):
        olv_runtime.InferenceSession(model)


def test_decoded_value_feeds_standard_ops():
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    x = make_tensor_value_info("x", T.FLOAT, [32])
    nodes = [make_node("Decode", ["w"], ["wf"], domain="olv"), make_node("Mul", ["x", "wf"], ["y"])]
    model = make_model([X.codebook2_1101(), X.scaled_codebook2_1102()], [ev], nodes,
                       [make_tensor_value_info("y", T.FLOAT, [32])], [x])
    (y,) = olv_runtime.InferenceSession(model).run(None, {"x": np.full(32, 2, np.float32)})
    np.testing.assert_array_equal(y, np.array([-4.0, -1.0, 1.0, 4.0] * 8, np.float32))


def _bad_decoder_model(fn, logical=("FLOAT", [32])):
    d = X.scaled_codebook2_1102()
    d.decoder.CopyFrom(fn)
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, logical)
    return make_model([X.codebook2_1101(), d], [ev])


def test_decoder_function_errors_at_resolution():
    fn = X.decode_scaled_codebook()
    bad_input = pb.FunctionProto()
    bad_input.CopyFrom(fn)
    bad_input.input[2] = "scales"
    with pytest.raises(DecoderError, match=r"input 'scales' is not a leaf or constant path.*'scale'"):
        resolve(_bad_decoder_model(bad_input))
    two_out = pb.FunctionProto()
    two_out.CopyFrom(fn)
    two_out.output.append("idx")
    with pytest.raises(DecoderError, match="exactly one output"):
        resolve(_bad_decoder_model(two_out))
    bad_op = pb.FunctionProto()
    bad_op.CopyFrom(fn)
    bad_op.node[1].op_type = "NonMaxSuppression"
    with pytest.raises(UnsupportedOperatorError, match="NonMaxSuppression"):
        resolve(_bad_decoder_model(bad_op))
    undefined = pb.FunctionProto()
    undefined.CopyFrom(fn)
    undefined.node[4].input[0] = "nowhere"
    with pytest.raises(DecoderError, match="'nowhere'"):
        resolve(_bad_decoder_model(undefined))


def test_decoder_result_must_be_exactly_the_logical_type():
    model = _bad_decoder_model(X.decode_scaled_codebook(), logical=("FLOAT", [4, 8]))
    with pytest.raises(DecoderError, match=r"produced float32 \[32\].*FLOAT \[4, 8\]"):
        olv_runtime.decode_value(model, "w")


def test_nested_subtype_decoder_is_not_used():
    sub = X.codebook2_1101()
    sub.decoder.CopyFrom(X.decode_scaled_codebook())  # would need 'scale': invalid for 1101 itself
    parent = X.scaled_codebook2_1102()
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    np.testing.assert_array_equal(
        olv_runtime.decode_value(make_model([sub, parent], [ev]), "w"),
        np.array([-2.0, -0.5, 0.5, 2.0] * 8, np.float32))


# -- decode_value / to_decoded ---------------------------------------------------------------------
def test_to_decoded_runs_side_by_side():
    rng = np.random.default_rng(5)
    from olv_runtime.proto.helper import make_affine_encoded
    from olv_runtime.structs.quantize import quantize_int4_blockwise

    w = rng.standard_normal((8, 64)).astype(np.float32)
    codes, scale = quantize_int4_blockwise(w)
    aff = make_affine_encoded("W", codes.tobytes(), T.INT4, [8, 64], scale, None, axis=1,
                              block_size=32)
    cb = B.make_struct_encoded("C", 1102, E4_PAYLOAD * 2, ("FLOAT", [64]))
    x = make_tensor_value_info("x", T.FLOAT, [1, 64])
    nodes = [make_node("Decode", ["W"], ["Wf"], domain="olv"),
             make_node("Transpose", ["Wf"], ["Wt"], perm=[1, 0]),
             make_node("Decode", ["C"], ["Cf"], domain="olv"),
             make_node("Mul", ["x", "Cf"], ["xc"]),
             make_node("MatMul", ["xc", "Wt"], ["y"])]
    model = make_model([X.codebook2_1101(), X.scaled_codebook2_1102()], [aff, cb], nodes,
                       [make_tensor_value_info("y", T.FLOAT, [1, 8])], [x],
                       [make_tensor("unused", np.ones(3, np.float32))])
    dense = olv_runtime.to_decoded(model)
    g = dense.proto.graph
    assert len(g.encoded_initializer) == 0
    assert {t.name for t in g.initializer} == {"unused", "W", "C"}
    assert [n.op_type for n in g.node] == ["Identity", "Transpose", "Identity", "Mul", "MatMul"]
    assert len(dense.proto.struct_types) == 2
    np.testing.assert_array_equal(olv_runtime.InferenceSession(dense).model.payload(g.initializer[1])
                                  .view(np.float32).reshape(8, 64),
                                  olv_runtime.decode_value(model, "W"))
    xv = rng.standard_normal((1, 64)).astype(np.float32)
    (y_enc,) = olv_runtime.InferenceSession(model).run(None, {"x": xv})
    (y_dense,) = olv_runtime.InferenceSession(dense).run(None, {"x": xv})
    np.testing.assert_allclose(y_enc, y_dense, rtol=1e-5, atol=1e-5)
    assert len(model.proto.graph.encoded_initializer) == 2  # the original is unchanged


def test_decode_value_unknown_name():
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    with pytest.raises(InvalidArgument, match=r"'nope'.*\['w'\]"):
        olv_runtime.decode_value(make_model(X.seed_catalogue(), [ev]), "nope")


def test_inspect_lists_catalogue_and_values(tmp_path, capsys):
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD * 128, ("FLOAT", [4096]))
    path = tmp_path / "m.onnx"
    olv_runtime.save(make_model(X.seed_catalogue(), [ev]), path)
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "type_id 2001 'Int4Block': structure, record 20 bytes" in out
    assert "zero_point: INT64 (64 bits each, signed) at bit 544" in out
    assert "type_id 1102 'SCALED_CODEBOOK2_BLOCK_32': structure, record 12 bytes" in out
    assert "quantized.codes.index: UINT8[32] (2 bits each, unsigned) at bit 0 strides [2]" in out
    assert "quantized.codebook: constant FLOAT[4] = [-1.0, -0.25, 0.25, 1.0]" in out
    assert ("w: struct type_id 1102 ('SCALED_CODEBOOK2_BLOCK_32'), payload 1536 bytes, 128 "
            "records of 12 bytes") in out
    assert "logical FLOAT[4096]" in out


def test_inspect_reports_invalid_model(tmp_path, capsys):
    ev = B.make_struct_encoded("w", 1102, bytes(13), ("FLOAT", [32]))
    path = tmp_path / "m.onnx"
    olv_runtime.save(make_model(X.seed_catalogue(), [ev]), path)
    assert cli_main(["inspect", str(path)]) == 2
    assert "13" in capsys.readouterr().err


def test_struct_value_repr_and_fields():
    ev = B.make_struct_encoded("w", 1102, E4_PAYLOAD, ("FLOAT", [32]))
    v = resolve(make_model(X.seed_catalogue(), [ev])).values["w"]
    assert isinstance(v, StructValue) and "records=1" in repr(v)
    assert set(v.fields()) == {"quantized.codes.index", "scale", "quantized.codebook"}
    with pytest.raises(KeyError, match="paths"):
        v.field("codes")
