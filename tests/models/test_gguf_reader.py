"""The bounded GGUF reader: agreement with gguf-py on valid files, and every hostile case of
issue 13 item 4 rejected with a GGUFFormatError (a ModelFormatError) within 1 s and 100 MB."""
import resource
import struct
import time

import gguf
import numpy as np
import pytest

from olv_runtime.errors import GGUFFormatError, ModelFormatError
from olv_runtime.models.gguf_reader import GGML_TYPES, GGUFFile


def _write_valid(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_string("test.s", "héllo")
    w.add_array("test.arr", [1, 2, 3])
    w.add_array("test.strs", ["a", "bc", "ü"])
    w.add_float32("test.f", 0.5)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("a", a)
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return a, q


def test_type_table_matches_gguf():
    for tid, (name, bs, bb) in GGML_TYPES.items():
        t = gguf.GGMLQuantizationType(tid)
        assert t.name == name
        assert gguf.GGML_QUANT_SIZES[t] == (bs, bb)


def test_valid_file_agrees_with_gguf_reader(tmp_path):
    p = tmp_path / "ok.gguf"
    a, q = _write_valid(p)
    with GGUFFile(p) as f:
        assert f.version == 3
        assert f.metadata["general.architecture"] == "llama"
        assert f.metadata["llama.block_count"] == 2
        assert f.metadata["test.s"] == "héllo"
        assert f.metadata["test.arr"].tolist() == [1, 2, 3]
        assert f.metadata["test.strs"] == ["a", "bc", "ü"]
        assert f.value_types["test.strs"] == "ARRAY[STRING]"
        assert f.tensors["a"].shape == (3, 64) and f.tensors["a"].ne == (64, 3)
        assert np.array_equal(f.tensor_bytes("a").view(np.float32).reshape(3, 64), a)
        assert f.tensors["q"].type_name == "Q8_0" and f.tensors["q"].shape == (2, 64)
        assert np.array_equal(f.tensor_bytes("q"), q.reshape(-1))
        ref = gguf.GGUFReader(str(p))
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.offset == int(t.data_offset) and info.nbytes == int(t.n_bytes)
            assert info.ggml_type == int(t.tensor_type)


# -- hand-built hostile files ---------------------------------------------------------------------
def s(text: bytes | str) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def header(n_tensors, n_kv, version=3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv_u32(key, v) -> bytes:
    return s(key) + struct.pack("<II", 4, v)


def tinfo(name, ne, gtype=0, offset=0) -> bytes:
    return s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + \
        struct.pack("<IQ", gtype, offset)


def pad(b: bytes, align=32) -> bytes:
    return b + b"\0" * ((-len(b)) % align)


def one_tensor(ne=(8,), gtype=0, offset=0, data_bytes=32, kvs=b"", n_kv=0) -> bytes:
    head = pad(header(1, n_kv) + kvs + tinfo("t", ne, gtype, offset))
    return head + b"\0" * data_bytes


HOSTILE = {
    "empty": b"",
    "bad_magic": b"GGML" + b"\0" * 40,
    "truncated_header": b"GGUF\x03\x00\x00",
    "version_1": header(0, 0, version=1),
    "big_endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 0),
    "string_length_2_63": header(0, 1) + struct.pack("<Q", 1 << 63) + b"k" * 8,
    # the public gguf-py report: a tiny file whose array declares 2^63 elements
    "array_length_2_63": header(0, 1) + s("k") + struct.pack("<IIQ", 9, 0, 1 << 63),
    "array_of_strings_2_63": header(0, 1) + s("k") + struct.pack("<IIQ", 9, 8, 1 << 63),
    "nested_arrays_too_deep": header(0, 1) + s("k") + struct.pack("<I", 9)
    + struct.pack("<IQ", 9, 1) * 5 + struct.pack("<IQ", 0, 0),
    "kv_count_2_63": header(0, 1 << 63),
    "tensor_count_2_63": header(1 << 63, 0),
    "unknown_value_type": header(0, 1) + s("k") + struct.pack("<II", 99, 0),
    "truncated_value": header(0, 1) + s("k") + struct.pack("<I", 10) + b"\1\2",
    "bad_utf8_key": header(0, 1) + s(b"\xff\xfe") + struct.pack("<II", 4, 1),
    "duplicate_key": header(0, 2) + kv_u32("k", 1) + kv_u32("k", 2),
    "alignment_not_power_of_two": header(0, 1) + kv_u32("general.alignment", 24),
    "alignment_zero": header(0, 1) + kv_u32("general.alignment", 0),
    "n_dims_5": one_tensor(ne=(1, 1, 1, 1, 1)),
    "n_dims_0": pad(header(1, 0) + s("t") + struct.pack("<IIQ", 0, 0, 0)) + b"\0" * 32,
    "n_dims_2_32": pad(header(1, 0) + s("t") + struct.pack("<I", 0xFFFFFFFF)) + b"\0" * 32,
    "zero_dimension": one_tensor(ne=(8, 0)),
    "element_count_overflow": one_tensor(ne=(1 << 32, 1 << 32)),
    "byte_size_overflow": one_tensor(ne=((1 << 62) + (1 << 61),), gtype=0),
    "dims_2_63_each": one_tensor(ne=(1 << 63, 1 << 63, 1 << 63, 1 << 63)),
    "unknown_tensor_type": one_tensor(gtype=99),
    "row_not_multiple_of_block": one_tensor(ne=(48,), gtype=2),
    "misaligned_offset": one_tensor(offset=4, data_bytes=64),
    "offset_beyond_file": one_tensor(offset=1 << 40),
    "offset_2_64_minus_32": one_tensor(offset=(1 << 64) - 32),
    "size_beyond_file": one_tensor(ne=(1024,), data_bytes=32),
    "truncated_data": one_tensor(ne=(8,), data_bytes=31),
    "duplicate_tensor_name": pad(header(2, 0) + tinfo("t", (8,), 0, 0) + tinfo("t", (8,), 0, 32))
    + b"\0" * 64,
    "overlapping_tensors": pad(header(2, 0) + tinfo("a", (16,), 0, 0) + tinfo("b", (8,), 0, 32))
    + b"\0" * 64,
    "truncated_tensor_info": header(1, 0) + s("t") + struct.pack("<I", 2) + b"\0" * 5,
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_fails_fast(tmp_path, case):
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(HOSTILE[case])
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(GGUFFormatError) as ei:
        GGUFFile(p)
    assert time.perf_counter() - t0 < 1.0
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024 < 100e6
    assert isinstance(ei.value, ModelFormatError)
    assert str(p) in str(ei.value)


def test_valid_control_cases(tmp_path):
    """The hostile builders produce readable files when the bad field is made valid."""
    p = tmp_path / "ok1.gguf"
    p.write_bytes(one_tensor(ne=(8,), data_bytes=32))
    with GGUFFile(p) as f:
        assert f.tensors["t"].nbytes == 32 and f.data_start % 32 == 0
    p.write_bytes(pad(header(2, 0) + tinfo("a", (8,), 0, 0) + tinfo("b", (8,), 0, 32)) + b"\0" * 64)
    with GGUFFile(p) as f:
        assert list(f.tensors) == ["a", "b"]
    p.write_bytes(header(0, 1) + kv_u32("general.alignment", 64))
    with GGUFFile(p) as f:
        assert f.alignment == 64
