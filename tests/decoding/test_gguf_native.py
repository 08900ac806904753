"""Native consumers of ggml blocks (structs/ggml_native.py): verified declarations, INT4 repacks
for the packed kernels, the same logits as the FunctionProto decoder path, counters."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import SessionOptions
from olv_runtime.decoding import resolve
from olv_runtime.structs import ggml
from olv_runtime.kernels import packed_i8
from olv_runtime.kernels.ggml_packed import dequantize_rows
from olv_runtime.decoding.ggml_native import (
    BLOCK_KERNEL_TYPES, FAST_TYPES, GGMLWeight, linear_weight,
)

from gguf_models import write_gguf

IDS = np.array([[5, 17, 99, 3, 42, 64, 7, 250]], np.int64)


def _model(tmp_path, ttype, **kw):
    path = write_gguf(tmp_path / "m.gguf", "qwen2", ttype, layers=1, seed=4, **kw)
    out = tmp_path / "m.onnx"
    olv_runtime.convert(path, out)
    return olv_runtime.load(out)


def _logits(sess, ids=IDS):
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    return state.run({"input_ids": ids})["logits"]


@pytest.mark.parametrize("ttype", FAST_TYPES)
def test_fast_consumer_matches_decoder_path(tmp_path, ttype):
    model = _model(tmp_path, ttype)
    fast = olv_runtime.InferenceSession(model)
    kinds = {k for k, _ in fast.plan()}
    assert "Decode" not in kinds  # every ggml weight is read by a native consumer
    if ttype == "Q4_0":  # the converter's INT4 form: Linear steps, or inside the compiled
        assert "Linear" in kinds or "DecoderStack" in kinds  # decoder stack (issue 10)
    else:  # every other type: its own block kernels (group records at the file's bits)
        assert ttype in BLOCK_KERNEL_TYPES
        kernels = {s.impl.kernel for s in fast.all_steps() if s.kind == "Linear"}
        assert kernels == {f"ggml_{ttype}_exact"}
    assert fast.counters["payload_bytes_copied"] == 0
    assert fast.counters["bytes_repacked"] > 0
    before = fast.counters["bytes_dequantized"]
    got = _logits(fast)
    assert fast.counters["bytes_dequantized"] == before  # no weight materialised
    ref_sess = olv_runtime.InferenceSession(model, SessionOptions(enable_fusion=False))
    assert any(k == "Decode" for k, _ in ref_sess.plan())
    ref = _logits(ref_sess)
    assert float(np.max(np.abs(got - ref))) <= 1e-4


@pytest.mark.parametrize("ttype", FAST_TYPES)
def test_repack_reproduces_the_decoded_weight(tmp_path, ttype):
    """Block-kernel types: the payload's blocks in place, dequantized bitwise as decode_value;
    Q4_0: the INT4 codes x scales == decode_value (float32 rounding only)."""
    model = _model(tmp_path, ttype)
    value = resolve(model).value("model.layers.0.mlp.down_proj.weight")
    rep = linear_weight(value)
    n, k = value.logical[1]
    if ttype in BLOCK_KERNEL_TYPES:  # read in place: the payload's blocks, no repack yet
        assert isinstance(rep, GGMLWeight) and np.shares_memory(rep.blocks, value.payload)
        w = dequantize_rows(ttype, rep.blocks)
        assert np.array_equal(w.view(np.uint32), value.decode().view(np.uint32))
        return
    assert ttype == "Q4_0"
    b = np.asarray(rep.codes, np.uint8)
    c = np.empty(n * k, np.int16)
    c[0::2], c[1::2] = b & 15, b >> 4
    c[c >= 8] -= 16
    w = c.reshape(n, k) * np.repeat(rep.scale.astype(np.float64), 32, axis=1)
    ref = value.decode()
    np.testing.assert_allclose(w, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("ttype", ["F16", "BF16"])
def test_float_types_have_no_native_consumer(tmp_path, ttype):
    model = _model(tmp_path, ttype)
    value = resolve(model).value("model.layers.0.mlp.down_proj.weight")
    assert linear_weight(value) is None
    sess = olv_runtime.InferenceSession(model)
    assert "Decode" in {k for k, _ in sess.plan()}


def test_consumer_verifies_the_declaration(tmp_path):
    """A declaration under a ggml row type_id that is not the canonical one (here: a changed
    decoder) is not bound by the native consumer; its own FunctionProto decoder is used."""
    model = _model(tmp_path, "Q4_0")
    proto = model.proto
    k = 256
    rid = ggml.row_type_id(ggml.BLOCKS["Q4_0"], k)
    decl = next(st for st in proto.struct_types if st.type_id == rid)
    mul = next(n for n in decl.decoder.node if n.op_type == "Mul")
    mul.op_type = "Add"  # d + (q - 8): a different format under the same id
    tampered = olv_runtime.Model(proto, model.path)
    value = resolve(tampered).value("model.layers.0.mlp.up_proj.weight")
    assert linear_weight(value) is None
    sess = olv_runtime.InferenceSession(tampered)
    assert "Decode" in {kind for kind, _ in sess.plan()}


@pytest.mark.parametrize("ttype", BLOCK_KERNEL_TYPES)
def test_block_kernels_int8_mode(tmp_path, ttype):
    """int8 activations on the block kernels: close to the exact decoder path, the same
    greedy token, the VNNI and AVX2 paths bitwise equal, the records as many bytes as the
    file's blocks (no float copy, no INT4 planes)."""
    model = _model(tmp_path, ttype)
    ref = _logits(olv_runtime.InferenceSession(model, SessionOptions(enable_fusion=False)))
    outs = []
    for isa in (["avx2", "avx512vnni"] if packed_i8.HOST_VNNI else ["avx2"]):
        packed_i8.set_isa(isa)
        try:
            sess = olv_runtime.InferenceSession(model, SessionOptions(quantize_activations=True))
            outs.append(_logits(sess))
        finally:
            packed_i8.set_isa(None)
    lins = [s.impl for s in sess.all_steps() if s.kind == "Linear"]
    assert {lin.kernel for lin in lins} == {f"ggml_{ttype}_i8"}
    assert sess.counters["bytes_repacked"] == sum(lin.packed.nbytes for lin in lins)
    assert sess.counters["bytes_repacked"] <= sum(
        w.nbytes for lin in lins for w in lin.weights) * 1.01
    assert all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs)
    got = outs[0]
    assert float(np.max(np.abs(got - ref))) <= 0.05 * float(np.max(np.abs(ref)))
    assert np.array_equal(got[0, -1].argmax(), ref[0, -1].argmax())


def test_block_gather_rejects_out_of_range_ids(tmp_path):
    from olv_runtime.errors import OlvError

    model = _model(tmp_path, "Q8_0")
    sess = olv_runtime.InferenceSession(model)
    assert any(s.kind == "EncodedGather" for s in sess.all_steps())
    with pytest.raises(OlvError, match="out of range"):
        _logits(sess, np.array([[3, 320]], np.int64))  # vocab 320
    got = _logits(sess, np.array([[3, -1]], np.int64))  # negative ids count from the end
    ref = _logits(sess, np.array([[3, 319]], np.int64))
    assert np.array_equal(got, ref)
