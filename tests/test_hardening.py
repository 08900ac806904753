"""Issue 11: hostile or careless inputs get a clear OlvError, never a crash or a silent wrong
result (library layer: validator, io, session, state). CLI items: tests/cli/test_cli_hardening.py;
the fuzz test: tests/test_fuzz.py."""
from __future__ import annotations

import math
import os
import pathlib
import shutil

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import (
    AffineLayoutError,
    DeclarationError,
    InvalidArgument,
    ModelFormatError,
    OlvError,
    PayloadError,
    ValidationError,
)
from olv_runtime.proto.helper import make_affine_encoded, make_node, make_tensor_value_info
from olv_runtime.io import Model
from olv_runtime.structs.quantize import pack_codes
from olv_runtime.decoding import resolve
from olv_runtime.structs.catalogue import MAX_NESTING, Catalogue

T = pb.TensorProto


def _decode_model(ev):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.graph.encoded_initializer.append(ev)
    m.graph.node.append(make_node("Decode", [ev.name], ["y"], domain="olv"))
    m.graph.output.append(make_tensor_value_info("y", T.FLOAT, None))
    return Model(m)


@pytest.fixture(scope="module")
def external_model(tmp_path_factory, tiny_qwen2_dir):
    """The tiny Qwen2 converted with every payload >= 1 KiB in model.onnx.data."""
    d = tmp_path_factory.mktemp("ext")
    olv_runtime.convert(tiny_qwen2_dir, d / "model.onnx", external_data=True)
    return d / "model.onnx"


def _copy_model(src: pathlib.Path, dst_dir: pathlib.Path) -> pathlib.Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src.parent.iterdir():
        shutil.copy(f, dst_dir / f.name)
    return dst_dir / src.name


# -- item 2: block_size >= the axis dimension, up to 2**64 - 1 ---------------------------------
@pytest.mark.parametrize("block", [64, 65, 1000, 2**31, 2**63, 2**64 - 1])
def test_block_size_beyond_axis_dim_is_one_block(block):
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, size=(4, 64))
    scale = np.ones((4, 1), np.float32)
    ev = make_affine_encoded("w", pack_codes(codes, 4).tobytes(), T.INT4, (4, 64), scale,
                             None, axis=1, block_size=64)
    ev.affine.block_size = block  # uint64 on the wire
    got = olv_runtime.decode_value(_decode_model(ev), "w")
    np.testing.assert_array_equal(got, codes.astype(np.float32))
    (y,) = olv_runtime.InferenceSession(_decode_model(ev)).run(None, {})
    np.testing.assert_array_equal(y, codes.astype(np.float32))
    # ceil(64 / block) = 1 scale column; two columns is still an error
    ev.affine.scale.dims[:] = [4, 2]
    ev.affine.scale.raw_data = np.ones((4, 2), np.float32).tobytes()
    with pytest.raises(AffineLayoutError, match=r"blocked scale must have shape \[4, 1\]"):
        resolve(_decode_model(ev))


def test_kernel_block_size_beyond_k_does_not_wrap():
    from olv_runtime.kernels import affine

    codes = np.arange(-8, 8).reshape(2, 8) % 16 - 8
    payload = pack_codes(codes, 4)
    y = affine.dequantize_affine(payload, 4, True, (2, 8), np.ones((2, 1), np.float32),
                                 axis=1, block_size=2**63 + 5)
    np.testing.assert_array_equal(y, codes.astype(np.float32))
    rows = affine.gather_rows_int4(payload, np.ones((2, 1), np.float32), None, 2, 8, 2**63,
                                   np.array([1, 0]))
    np.testing.assert_array_equal(rows, codes[[1, 0]].astype(np.float32))


# -- item 3: per-layer past lengths must agree ---------------------------------------------------
def test_past_lengths_that_disagree_are_rejected(external_model):
    sess = olv_runtime.InferenceSession(olv_runtime.load(external_model))
    cache = olv_runtime.empty_cache(sess)
    bad = dict(cache)
    bad["past_key.0"] = np.zeros((1, 2, 5, 16), np.float32)
    bad["past_value.0"] = np.zeros((1, 2, 5, 16), np.float32)
    with pytest.raises(InvalidArgument, match=r"past_sequence.*5 vs 0|past_sequence.*0 vs 5"):
        olv_runtime.make_state(sess, bad)
    feeds = dict(bad, input_ids=np.array([[1]], np.int64))
    with pytest.raises(InvalidArgument, match="past_sequence"):
        sess.run(None, feeds)
    state = olv_runtime.make_state(sess, cache)
    with pytest.raises(InvalidArgument, match="past_sequence"):
        state.reset(bad)
    out = state.run({"input_ids": np.array([[1, 2]], np.int64)})  # state still works
    assert out["present_key.0"].shape[2] == out["present_key.1"].shape[2] == 2


# -- item 4: external data changed under a live session ------------------------------------------
@pytest.mark.parametrize("change", ["truncate", "zero_in_place", "replace", "remove"])
def test_changed_external_data_raises_payload_error(tmp_path, external_model, change):
    path = _copy_model(external_model, tmp_path / "m")
    data = path.with_name(path.name + ".data")
    sess = olv_runtime.InferenceSession(olv_runtime.load(path))
    ids = {"input_ids": np.array([[1, 2]], np.int64)}
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    state.run(ids)
    st = data.stat()
    if change == "truncate":
        os.truncate(data, st.st_size // 2)
    elif change == "zero_in_place":
        with open(data, "r+b") as fh:
            fh.write(b"\0" * 4096)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse clocks
    elif change == "replace":
        tmp = data.with_name("x.tmp")
        shutil.copy(data, tmp)
        os.replace(tmp, data)
    else:
        data.unlink()
    with pytest.raises(PayloadError, match=r"model\.onnx\.data"):
        state.run({"input_ids": np.array([[3]], np.int64)})
    with pytest.raises(PayloadError, match=r"model\.onnx\.data"):
        sess.run(None, dict(olv_runtime.empty_cache(sess), **ids))


# -- item 5: deep catalogue nesting -------------------------------------------------------------
def _u8():
    tp = pb.TypeProto()
    tp.tensor_type.elem_type = T.UINT8
    tp.tensor_type.shape.SetInParent()
    return tp


def _ref_chain(n: int) -> list:
    decls = []
    for i in range(1, n + 1):
        st = pb.StructTypeProto(type_id=i, name=f"t{i}")
        f = st.structure.field.add(name="x")
        if i == n:
            f.type.CopyFrom(_u8())
        else:
            f.type.struct_type.type_ref = i + 1
        decls.append(st)
    return decls


def test_type_ref_chain_1000_from_a_file(tmp_path):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.struct_types.extend(_ref_chain(1000))
    m.graph.name = "g"
    path = tmp_path / "deep.onnx"
    path.write_bytes(m.SerializeToString())
    with pytest.raises(DeclarationError, match=f"deeper than {MAX_NESTING}"):
        resolve(olv_runtime.load(path))
    Catalogue(_ref_chain(MAX_NESTING // 2))  # a chain within the limit resolves


def _nested_inline(depth: int) -> pb.StructTypeProto:
    st = pb.StructTypeProto(type_id=1, name="root")
    cur = st
    for _ in range(depth):
        f = cur.structure.field.add(name="x")
        cur = f.type.struct_type
    cur.structure.field.add(name="leaf").type.CopyFrom(_u8())
    return st


@pytest.mark.parametrize("depth", [300, 3000])
def test_inline_structs_nested_deep(depth):
    with pytest.raises(DeclarationError, match=f"deeper than {MAX_NESTING}"):
        Catalogue([_nested_inline(depth)])
    Catalogue([_nested_inline(MAX_NESTING // 3)])


def test_sequence_types_5000_deep_on_a_graph_value():
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    vi = m.graph.input.add(name="x")
    tp = vi.type
    for _ in range(5000):
        tp = tp.sequence_type.elem_type
    tp.tensor_type.elem_type = T.FLOAT
    with pytest.raises(DeclarationError, match=f"deeper than {MAX_NESTING}"):
        resolve(Model(m))
    with pytest.raises(OlvError):
        olv_runtime.InferenceSession(Model(m))


# -- item 6: initializer and logical dims --------------------------------------------------------
@pytest.mark.parametrize("dims", [[-1, -1], [0, -5], [1] * 2_000_000, [2**62, 2**62, 0],
                                  [2**40, 2**40, 0]])
def test_bad_initializer_dims(dims):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    t = m.graph.initializer.add(name="w", data_type=T.FLOAT)
    t.dims.extend(dims)
    t.raw_data = b""
    m.graph.node.append(make_node("Identity", ["w"], ["y"]))
    m.graph.output.append(make_tensor_value_info("y", T.FLOAT, None))
    with pytest.raises(ValidationError, match="tensor 'w'"):
        olv_runtime.InferenceSession(Model(m))


@pytest.mark.parametrize("dims", [[2**40, 2**40, 0], [2**62, 4, 0], [0, -1]])
def test_bad_affine_logical_dims(dims):
    ev = make_affine_encoded("w", b"", T.INT8, [0], np.float32(1.0), None)
    ev.logical_type.tensor_type.shape.ClearField("dim")
    for d in dims:
        ev.logical_type.tensor_type.shape.dim.add(dim_value=d)
    with pytest.raises(AffineLayoutError, match="encoded value 'w'"):
        resolve(_decode_model(ev))


# -- item 7: NUL bytes and invalid UTF-8 -------------------------------------------------------
def _retarget(path: pathlib.Path, key: str, value: str, out: pathlib.Path) -> pathlib.Path:
    m = pb.ModelProto.FromString(path.read_bytes())
    ev = m.graph.encoded_initializer[0]
    for e in ev.external_data:
        if e.key == key:
            e.value = value
            break
    else:
        ev.external_data.add(key=key, value=value)
    out.write_bytes(m.SerializeToString())
    return out


def test_nul_byte_in_external_location(tmp_path, external_model):
    path = _copy_model(external_model, tmp_path / "m")
    bad = _retarget(path, "location", "model.onnx.data\0x", tmp_path / "m" / "nul.onnx")
    with pytest.raises(PayloadError, match="NUL byte"):
        olv_runtime.InferenceSession(olv_runtime.load(bad))


def test_invalid_utf8_node_name(tmp_path, external_model):
    raw = external_model.read_bytes()
    m = pb.ModelProto.FromString(raw)
    name = m.graph.node[0].name.encode()
    bad = raw.replace(name, b"\xff" * len(name), 1)
    path = tmp_path / "utf8.onnx"
    path.write_bytes(bad)
    with pytest.raises(ModelFormatError, match=r"graph\.node\[0\]\.name is not valid UTF-8"):
        olv_runtime.load(path)


# -- item 8: offset/length ASCII decimal, offset past EOF ---------------------------------------
@pytest.mark.parametrize("key,value", [("offset", "6_4"), ("offset", "\u0666\u0664"),
                                       ("offset", " 0 "), ("length", "+64"), ("length", "1e3"),
                                       ("offset", "--0"), ("length", "")])
def test_external_offset_length_ascii_decimal_only(tmp_path, external_model, key, value):
    path = _copy_model(external_model, tmp_path / "m")
    bad = _retarget(path, key, value, tmp_path / "m" / "bad.onnx")
    with pytest.raises(PayloadError, match="ASCII decimal digits"):
        olv_runtime.InferenceSession(olv_runtime.load(bad))


def test_external_offset_past_eof_without_length(tmp_path, external_model):
    path = _copy_model(external_model, tmp_path / "m")
    m = pb.ModelProto.FromString(path.read_bytes())
    t = next(t for t in m.graph.initializer if t.name == "model.norm.weight")
    size = path.with_name(path.name + ".data").stat().st_size
    t.ClearField("raw_data")
    t.data_location = T.EXTERNAL
    t.external_data.add(key="location", value="model.onnx.data")
    t.external_data.add(key="offset", value=str(size + 100))  # no length: "to the end"
    bad = tmp_path / "m" / "eof.onnx"
    bad.write_bytes(m.SerializeToString())
    with pytest.raises(PayloadError, match="past the end"):
        olv_runtime.InferenceSession(olv_runtime.load(bad))


# -- item 9: kv_growth --------------------------------------------------------------------------
@pytest.mark.parametrize("growth", [math.inf, -math.inf, math.nan, 1.0, 0.5, -2.0, "x", None])
def test_kv_growth_must_be_finite_above_one(growth):
    with pytest.raises(InvalidArgument, match="kv_growth"):
        olv_runtime.SessionOptions(kv_growth=growth)
    olv_runtime.SessionOptions(kv_growth=1.5)


# -- item 10: seed ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 1.5, "1", True, 2**200])
def test_generate_seed_validation(external_model, seed):
    sess = olv_runtime.InferenceSession(olv_runtime.load(external_model))
    with pytest.raises(InvalidArgument, match="seed"):
        olv_runtime.generate(sess, [1, 2], 2, temperature=1.0, seed=seed)


# -- item 19: state.run follows ONNX Gather for negative ids; generate does not ----------------
def test_negative_token_ids_state_vs_generate(external_model):
    sess = olv_runtime.InferenceSession(olv_runtime.load(external_model))
    vocab = int(sess.get_modelmeta()["olv.vocab_size"])
    a = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    b = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    la = a.run({"input_ids": np.array([[-1]], np.int64)})["logits"]
    lb = b.run({"input_ids": np.array([[vocab - 1]], np.int64)})["logits"]
    np.testing.assert_array_equal(la, lb)  # documented: Gather counts negatives from the end
    with pytest.raises(InvalidArgument, match=r"token ids must be in \[0, 128\), got -1"):
        olv_runtime.generate(sess, [-1], 1)
    assert "negative" in (olv_runtime.State.run.__doc__ or "")
    with pytest.raises(InvalidArgument, match="index|indices|ids"):
        a.run({"input_ids": np.array([[-vocab - 1]], np.int64)})


# -- found by the fuzz test (tests/test_fuzz.py) ------------------------------------------------
def _model_with(nodes, outputs=("y",), inputs=()):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.graph.node.extend(nodes)
    m.graph.input.extend(inputs)
    for o in outputs:
        m.graph.output.append(make_tensor_value_info(o, T.FLOAT, None))
    return Model(m)


def test_node_input_count_checked_at_session_creation():
    with pytest.raises(ValidationError, match=r"\(Decode\): expected 1 inputs, got 0"):
        olv_runtime.InferenceSession(_model_with([make_node("Decode", [], ["y"], domain="olv")]))
    x = make_tensor_value_info("x", T.FLOAT, [2])
    with pytest.raises(ValidationError, match=r"input #0 is required but its name is empty"):
        olv_runtime.InferenceSession(_model_with([make_node("Add", ["", "x"], ["y"])], inputs=[x]))


def test_node_output_count_checked_against_the_schema():
    x = make_tensor_value_info("x", T.FLOAT, [2])
    with pytest.raises(ValidationError, match=r"declares 2 outputs.*allows 1 to 1"):
        olv_runtime.InferenceSession(_model_with([make_node("Add", ["x", "x"], ["y", "z"])],
                                                 inputs=[x]))


def test_negative_declared_input_dim():
    x = make_tensor_value_info("x", T.FLOAT, [2])
    x.type.tensor_type.shape.dim[0].dim_value = -1
    with pytest.raises(ValidationError, match=r"'x': declared dimension 0 is negative"):
        olv_runtime.InferenceSession(_model_with([make_node("Identity", ["x"], ["y"])],
                                                 inputs=[x]))


def test_invalid_utf8_through_an_onnx_modelproto():
    import onnx
    from onnx import helper as oh

    g = oh.make_graph([oh.make_node("Relu", ["x"], ["y"], name="ab")], "g",
                      [oh.make_tensor_value_info("x", 1, [2])],
                      [oh.make_tensor_value_info("y", 1, [2])])
    raw = oh.make_model(g).SerializeToString().replace(b"ab", b"\xff\xfe")
    with pytest.raises(ModelFormatError, match=r"graph\.node\[0\]\.name is not valid UTF-8"):
        olv_runtime.InferenceSession(onnx.ModelProto.FromString(raw))
