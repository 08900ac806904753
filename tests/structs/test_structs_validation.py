"""Every validation rule of seed 000 (catalogue, declarations, byte encoding, payloads, names)
has a negative case here expecting its exception class and a message naming what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import (
    CatalogueError,
    DeclarationError,
    DuplicateNameError,
    DuplicateTypeIdError,
    EncodingError,
    LayoutError,
    OlvError,
    PayloadError,
    RecordCountError,
    SizeOverflowError,
    TypeRefCycleError,
    UnresolvedTypeRefError,
    ValidationError,
)
from olv_runtime.proto.helper import make_tensor, make_tensor_type
from olv_runtime.io import Model
from olv_runtime.structs import build as B
from olv_runtime.structs import examples as X
from olv_runtime.decoding import resolve

T = pb.TensorProto


def model_of(struct_types=(), encoded=(), inputs=(), inits=()):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.struct_types.extend(struct_types)
    m.graph.encoded_initializer.extend(encoded)
    m.graph.input.extend(inputs)
    m.graph.initializer.extend(inits)
    return Model(m)


def simple(type_id=7, name="S", *fields):
    return B.declare(type_id, name, B.structure(*(fields or (B.field("x", B.scalar("FLOAT")),))))


def value(type_ref=7, nbytes=4, name="v"):
    return B.make_struct_encoded(name, type_ref, bytes(nbytes), ("FLOAT", [1]))


def check(exc, pattern, struct_types=(), encoded=(), **kw):
    with pytest.raises(exc, match=pattern) as info:
        resolve(model_of(struct_types, encoded, **kw))
    assert isinstance(info.value, OlvError)
    return info.value


# -- catalogue and identity ------------------------------------------------------------------------
def test_catalogue_needs_nonzero_type_id():
    d = simple()
    d.ClearField("type_id")
    check(CatalogueError, r"struct_types\[0\] \('S'\).*nonzero type_id, got none", [d])
    check(CatalogueError, "nonzero type_id, got 0", [simple(0)])


def test_duplicate_type_ids():
    check(DuplicateTypeIdError, r"type_id 7 is declared twice: 'A' and 'B' at struct_types\[1\]",
          [simple(7, "A"), simple(7, "B")])


def test_catalogue_declaration_needs_a_kind():
    d = pb.StructTypeProto(type_id=5, name="nokind")
    check(CatalogueError, r"type_id 5 \('nokind'\).*no kind.*never a declaration", [d])


def test_catalogue_declaration_cannot_be_a_type_ref():
    d = pb.StructTypeProto(type_id=5, name="alias", type_ref=7)
    check(CatalogueError, "type_id 5.*cannot be a type_ref.*7", [simple(), d])


@pytest.mark.parametrize("extra", ["name", "doc_string", "type_id", "decoder", "encoder",
                                   "metadata_props"])
def test_type_ref_carries_only_the_id(extra):
    r = B.ref(7)
    st = r.struct_type
    if extra in ("name", "doc_string"):
        setattr(st, extra, "x")
    elif extra == "type_id":
        st.type_id = 9
    elif extra == "metadata_props":
        st.metadata_props.add(key="k", value="v")
    else:
        getattr(st, extra).CopyFrom(X.decode_scaled_codebook())
    parent = simple(8, "P", B.field("inner", r))
    check(CatalogueError, f"field 'inner'.*type_ref \\(to 7\\) contains only the referenced ID; "
          f"found {extra}", [simple(), parent])


def test_type_ref_zero():
    check(CatalogueError, "type_ref 0 is invalid", [simple(8, "P", B.field("a", B.ref(0)))])


def test_unresolved_type_ref_in_catalogue_value_and_graph_input():
    check(UnresolvedTypeRefError, r"type_id 8 \('P'\) field 'a'.*type_ref 99 does not resolve.*7, 8",
          [simple(), simple(8, "P", B.field("a", B.ref(99)))])
    check(UnresolvedTypeRefError, "'v'.*type_ref 42 does not resolve", [simple()], [value(42)])
    vi = pb.ValueInfoProto(name="cache")
    vi.type.CopyFrom(B.ref(42))
    check(UnresolvedTypeRefError, "graph value 'cache'.*42", [simple()], inputs=[vi])


def test_reference_cycles_direct_and_indirect():
    check(TypeRefCycleError, r"cycle: 7 \('S'\) -> 7", [simple(7, "S", B.field("me", B.ref(7)))])
    a = simple(1, "A", B.field("b", B.array(B.ref(2), 2)))
    b = simple(2, "B", B.field("c", B.structure(B.field("deep", B.ref(3)))))
    c = simple(3, "C", B.field("a", make_seq(B.ref(1))))
    check(TypeRefCycleError, r"3 \('C'\) -> 1 \('A'\) -> 2 \('B'\) -> 3 \('C'\)", [c, b, a])


def make_seq(elem):
    tp = pb.TypeProto()
    tp.sequence_type.elem_type.CopyFrom(elem)
    return tp


def test_inline_declaration_has_no_type_id():
    inline = B.structure(B.field("x", B.scalar("FLOAT")))
    inline.type_id = 55
    check(CatalogueError, "field 'in'.*inline structure declaration has type_id 55",
          [simple(8, "P", B.field("in", inline))])
    ev = B.make_struct_encoded("v", inline, bytes(4), ("FLOAT", [1]))
    check(CatalogueError, "'v'.*inline structure declaration has type_id 55", [], [ev])


def test_unconstrained_category_is_never_a_layout():
    ev = pb.EncodedValueProto(name="v", raw_data=bytes(4))
    ev.struct_type.name = "anything"
    check(LayoutError, "'v'.*no kind.*never a payload layout", [], [ev])
    # ... but it is fine inside a TypeProto (a heterogeneous sequence element), just not encodable
    cat = pb.TypeProto()
    cat.struct_type.SetInParent()
    ok = simple(8, "Seq", B.field("items", make_seq(cat)))
    resolve(model_of([ok]))
    check(LayoutError, "field 'items'.*sequence_type field is not fixed-size", [ok], [value(8)])


# -- declarations ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,pattern", [
    ([B.field("", B.scalar("FLOAT"))], "field #0: a field needs a non-empty name"),
    ([B.field("a.b", B.scalar("FLOAT"))], r"field name 'a.b' contains '\.'"),
    ([B.field("a", B.scalar("FLOAT")), B.field("a", B.scalar("INT8"))], "duplicate field name 'a'"),
    ([pb.StructTypeProto.Structure.Field(name="empty")], "'empty': a field needs either a type or"),
    ([B.field("t", pb.TypeProto())], "'t': TypeProto has no type set"),
    ([B.field("u", B.scalar(T.UNDEFINED))], "'u': tensor element type UNDEFINED is not a data type"),
    ([B.field("n", make_tensor_type("FLOAT", [-3]))], r"'n': dimension 0 is negative \(-3\)"),
])
def test_structure_declaration_errors(fields, pattern):
    check(DeclarationError, r"type_id 7 \('S'\).*" + pattern, [simple(7, "S", *fields)])


def test_array_and_bit_packing_declaration_errors():
    arr = B.array("FLOAT", 4)
    arr.array.ClearField("dimension")
    check(DeclarationError, "'a'.*array without an explicit dimension",
          [simple(7, "S", B.field("a", arr))])
    arr2 = pb.StructTypeProto()
    arr2.array.dimension = 3
    check(DeclarationError, "'a'.*array without element_type", [simple(7, "S", B.field("a", arr2))])
    bp = pb.StructTypeProto()
    bp.bit_packing.dimension = 3
    check(DeclarationError, "bit_packing without components", [simple(7, "S", B.field("b", bp))])
    for comps, pattern in (([("", 2)], "component #0: a component needs a non-empty name"),
                           ([("i", 2), ("i", 3)], "duplicate component name 'i'"),
                           ([("i", 0)], "component 'i': bit_width must be 1..64, got 0"),
                           ([("i", 65)], "bit_width must be 1..64, got 65")):
        check(DeclarationError, pattern, [simple(7, "S", B.field("b", B.bit_packing(comps, 4)))])
    nodim = B.bit_packing([("i", 3)], 4)
    nodim.bit_packing.ClearField("dimension")
    check(DeclarationError, "bit_packing without an explicit dimension",
          [simple(7, "S", B.field("b", nodim))])


def test_map_sequence_optional_declaration_errors():
    m = pb.TypeProto()
    m.map_type.key_type = T.FLOAT
    m.map_type.value_type.CopyFrom(B.scalar("FLOAT"))
    check(DeclarationError, "map key type FLOAT", [simple(7, "S", B.field("m", m))])
    s = pb.TypeProto()
    s.sequence_type.SetInParent()
    check(DeclarationError, "sequence without elem_type", [simple(7, "S", B.field("s", s))])
    o = pb.TypeProto()
    o.optional_type.SetInParent()
    check(DeclarationError, "optional without elem_type", [simple(7, "S", B.field("o", o))])


def test_constant_field_errors():
    ext = make_tensor("", np.ones(2, np.float32))
    ext.data_location = T.EXTERNAL
    check(DeclarationError, "'c': constant tensors must be stored inline",
          [simple(7, "S", B.field("x", B.scalar("FLOAT")), B.const_field("c", ext))])
    st = pb.TensorProto(data_type=T.STRING, dims=[1])
    st.string_data.append(b"a")
    check(DeclarationError, "'c': constant of type STRING is not supported",
          [simple(7, "S", B.const_field("c", st))])
    bad = make_tensor("", np.ones(3, np.float32))
    bad.dims[:] = [4]
    check(DeclarationError, r"'c': bad constant.*12 bytes.*\[4\]",
          [simple(7, "S", B.const_field("c", bad))])


# -- byte encoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ftype,pattern", [
    (make_tensor_type("FLOAT", ["n"]), r"dimension 0 \('n'\) is not a concrete integer"),
    (make_tensor_type("FLOAT", None), "unknown rank is not fixed-size"),
    (make_tensor_type("STRING", [2]), "STRING is not a supported fixed-width scalar leaf"),
    (make_tensor_type("COMPLEX64", [2]), "COMPLEX64 is not a supported fixed-width scalar leaf"),
    (make_tensor_type("FLOAT8E4M3FN", [2]), "FLOAT8E4M3FN is not a supported"),
])
def test_non_fixed_or_unsupported_fields_are_valid_types_but_not_layouts(ftype, pattern):
    d = simple(7, "S", B.field("x", B.scalar("FLOAT")), B.field("f", ftype))
    resolve(model_of([d]))  # a valid runtime type
    check(LayoutError, r"'v'.*type_id 7 \('S'\) field 'f'.*" + pattern, [d], [value()])


def test_non_fixed_through_a_type_ref_names_the_path():
    inner = simple(1, "Inner", B.field("s", make_seq(B.scalar("FLOAT"))))
    outer = simple(2, "Outer", B.field("x", B.scalar("FLOAT")), B.field("i", B.ref(1)))
    check(LayoutError, r"'v'.*field 'i': via type_ref 1.*field 's'.*not fixed-size",
          [inner, outer], [value(2)])


def test_checked_uint64_size_overflow():
    huge = simple(7, "Huge", B.field("t", make_tensor_type("FLOAT", [1 << 40, 1 << 30])))
    resolve(model_of([huge]))
    check(SizeOverflowError, r"field 't'.*overflows uint64", [huge], [value()])
    arr = simple(8, "Arr", B.field("a", B.array(make_tensor_type("INT64", [1 << 20]), 1 << 40)))
    check(SizeOverflowError, r"1099511627776 \* 67108864 bits overflows uint64", [arr], [value(8)])
    bp = simple(9, "Bp", B.field("b", B.bit_packing([("x", 64), ("y", 64)], 1 << 60)))
    check(SizeOverflowError, "overflows uint64", [bp], [value(9)])
    many = simple(10, "Sum", *[B.field(f"f{i}", make_tensor_type("UINT64", [1 << 57]))
                               for i in range(3)])
    check(SizeOverflowError, r"field 'f1'.*\+.*overflows uint64", [many], [value(10)])


def test_root_size_zero_or_not_whole_bytes():
    const_only = simple(7, "C", B.const_field("k", np.float32(1)))
    resolve(model_of([const_only]))  # a valid type
    check(LayoutError, r"'v' \(type_id 7 \('C'\)\): the record size is 0 bits.*constant-only",
          [const_only], [value(7, 0)])
    nibble = simple(8, "Nibble", B.field("q", B.scalar("INT4")))
    check(LayoutError, "record size is 4 bits, not a whole number of bytes", [nibble],
          [value(8, 1)])


def test_nested_constant_only_group_contributes_zero_bytes():
    group = simple(1, "Consts", B.const_field("k", np.arange(3, dtype=np.int64)))
    d = simple(2, "P", B.field("g", B.ref(1)), B.field("x", B.scalar("INT16")))
    v = resolve(model_of([group, d], [value(2, 6)])).values["v"]
    assert (v.record_bytes, v.records) == (2, 3)
    assert v.field("g.k").tolist() == [0, 1, 2]


def test_logical_type_must_be_a_concrete_tensor():
    ev = value()
    ev.logical_type.CopyFrom(make_tensor_type("FLOAT", ["n"]))
    check(EncodingError, "'v': logical_type dimension 0", [simple()], [ev])
    ev2 = value()
    ev2.logical_type.CopyFrom(make_seq(B.scalar("FLOAT")))
    check(EncodingError, "'v': logical_type must be a tensor type", [simple()], [ev2])


def test_value_without_layout():
    check(EncodingError, "'v': no layout", [], [pb.EncodedValueProto(name="v", raw_data=b"1234")])


# -- payloads ----------------------------------------------------------------------------------------
def test_partial_records_rejected():
    check(RecordCountError, r"'v' \(type_id 7 \('S'\)\): payload bytes 10.*4-byte records "
          r"\(2 records \+ 2 bytes\)", [simple()], [value(7, 10)])


def test_empty_inline_payload_is_zero_records():
    v = resolve(model_of([simple()], [value(7, 0)])).values["v"]
    assert v.records == 0 and v.field("x").shape == (0,)


def _external(tmp_path, entries, data=bytes(64), location=True):
    (tmp_path / "w.bin").write_bytes(data)
    ev = pb.EncodedValueProto(name="v")
    ev.struct_type.type_ref = 7
    ev.data_location = T.EXTERNAL
    for k, v in entries.items():
        ev.external_data.add(key=k, value=v)
    m = model_of([simple()], [ev]).proto
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    return olv_runtime.load(path)


@pytest.mark.parametrize("entries,pattern", [
    ({"offset": "0", "length": "8"}, "EXTERNAL payload without 'location'"),
    ({"location": "w.bin"}, "needs an explicit 'length'"),
    ({"location": "w.bin", "offset": "60", "length": "8"},
     r"range \[60, 68\) lies past the end of 'w.bin' \(64 bytes\)"),
    ({"location": "/etc/passwd", "length": "4"}, "must be relative"),
    ({"location": "../w.bin", "length": "4"}, "escapes the model directory"),
    ({"location": "missing.bin", "length": "4"}, "'missing.bin' not found"),
    ({"location": "w.bin", "length": "x"}, "bad offset/length"),
    ({"location": "w.bin", "length": "-4"}, "negative offset"),
])
def test_external_payload_rules(tmp_path, entries, pattern):
    sub = tmp_path / "d"
    sub.mkdir()
    (tmp_path / "w.bin").write_bytes(bytes(64))
    model = _external(sub, entries)
    with pytest.raises(PayloadError, match=r"'v'.*" + pattern):
        resolve(model)


def test_raw_and_external_are_mutually_exclusive(tmp_path):
    model = _external(tmp_path, {"location": "w.bin", "length": "8"})
    model.graph.encoded_initializer[0].raw_data = bytes(8)
    with pytest.raises(PayloadError, match="'v'.*mutually exclusive"):
        resolve(model)
    m2 = model_of([simple()], [value()])
    m2.graph.encoded_initializer[0].external_data.add(key="location", value="w.bin")
    with pytest.raises(PayloadError, match="'v'.*data_location is not EXTERNAL"):
        resolve(m2)


def test_external_payload_needs_a_model_directory(tmp_path):
    model = _external(tmp_path, {"location": "w.bin", "length": "8"})
    with pytest.raises(PayloadError, match="not loaded from a file"):
        resolve(Model(model.proto))


def test_external_partial_records(tmp_path):
    with pytest.raises(RecordCountError, match="payload bytes 10"):
        resolve(_external(tmp_path, {"location": "w.bin", "offset": "3", "length": "10"}))
    v = resolve(_external(tmp_path, {"location": "w.bin", "offset": "4", "length": "0"})).values["v"]
    assert v.records == 0


# -- names -------------------------------------------------------------------------------------------
def test_names_unique_across_dense_sparse_encoded():
    check(DuplicateNameError, "'v' is used by both a dense and a encoded initializer",
          [simple()], [value()], inits=[make_tensor("v", np.ones(1, np.float32))])
    check(DuplicateNameError, "'v' is used by both a encoded and a encoded",
          [simple()], [value(), value()])
    m = model_of([simple()], [value()])
    sp = m.graph.sparse_initializer.add()
    sp.values.CopyFrom(make_tensor("v", np.ones(1, np.float32)))
    with pytest.raises(DuplicateNameError, match="sparse and a encoded"):
        resolve(m)
    # the session reports the same rule
    m2 = model_of([simple()], [value()], inits=[make_tensor("v", np.ones(1, np.float32))])
    with pytest.raises(ValidationError, match="unique across dense, sparse and encoded"):
        olv_runtime.InferenceSession(m2)
    check(DuplicateNameError, "empty name", [simple()], [value(name="")])


def test_names_may_also_appear_in_graph_inputs():
    vi = pb.ValueInfoProto(name="v")
    vi.type.CopyFrom(B.ref(7))
    v = resolve(model_of([simple()], [value()], inputs=[vi])).values["v"]
    assert v.records == 1


def test_validation_happens_before_any_decoder_runs():
    calls = []
    from olv_runtime.decoding import register_native_decoder, unregister_native_decoder

    register_native_decoder(7, lambda v: calls.append("decode"),
                            lambda root: calls.append("verify"))
    try:
        with pytest.raises(RecordCountError):
            resolve(model_of([simple()], [value(7, 4, "ok"), value(7, 5, "bad")]))
        assert calls == []
    finally:
        unregister_native_decoder(7)
