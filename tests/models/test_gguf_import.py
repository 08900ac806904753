"""GGUF import (issue 13): ggml block struct types, zero-copy convert, logits against transformers.

* every ggml type's decoder (a FunctionProto of standard ops) equals ``gguf.quants.dequantize``
  bit for bit, through ``decode_value``; onnxruntime runs the exported decoders;
* ``olv convert model.gguf out.onnx`` for qwen2 (tied and untied), qwen3 and llama in every
  supported tensor type: every tensor of the .gguf decodes bitwise equal to gguf's dequantize,
  no payload byte is in the .onnx or copied at session creation, logits (exact mode) within 1e-4
  of transformers loading the same file, identical greedy ids for 32 tokens.
"""
from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

import olv_runtime
from olv_runtime.decoding.ggml_native import BLOCK_KERNEL_TYPES
from olv_runtime.errors import ConversionError, GGUFFormatError
from olv_runtime.proto import ModelProto, TensorProto
from olv_runtime.structs import ggml

import torch
import transformers

from gguf_models import ALL_TYPES, encode, random_kquant, write_gguf

T = gguf.GGMLQuantizationType
N_DECODE = 32
PROMPT = [5, 17, 99, 3, 42, 64, 7]


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# -- block declarations and decoders ----------------------------------------------------------
def test_block_table_matches_gguf():
    for b in ggml.BLOCKS.values():
        assert gguf.GGML_QUANT_SIZES[T[b.name]] == (b.block_size, b.type_size)
        assert T[b.name].value == b.ggml_type


@pytest.mark.parametrize("name", [n for n in ggml.BLOCKS if ggml.BLOCKS[n].fields is not None])
def test_block_record_size(name):
    """The seed 000 record size of each block declaration is gguf's type size."""
    from olv_runtime.structs import Catalogue

    b = ggml.BLOCKS[name]
    cat = Catalogue(ggml.declarations([(name, 512, False)]))
    assert cat.root(_ref(ggml.block_type_id(b)), "block").record_bytes == b.type_size
    row = cat.root(_ref(ggml.row_type_id(b, 512)), "row")
    assert row.record_bytes == 512 // b.block_size * b.type_size


def _ref(type_id):
    from olv_runtime.proto import StructTypeProto

    st = StructTypeProto()
    st.type_ref = type_id
    return st


def _one_value_model(name, shape, raw):
    m = ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=21)
    m.opset_import.add(domain="olv", version=1)
    m.struct_types.extend(ggml.declarations([(name, shape[-1], len(shape) == 1)]))
    m.graph.encoded_initializer.append(ggml.make_ggml_encoded("w", name, shape, raw=raw))
    n = m.graph.node.add(op_type="Decode", domain="olv", name="dec")
    n.input.append("w")
    n.output.append("y")
    out = m.graph.output.add(name="y")
    out.type.tensor_type.elem_type = TensorProto.FLOAT
    for d in shape:
        out.type.tensor_type.shape.dim.add().dim_value = d
    return m


def _random_blocks(name, shape, rng):
    if name == "F16":
        return rng.standard_normal(shape).astype(np.float16).view(np.uint8)
    data, _ = encode(name, rng.standard_normal(shape).astype(np.float32) * 0.1, rng)
    return np.ascontiguousarray(data).view(np.uint8)


@pytest.mark.parametrize("shape", [(3, 512), (512,)])
@pytest.mark.parametrize("name", list(ggml.BLOCKS))
def test_decoder_bitwise_equals_gguf_dequantize(name, shape):
    rng = np.random.default_rng(1)
    raw = _random_blocks(name, shape, rng)
    if name in ("Q4_K", "Q5_K", "Q6_K"):  # every byte random, scales included
        raw = rng.integers(0, 256, raw.shape, dtype=np.uint8)
        raw.reshape(-1, ggml.BLOCKS[name].type_size)[:, -2 if name == "Q6_K" else 0:][:, :2] = \
            np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    ref = gguf.quants.dequantize(raw.reshape(-1), T[name]).reshape(shape)
    model = _one_value_model(name, shape, raw.tobytes())
    got = olv_runtime.decode_value(model, "w")
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16"])
def test_exported_decoder_runs_in_onnxruntime(name):
    import onnxruntime as ort

    from olv_runtime.builder import export_standard

    rng = np.random.default_rng(2)
    shape = (2, 256)
    raw = _random_blocks(name, shape, rng)
    model = _one_value_model(name, shape, raw.tobytes())
    std = export_standard(olv_runtime.Model(model))
    sess = ort.InferenceSession(std.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {})
    ref = gguf.quants.dequantize(raw.reshape(-1), T[name]).reshape(shape)
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=0)


def test_row_length_must_be_whole_blocks():
    with pytest.raises(ConversionError, match="multiple of 256"):
        ggml.row_declaration("Q4_K", 320)
    with pytest.raises(ConversionError, match="not supported"):
        ggml.ggml_type_of("IQ2_XS")


# -- whole models ---------------------------------------------------------------------------------
#: every supported type in each of the four checkpoints
CHECKPOINTS = [("qwen2", True), ("qwen2", False), ("qwen3", True), ("llama", False)]
CASES = [(t, c) for t in ALL_TYPES for c in CHECKPOINTS]


def _arch_kwargs(arch):
    # transformers' GGUF config for qwen3 leaves head_dim at Qwen3Config's default (128)
    return {"heads": 2, "kv_heads": 1} if arch == "qwen3" else {}


def hf_greedy(model, prompt, steps):
    ids = list(prompt)
    logits = []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(torch.tensor([ids])).logits[0].numpy()
            logits.append(out if not logits else out[-1:])
            ids.append(int(np.argmax(out[-1])))
    return ids[len(prompt):], logits


def olv_greedy(model, prompt, steps):
    state = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    ids, logits = list(prompt), []
    feed = np.array([prompt], np.int64)
    for _ in range(steps + 1):
        lo = state.run({"input_ids": feed})["logits"][0]
        logits.append(lo)
        ids.append(int(np.argmax(lo[-1])))
        feed = np.array([[ids[-1]]], np.int64)
    return ids[len(prompt):], logits


@pytest.mark.parametrize("ttype,ckpt", CASES, ids=[f"{t}-{a}-{'tied' if tie else 'untied'}"
                                                    for t, (a, tie) in CASES])
def test_gguf_model_matches_transformers(tmp_path, ttype, ckpt):
    arch, tied = ckpt
    layers = 2 if arch == "llama" or (arch == "qwen2" and tied) else 1  # blk.N mapping covered
    path = write_gguf(tmp_path / "m.gguf", arch, ttype, tied=tied, seed=3, layers=layers,
                      **_arch_kwargs(arch))
    out = tmp_path / "m.onnx"
    olv_runtime.convert(path, out)

    from olv_runtime.models.gguf import hf_name

    # the .onnx holds no weight byte: every GGUF tensor is external, in the .gguf (only graph
    # constants such as RoPE frequencies and shapes are inline)
    reader = gguf.GGUFReader(path)
    weights = {hf_name(t.name) for t in reader.tensors}
    proto = ModelProto.FromString(out.read_bytes())
    g = proto.graph
    stored = [m for m in list(g.initializer) + list(g.encoded_initializer) if m.name in weights]
    assert len(stored) == len(weights) and len(g.encoded_initializer) == sum(
        t.tensor_type != T.F32 for t in reader.tensors)
    for msg in stored:
        assert msg.data_location == TensorProto.EXTERNAL and not msg.raw_data
        assert {e.key: e.value for e in msg.external_data}["location"] == "m.gguf"
    assert out.stat().st_size < 64_000

    # every tensor decodes bitwise equal to gguf's own dequantize of the same bytes
    model = olv_runtime.load(out)

    checked = 0
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(reversed([int(d) for d in t.shape])))
        name = hf_name(t.name)
        if t.tensor_type == T.F32:
            init = next(i for i in g.initializer if i.name == name)
            got = np.frombuffer(model.payload(init), np.float32).reshape(ref.shape)
        else:
            got = olv_runtime.decode_value(model, name)
        assert np.array_equal(_bits(got), _bits(ref)), t.name
        checked += 1
    assert checked == len(reader.tensors)

    # session creation maps the .gguf and copies no payload byte
    sess = olv_runtime.InferenceSession(model)
    assert sess.counters["payload_bytes_copied"] == 0
    if ttype == "Q4_0" or ttype in BLOCK_KERNEL_TYPES:
        # every linear in the compiled step (Qwen3 too: its per-head q/k norms are fused)
        kinds = [k for k, _ in sess.plan()]
        assert kinds.count("DecoderStack") == 1 and "Linear" not in kinds, kinds

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    ref_model.eval()
    ref_ids, ref_logits = hf_greedy(ref_model, PROMPT, N_DECODE)
    ids, logits = olv_greedy(model, PROMPT, N_DECODE)
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, ref_logits))
    assert worst <= 1e-4, f"max |logit difference| {worst:.3g}"
    assert ids == ref_ids


def test_convert_cli_and_outside_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    path = write_gguf(src / "m.gguf", "qwen2", "Q4_0", layers=1)
    out = tmp_path / "out" / "m.onnx"
    r = subprocess.run([sys.executable, "-m", "olv_runtime.cli", "convert", path, str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the .gguf lies outside the model directory: a hard link to it (no bytes copied)
    link = out.parent / "m.gguf"
    assert link.stat().st_ino == (src / "m.gguf").stat().st_ino
    ids = olv_runtime.generate(olv_runtime.load(out), PROMPT, max_new_tokens=3)
    assert len(ids) == 3


def test_unsupported_architecture_and_type(tmp_path):
    p = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(p), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match="architecture 'gemma'"):
        olv_runtime.convert(p, tmp_path / "g.onnx")
    assert not (tmp_path / "g.onnx").exists()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 16)
    with pytest.raises(GGUFFormatError):
        olv_runtime.convert(bad, tmp_path / "bad.onnx")
    assert not (tmp_path / "bad.onnx").exists()


def test_random_kquant_helper_is_finite():
    rng = np.random.default_rng(0)
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        w = gguf.quants.dequantize(random_kquant(name, (4, 512), rng, 0.1), T[name])
        assert np.isfinite(w).all() and 0.01 < float(np.std(w)) < 1.0


def test_export_standard_gguf_model_runs_in_onnxruntime(tmp_path):
    """``olv export-standard --feedback`` inlines the ggml decoders; onnxruntime's logits match."""
    import onnxruntime as ort

    from olv_runtime.builder import export_standard

    path = write_gguf(tmp_path / "m.gguf", "qwen2", "Q4_K", layers=1)
    olv_runtime.convert(path, tmp_path / "m.onnx")
    model = olv_runtime.load(tmp_path / "m.onnx")
    std = export_standard(model, feedback=True)
    # F32 tensors stay external, in the .gguf beside it
    (tmp_path / "std.onnx").write_bytes(std.proto.SerializeToString())
    sess = ort.InferenceSession(str(tmp_path / "std.onnx"), providers=["CPUExecutionProvider"])
    cache = olv_runtime.empty_cache(model)
    ids = np.array([[5, 17, 99]], np.int64)
    feeds = {"input_ids": ids, **{k: np.asarray(v) for k, v in cache.items()}}
    (got,) = sess.run(["logits"], {i.name: feeds[i.name] for i in sess.get_inputs()})
    ref = olv_runtime.make_state(model, cache).run({"input_ids": ids})["logits"]
    assert float(np.max(np.abs(got - ref))) <= 1e-4
