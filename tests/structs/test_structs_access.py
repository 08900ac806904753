"""Generic field access: numba unpack kernels (bit widths 1..64, LSB-first, sign extension,
unaligned little-endian scalars), zero-copy strided views, and a hypothesis property test against
an independent slow encoder written here."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from olv_runtime import proto as pb
from olv_runtime.io import Model
from olv_runtime.structs import build as B
from olv_runtime.decoding import resolve

T = pb.TensorProto
SEEDS = [0, 1]


def resolve_one(decls, root, payload: bytes):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.struct_types.extend(decls)
    m.graph.encoded_initializer.append(B.make_struct_encoded("v", root, payload))
    return resolve(Model(m)).values["v"]


def bits_to_bytes(acc: int, nbits: int) -> bytes:
    return acc.to_bytes((nbits + 7) // 8, "little")


# -- unsigned widths 1..64 at every bit phase, via bit packing -------------------------------------
@pytest.mark.parametrize("width", list(range(1, 65)))
@pytest.mark.parametrize("seed", SEEDS)
def test_unsigned_component_widths(width, seed):
    rng = np.random.default_rng(seed * 100 + width)
    pad = int(rng.integers(1, 8))
    n = 5
    group = pad + width
    total = n * group
    extra = (-total) % 8
    decl = B.declare(1, "P", B.structure(
        B.field("c", B.bit_packing([("pad", pad), ("x", width)], n)),
        *([B.field("tail", B.bit_packing([("t", extra)], 1))] if extra else [])))
    records = 3
    acc, pos = 0, 0
    want = np.zeros((records, n), np.uint64)
    for r in range(records):
        for g in range(n):
            acc |= int(rng.integers(0, 1 << pad)) << pos
            pos += pad
            x = int(rng.integers(0, 1 << 62)) * 4 + int(rng.integers(0, 4))
            x &= (1 << width) - 1
            want[r, g] = x
            acc |= x << pos
            pos += width
        pos += extra
    v = resolve_one([decl], 1, bits_to_bytes(acc, pos))
    got = v.field("c.x")
    assert got.shape == (records, n)
    assert got.dtype == np.dtype({8: "u1", 16: "u2", 32: "u4", 64: "u8"}[
        8 if width <= 8 else 16 if width <= 16 else 32 if width <= 32 else 64])
    np.testing.assert_array_equal(got.astype(np.uint64), want)


# -- signed ONNX integers and floats at bit offsets (sign extension, little-endian) --------------
SIGNED = [(T.INT2, 2, "i1"), (T.INT4, 4, "i1"), (T.INT8, 8, "i1"), (T.INT16, 16, "<i2"),
          (T.INT32, 32, "<i4"), (T.INT64, 64, "<i8")]


@pytest.mark.parametrize("et,bits,dt", SIGNED)
@pytest.mark.parametrize("shift", [0, 1, 3, 7])
def test_signed_leaves_at_bit_offsets(et, bits, dt, shift):
    rng = np.random.default_rng(bits + shift)
    n = 6
    values = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(2, n), dtype=np.int64)
    values[0, 0] = -(1 << (bits - 1))  # extremes
    values[0, 1] = (1 << (bits - 1)) - 1
    fields = []
    if shift:
        fields.append(B.field("pad", B.bit_packing([("p", shift)], 1)))
    fields.append(B.field("x", B.tensor(et, [n])))
    tail = (-(shift + n * bits)) % 8
    if tail:
        fields.append(B.field("tail", B.bit_packing([("t", tail)], 1)))
    acc, pos = 0, 0
    for r in range(2):
        pos += shift
        for x in values[r]:
            acc |= (int(x) & ((1 << bits) - 1)) << pos
            pos += bits
        pos += tail
    v = resolve_one([B.declare(3, "S", B.structure(*fields))], 3, bits_to_bytes(acc, pos))
    got = v.field("x")
    assert got.dtype == np.dtype(dt) and got.shape == (2, n)
    np.testing.assert_array_equal(got, values)
    aligned = shift == 0 and tail == 0 and bits >= 8
    assert np.shares_memory(got, v.payload) == aligned
    np.testing.assert_array_equal(v.field("x", copy=True), values)


@pytest.mark.parametrize("et,dt,bits", [(T.FLOAT, np.float32, 32), (T.FLOAT16, np.float16, 16),
                                        (T.DOUBLE, np.float64, 64)])
@pytest.mark.parametrize("shift", [0, 4, 5])
def test_float_leaves_at_bit_offsets(et, dt, bits, shift):
    rng = np.random.default_rng(bits + shift)
    x = rng.standard_normal(4).astype(dt)
    x[0] = -0.0
    raw = x.view({16: np.uint16, 32: np.uint32, 64: np.uint64}[bits])
    fields = [B.field("pad", B.bit_packing([("p", shift)], 1))] if shift else []
    fields.append(B.field("f", B.tensor(et, [4])))
    tail = (-(shift + 4 * bits)) % 8
    if tail:
        fields.append(B.field("tail", B.bit_packing([("t", tail)], 1)))
    acc, pos = 0, shift
    for r in raw:
        acc |= int(r) << pos
        pos += bits
    pos += tail
    v = resolve_one([B.declare(3, "S", B.structure(*fields))], 3, bits_to_bytes(acc, pos))
    got = v.field("f")
    assert got.dtype == dt
    np.testing.assert_array_equal(got[0].view(raw.dtype), raw)


def test_bool_leaves_normalise_to_true_false():
    decl = B.declare(3, "S", B.structure(B.field("b", B.tensor(T.BOOL, [3]))))
    v = resolve_one([decl], 3, bytes([0, 1, 7, 2, 0, 0]))
    np.testing.assert_array_equal(v.field("b"), [[False, True, True], [True, False, False]])


def test_byte_aligned_views_are_zero_copy_and_strided():
    decl = B.declare(3, "S", B.structure(
        B.field("a", B.scalar("UINT8")),
        B.field("w", B.tensor("INT16", [2, 3])),
        B.field("s", B.scalar("FLOAT"))))  # 1 + 12 + 4 = 17-byte records: everything unaligned
    rng = np.random.default_rng(9)
    rec = np.zeros(4, np.dtype([("a", "u1"), ("w", "<i2", (2, 3)), ("s", "<f4")]))
    assert rec.dtype.itemsize == 17
    rec["a"] = rng.integers(0, 256, 4)
    rec["w"] = rng.integers(-30000, 30000, (4, 2, 3))
    rec["s"] = rng.standard_normal(4)
    v = resolve_one([decl], 3, rec.tobytes())
    for name in ("a", "w", "s"):
        got = v.field(name)
        assert np.shares_memory(got, v.payload), name
        assert not got.flags.writeable
        assert got.strides[0] == 17
        np.testing.assert_array_equal(got, rec[name])
    assert v.field("w").strides == (17, 6, 2)


def test_arrays_of_nested_structs_get_leading_dimensions():
    pair = B.declare(1, "Pair", B.structure(B.field("lo", B.scalar("UINT4")),
                                            B.field("hi", B.scalar("INT4"))))
    decl = B.declare(2, "Arr", B.array(B.ref(1), 3))
    v = resolve_one([pair, decl], 2, bytes([0x8F, 0x12, 0x7A]) * 2)
    assert v.layout.bits == 24
    np.testing.assert_array_equal(v.field("lo"), [[15, 2, 10]] * 2)
    np.testing.assert_array_equal(v.field("hi"), [[-8, 1, 7]] * 2)
    scalars = B.declare(3, "Raw", B.array("UINT16", 2))
    v2 = resolve_one([scalars], 3, bytes([1, 0, 2, 1]))
    np.testing.assert_array_equal(v2.field("value"), [[1, 258]])


# -- property test: random declarations vs an independent slow encoder ------------------------------
#: the test's own leaf table: type -> (bits, kind, numpy dtype)
LEAVES = {
    T.FLOAT: (32, "f", "<f4"), T.FLOAT16: (16, "f", "<f2"), T.DOUBLE: (64, "f", "<f8"),
    T.INT8: (8, "i", "i1"), T.UINT8: (8, "u", "u1"), T.INT16: (16, "i", "<i2"),
    T.UINT16: (16, "u", "<u2"), T.INT32: (32, "i", "<i4"), T.UINT32: (32, "u", "<u4"),
    T.INT64: (64, "i", "<i8"), T.UINT64: (64, "u", "<u8"), T.BOOL: (8, "b", "?"),
    T.INT4: (4, "i", "i1"), T.UINT4: (4, "u", "u1"), T.INT2: (2, "i", "i1"), T.UINT2: (2, "u", "u1"),
}

dims = st.lists(st.integers(1, 3), min_size=0, max_size=2)


def types(depth, refs):
    leaf = st.builds(lambda et, d: ("tensor", et, d), st.sampled_from(sorted(LEAVES)), dims)
    packing = st.builds(lambda ws, n: ("bits", ws, n),
                        st.lists(st.integers(1, 64), min_size=1, max_size=3), st.integers(1, 3))
    options = [leaf, packing]
    if refs:
        options.append(st.sampled_from(refs).map(lambda r: ("ref", r)))
    if depth > 0:
        sub = types(depth - 1, refs)
        options.append(st.builds(lambda t, n: ("array", t, n), sub, st.integers(1, 3)))
        options.append(st.lists(st.one_of(sub, st.just(("const",))), min_size=1, max_size=3)
                       .map(lambda fs: ("struct", fs)))
    return st.one_of(*options)


def to_proto(t, counter):
    """TypeProto / StructTypeProto of a generated type description."""
    kind = t[0]
    if kind == "tensor":
        return B.tensor(t[1], t[2])
    if kind == "bits":
        return B.bit_packing([(f"c{i}", w) for i, w in enumerate(t[1])], t[2])
    if kind == "ref":
        return B.ref(t[1])
    if kind == "array":
        return B.array(to_proto(t[1], counter), t[2])
    fields = []
    for i, f in enumerate(t[1]):
        if f[0] == "const":
            counter[0] += 1
            fields.append(B.const_field(f"f{i}", np.arange(counter[0] % 4 + 1, dtype=np.float32)))
        else:
            fields.append(B.field(f"f{i}", to_proto(f, counter)))
    return B.structure(*fields)


def slots(t, prefix, outer, catalogue, out, consts):
    """Every physical element of one record in storage order: (path, index, bits, kind, et)."""
    kind = t[0]
    if kind == "tensor":
        bits, k, _ = LEAVES[t[1]]
        for idx in np.ndindex(*t[2]):
            out.append((prefix, outer + idx, bits, k, t[1]))
    elif kind == "bits":
        for g in range(t[2]):
            for i, w in enumerate(t[1]):
                out.append((join(prefix, f"c{i}"), outer + (g,), w, "u", None))
    elif kind == "ref":
        slots(catalogue[t[1]], prefix, outer, catalogue, out, consts)
    elif kind == "array":
        for i in range(t[2]):
            slots(t[1], prefix, outer + (i,), catalogue, out, consts)
    else:
        for i, f in enumerate(t[1]):
            if f[0] == "const":
                consts.add(join(prefix, f"f{i}"))
            else:
                slots(f, join(prefix, f"f{i}"), outer, catalogue, out, consts)


def join(a, b):
    return f"{a}.{b}" if a else b


def component_dtype(w):
    return np.dtype("u1" if w <= 8 else "<u2" if w <= 16 else "<u4" if w <= 32 else "<u8")


@st.composite
def catalogues(draw):
    n = draw(st.integers(0, 3))
    catalogue = {}
    for k in range(n):
        catalogue[100 + k] = ("struct", draw(st.lists(types(1, sorted(catalogue)), min_size=1,
                                                      max_size=3)))
    root = ("struct", draw(st.lists(types(2, sorted(catalogue)), min_size=1, max_size=4)))
    return catalogue, root, draw(st.integers(0, 4)), draw(st.integers(0, 2 ** 32 - 1))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogues())
def test_random_declarations_round_trip_through_field_access(case):
    catalogue, root, records, seed = case
    probe, consts = [], set()
    slots(root, "", (), catalogue, probe, consts)
    nbits = sum(s[2] for s in probe)
    pad = (-nbits) % 8 or (8 if nbits == 0 else 0)
    if pad:
        root = ("struct", list(root[1]) + [("bits", [pad], 1)])
    counter = [0]
    decls = [B.declare(tid, f"T{tid}", to_proto(t, counter)) for tid, t in catalogue.items()]
    root_decl = B.declare(999, "Root", to_proto(root, counter))
    layout_slots, consts = [], set()
    slots(root, "", (), catalogue, layout_slots, consts)
    rng = np.random.default_rng(seed)
    acc, pos = 0, 0
    values: dict[str, dict] = {}
    for r in range(records):
        for path, idx, bits, kind, et in layout_slots:
            raw = int(rng.integers(0, 1 << 62)) << 2 | int(rng.integers(0, 4))
            raw &= (1 << bits) - 1
            acc |= raw << pos
            pos += bits
            values.setdefault(path, {})[(r,) + idx] = (raw, bits, kind, et)
    v = resolve_one(decls + [root_decl], 999, bits_to_bytes(acc, pos))
    assert v.records == records
    assert v.record_bytes * 8 == sum(s[2] for s in layout_slots)
    assert {leaf.path for leaf in v.layout.leaves} == {s[0] for s in layout_slots}
    assert {c.path for c in v.layout.constants} == consts
    for path in {s[0] for s in layout_slots}:
        got = v.field(path)
        first = next(s for s in layout_slots if s[0] == path)
        per = [s[1] for s in layout_slots if s[0] == path]
        shape = tuple(max(i[d] for i in per) + 1 for d in range(len(first[1])))
        assert got.shape == (records,) + shape, path
        _, bits, kind, et = first[1], first[2], first[3], first[4]
        dtype = component_dtype(bits) if et is None else np.dtype(LEAVES[et][2])
        assert got.dtype == dtype, path
        for key, (raw, bits, kind, et) in values.get(path, {}).items():
            g = got[key]
            if kind == "u":
                assert int(g) == raw, (path, key)
            elif kind == "i":
                assert int(g) == (raw - (1 << bits) if raw >> (bits - 1) else raw), (path, key)
            elif kind == "b":
                assert bool(g) == (raw != 0)
            else:
                assert int(np.asarray(g).view({16: "<u2", 32: "<u4", 64: "<u8"}[bits])) == raw
