"""Zero-copy payloads: a 100 MB external encoded initializer loads and binds with no payload byte
read or copied, fields are views of the memory map, and the map goes away with its last owner."""
from __future__ import annotations

import gc
import os
import struct

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.proto.helper import make_node, make_tensor_value_info
from olv_runtime.decoding import register_native_decoder, resolve, unregister_native_decoder
from olv_runtime.structs import examples as X

T = pb.TensorProto
BIG = 100 * 1024 * 1024  # bytes: 5,242,880 Int4Block records of 20 bytes
RECORDS = BIG // 20


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mapped(path) -> bool:
    with open("/proc/self/maps") as fh:
        return str(path) in fh.read()


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    data = d / "weights.bin"
    with open(data, "wb") as fh:
        fh.truncate(BIG)  # sparse zeros ...
        fh.seek(0)
        fh.write(bytes([0x21] * 16) + struct.pack("<f", 0.5))  # ... one known first record
        fh.seek(BIG - 20)
        fh.write(bytes([0xF7] * 16) + struct.pack("<f", -2.0))  # ... and a known last record
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.struct_types.append(X.int4_block_2001())
    ev = m.graph.encoded_initializer.add(name="big")
    ev.struct_type.type_ref = 2001
    ev.logical_type.tensor_type.elem_type = T.FLOAT
    ev.logical_type.tensor_type.shape.dim.add().dim_value = RECORDS * 32
    ev.data_location = T.EXTERNAL
    for k, v in (("location", "weights.bin"), ("offset", "0"), ("length", str(BIG))):
        ev.external_data.add(key=k, value=v)
    m.graph.node.append(make_node("Decode", ["big"], ["y"], domain="olv"))
    m.graph.output.append(make_tensor_value_info("y", T.FLOAT, [RECORDS * 32]))
    path = d / "big.onnx"
    path.write_bytes(m.SerializeToString())
    return path, data


def _native_decode(value):
    raise AssertionError("codec code ran")


def test_100mb_external_value_loads_and_binds_without_reading_payload(big_model):
    path, data = big_model
    calls = []
    register_native_decoder(2001, _native_decode, lambda root: calls.append(root.type_id))
    try:
        gc.collect()
        rchar0, rss0 = _rchar(), _rss()
        model = olv_runtime.load(path)
        assert calls == []  # loading never runs codec (or verification) code
        sess = olv_runtime.InferenceSession(model)
        rchar = _rchar() - rchar0
        rss = _rss() - rss0
    finally:
        unregister_native_decoder(2001)
    assert calls == [2001]  # the native binding verified the declaration, nothing decoded
    assert sess.counters["payload_bytes_read"] == 0
    assert sess.counters["payload_bytes_copied"] == 0
    assert sess.counters["bytes_dequantized"] == 0
    assert rchar < path.stat().st_size + (1 << 20), rchar  # only the small .onnx file was read
    assert rss < 16 << 20, rss
    v = sess._encoded_values["big"]
    assert (v.records, v.record_bytes, v.nbytes) == (RECORDS, 20, BIG)
    assert _mapped(data)
    scale = v.field("scale")  # a strided view of the memory map: nothing read yet
    assert scale.shape == (RECORDS,) and np.shares_memory(scale, v.payload)
    assert (scale[0], scale[-1]) == (0.5, -2.0)
    assert v.field("codes", records=slice(0, 1))[0].tolist() == [1, 2] * 16
    assert v.field("codes", records=slice(-1, None)).tolist() == [[7, -1] * 16]
    del sess, model, v
    gc.collect()
    assert _mapped(data)  # the field view still owns the mapping
    assert scale[-1] == -2.0
    del scale
    gc.collect()
    assert not _mapped(data)


def test_mapping_released_when_model_and_session_go(big_model):
    path, data = big_model
    model = olv_runtime.load(path)
    r = resolve(model)
    assert r.values["big"].records == RECORDS and _mapped(data)
    del r, model
    gc.collect()
    assert not _mapped(data)


def test_inline_payloads_are_viewed_in_place():
    from olv_runtime.io import Model
    from olv_runtime.structs import build as B

    m = pb.ModelProto(ir_version=10)
    m.struct_types.append(X.int4_block_2001())
    m.graph.encoded_initializer.append(B.make_struct_encoded("w", 2001, bytes(range(40))))
    model = Model(m)
    v = resolve(model).values["w"]
    assert v.payload.base is not None and not v.payload.flags.owndata
    assert np.shares_memory(v.field("scale"), model.payload(m.graph.encoded_initializer[0]))
