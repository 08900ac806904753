"""Wire format: our proto vs onnx's, extension fields through onnx, load/save, external data."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnx.helper as oh
import onnx.onnx_ml_pb2 as onnx_pb
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import ModelFormatError, PayloadError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_bindings_are_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _messages(desc):
    yield desc
    for nested in desc.nested_types:
        yield from _messages(nested)


def test_every_onnx_field_has_the_same_number_and_type():
    ours = pb.pb.DESCRIPTOR
    checked = 0
    for top in onnx_pb.DESCRIPTOR.message_types_by_name.values():
        for d in _messages(top):
            rel = d.full_name[len("onnx."):]
            mine = ours.pool.FindMessageTypeByName("onnx_light." + rel)
            for f in d.fields:
                g = mine.fields_by_name.get(f.name)
                assert g is not None, f"{rel}.{f.name} missing"
                assert g.number == f.number, (rel, f.name)
                assert g.type == f.type, (rel, f.name)
                assert g.is_repeated == f.is_repeated, (rel, f.name)
                if f.message_type is not None:
                    assert g.message_type.full_name[len("onnx_light."):] == \
                        f.message_type.full_name[len("onnx."):], (rel, f.name)
                if f.enum_type is not None:
                    assert g.enum_type.full_name[len("onnx_light."):] == \
                        f.enum_type.full_name[len("onnx."):], (rel, f.name)
                    assert [(v.name, v.number) for v in g.enum_type.values] == \
                        [(v.name, v.number) for v in f.enum_type.values]
                if f.is_repeated and f.type not in (f.TYPE_MESSAGE, f.TYPE_STRING, f.TYPE_BYTES):
                    assert g.is_packed == f.is_packed, (rel, f.name)
                oo = f.containing_oneof
                if oo is not None and not oo.name.startswith("_"):
                    assert g.containing_oneof is not None and g.containing_oneof.name == oo.name
                checked += 1
            # every field we have that onnx lacks is an extension in the reserved range
            for g in mine.fields:
                if g.name not in d.fields_by_name:
                    assert 1000 <= g.number <= 1099, (rel, g.name, g.number)
    assert checked >= 130  # onnx-ml.proto IR 14 has 134 fields


def test_extension_field_numbers():
    assert pb.TypeProto.DESCRIPTOR.fields_by_name["struct_type"].number == 1000
    assert pb.GraphProto.DESCRIPTOR.fields_by_name["encoded_initializer"].number == 1000
    assert pb.GraphProto.DESCRIPTOR.fields_by_name["persistent_bindings"].number == 1001
    assert pb.ModelProto.DESCRIPTOR.fields_by_name["struct_types"].number == 1000
    t = pb.TypeProto()
    t.struct_type.type_ref = 7
    assert t.SerializeToString()[:2] == bytes([0xC2, 0x3E])
    ev = pb.EncodedValueProto.DESCRIPTOR.fields_by_name
    assert [ev[n].number for n in ("affine", "struct_type", "logical_type", "raw_data",
                                   "external_data", "data_location", "name", "doc_string")] == \
        list(range(1, 9))
    af = pb.AffineLayoutProto.DESCRIPTOR.fields_by_name
    assert [af[n].number for n in ("storage_type", "scale", "zero_point", "axis", "block_size")] == \
        [1, 2, 3, 4, 5]
    st = pb.StructTypeProto.DESCRIPTOR.fields_by_name
    assert [st[n].number for n in ("array", "structure", "bit_packing", "type_ref", "decoder",
                                   "encoder", "name", "doc_string", "metadata_props", "type_id")] == \
        list(range(1, 11))
    fld = pb.StructTypeProto.Structure.Field.DESCRIPTOR.fields_by_name
    assert (fld["name"].number, fld["type"].number, fld["doc_string"].number,
            fld["constant"].number) == (1, 2, 3, 4)
    bp = pb.PersistentBindingProto.DESCRIPTOR.fields_by_name
    assert (bp["input_name"].number, bp["output_name"].number) == (1, 2)


def _extended_model() -> pb.ModelProto:
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    st = m.struct_types.add(type_id=2001, name="Int4Block")
    f = st.structure.field.add(name="codes")
    f.type.tensor_type.elem_type = pb.TensorProto.INT4
    f.type.tensor_type.shape.dim.add(dim_value=32)
    f = st.structure.field.add(name="scale")
    f.type.tensor_type.elem_type = pb.TensorProto.FLOAT
    f.type.tensor_type.shape.SetInParent()
    g = m.graph
    g.name = "g"
    ev = g.encoded_initializer.add(name="w")
    ev.struct_type.type_ref = 2001
    ev.logical_type.tensor_type.elem_type = pb.TensorProto.FLOAT
    ev.logical_type.tensor_type.shape.dim.add(dim_value=64)
    ev.raw_data = bytes(range(40))
    x = g.input.add(name="past")
    x.type.tensor_type.elem_type = pb.TensorProto.FLOAT
    x.type.tensor_type.shape.dim.add(dim_param="n")
    s = g.input.add(name="cache")
    s.type.struct_type.type_ref = 2001
    y = g.output.add(name="present")
    y.type.tensor_type.elem_type = pb.TensorProto.FLOAT
    y.type.tensor_type.shape.dim.add(dim_param="n")
    g.node.add(op_type="Identity", input=["past"], output=["present"], name="id")
    g.persistent_bindings.add(input_name="past", output_name="present")
    return m


def test_olv_model_survives_onnx_load_and_save(tmp_path):
    m = _extended_model()
    path = tmp_path / "m.onnx"
    olv_runtime.save(m, path)
    om = onnx.load(str(path))  # the standard package keeps the extension fields as unknown fields
    assert om.graph.node[0].op_type == "Identity"
    assert [i.name for i in om.graph.input] == ["past", "cache"]
    path2 = tmp_path / "m2.onnx"
    onnx.save(om, str(path2))
    back = olv_runtime.load(path2).proto
    assert back == m
    assert back.graph.persistent_bindings[0].output_name == "present"
    assert back.struct_types[0].type_id == 2001
    assert back.graph.encoded_initializer[0].raw_data == bytes(range(40))
    assert back.graph.input[1].type.struct_type.type_ref == 2001


def test_plain_onnx_model_loads_unchanged(tmp_path):
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 3])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 3])
    w = oh.make_tensor("w", onnx.TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    node = oh.make_node("Add", ["x", "w"], ["y"], name="add")
    om = oh.make_model(oh.make_graph([node], "g", [x], [y], [w]),
                       opset_imports=[oh.make_opsetid("", 23)])
    om.metadata_props.add(key="k", value="v")
    path = tmp_path / "plain.onnx"
    onnx.save(om, str(path))
    model = olv_runtime.load(path)
    assert model.proto.SerializeToString() == om.SerializeToString()
    sess = olv_runtime.InferenceSession(model)
    (out,) = sess.run(None, {"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out, np.array([[2, 3, 4], [2, 3, 4]], np.float32))
    # an onnx.ModelProto object is accepted directly too
    (out2,) = olv_runtime.InferenceSession(om).run(["y"], {"x": np.zeros((1, 3), np.float32)})
    np.testing.assert_array_equal(out2, [[1, 2, 3]])


def _dense_model(n: int = 4096) -> pb.ModelProto:
    from olv_runtime.proto.helper import make_node, make_tensor, make_tensor_value_info

    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    g = m.graph
    g.initializer.append(make_tensor("w", np.arange(n, dtype=np.float32)))
    g.initializer.append(make_tensor("small", np.ones(3, np.float32)))
    g.input.append(make_tensor_value_info("x", pb.TensorProto.FLOAT, [n]))
    g.output.append(make_tensor_value_info("y", pb.TensorProto.FLOAT, [n]))
    g.node.append(make_node("Add", ["x", "w"], ["y"], name="add"))
    return m


def test_save_external_data_roundtrip(tmp_path):
    m = _dense_model()
    path = tmp_path / "ext.onnx"
    olv_runtime.save(m, path, external_data=True)
    assert (tmp_path / "ext.onnx.data").stat().st_size >= 4096 * 4
    raw = pb.ModelProto.FromString(path.read_bytes())
    w = raw.graph.initializer[0]
    assert w.data_location == pb.TensorProto.EXTERNAL and not w.HasField("raw_data")
    assert raw.graph.initializer[1].HasField("raw_data")  # below the threshold stays inline
    assert m.graph.initializer[0].HasField("raw_data")  # the caller's model is untouched
    model = olv_runtime.load(path)
    view = model.payload(model.graph.initializer[0])
    assert not view.flags.writeable
    sess = olv_runtime.InferenceSession(model)
    (y,) = sess.run(None, {"x": np.zeros(4096, np.float32)})
    np.testing.assert_array_equal(y, np.arange(4096, dtype=np.float32))
    # onnx reads our external data too
    om = onnx.load(str(path))
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(om.graph.initializer[0]),
                                  np.arange(4096, dtype=np.float32))
    # and back to inline
    path2 = tmp_path / "inline.onnx"
    olv_runtime.save(model, path2, external_data=False)
    assert pb.ModelProto.FromString(path2.read_bytes()).graph.initializer[0].HasField("raw_data")


@pytest.mark.parametrize("location,offset,length,match", [
    ("../evil.data", 0, 16, "escapes"),
    ("/etc/passwd", 0, 16, "relative"),
    ("missing.data", 0, 16, "not found"),
    ("ok.data", 0, 10_000, "past the end"),
])
def test_external_data_errors(tmp_path, location, offset, length, match):
    (tmp_path / "ok.data").write_bytes(bytes(64))
    m = _dense_model(4)
    w = m.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = pb.TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    w.external_data.add(key="offset", value=str(offset))
    w.external_data.add(key="length", value=str(length))
    path = tmp_path / "bad.onnx"
    path.write_bytes(m.SerializeToString())
    model = olv_runtime.load(path)
    with pytest.raises(PayloadError, match=match):
        olv_runtime.InferenceSession(model)


def test_load_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        olv_runtime.load(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\xff\xff\xff\xff not a model")
    with pytest.raises(ModelFormatError, match="not a valid ModelProto"):
        olv_runtime.load(bad)
