"""Issue 26 item 5: foreign configs with extreme values fail fast with a clear error.

onnxruntime-genai ``genai_config.json`` (applied when ``olv_runtime.load`` opens the folder's
``model.onnx``) and GGUF metadata (``olv convert model.gguf``): zero or huge layer and head
counts, non-object entries, deep nesting, huge name patterns, and an unknown
``tokenizer.ggml.pre`` (refused, as llama.cpp refuses it, instead of a silent GPT-2 fallback).
Each case must end in a ModelFormatError / ConversionError within a generous bound.
"""
from __future__ import annotations

import json
import pathlib
import struct
import time

import gguf
import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import ConversionError, ModelFormatError
from olv_runtime.proto.helper import make_tensor_value_info
from olv_runtime.io import Model
from olv_runtime.models.gguf_reader import GGUFFile
from olv_runtime.models.gguf_tokenizer import build_tokenizer

from gguf_models import write_gguf

T = pb.TensorProto


def _genai_folder(tmp_path: pathlib.Path, decoder: dict | None = None, raw: str | None = None):
    """A model.onnx whose interface is an onnxruntime-genai decoder's (2 layers), with the
    given genai_config.json beside it."""
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=21)
    g = m.graph
    g.input.append(make_tensor_value_info("input_ids", T.INT64, ["B", "S"]))
    g.input.append(make_tensor_value_info("attention_mask", T.INT64, ["B", "T"]))
    for i in range(2):
        for side in ("key", "value"):
            g.input.append(make_tensor_value_info(f"past_key_values.{i}.{side}", T.FLOAT,
                                                  ["B", 2, "P", 16]))
            g.output.append(make_tensor_value_info(f"present.{i}.{side}", T.FLOAT,
                                                   ["B", 2, "T", 16]))
    g.output.append(make_tensor_value_info("logits", T.FLOAT, ["B", "S", 32]))
    tmp_path.mkdir(parents=True, exist_ok=True)
    olv_runtime.save(Model(m), tmp_path / "model.onnx")
    base = {"filename": "model.onnx", "num_hidden_layers": 2, "head_size": 16,
            "num_key_value_heads": 2, "num_attention_heads": 4,
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                       "past_key_names": "past_key_values.%d.key",
                       "past_value_names": "past_key_values.%d.value"},
            "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                        "present_value_names": "present.%d.value"}}
    text = raw if raw is not None else json.dumps(
        {"model": {"decoder": {**base, **(decoder or {})}, "eos_token_id": 1}})
    (tmp_path / "genai_config.json").write_text(text)
    return tmp_path / "model.onnx"


def _load_fails(path, match):
    t0 = time.perf_counter()
    with pytest.raises(ModelFormatError, match=match):
        olv_runtime.load(path)
    assert time.perf_counter() - t0 < 10


def test_genai_folder_control_adapts(tmp_path):
    m = olv_runtime.load(_genai_folder(tmp_path))
    assert len(m.proto.graph.persistent_bindings) == 4


@pytest.mark.parametrize("decoder, match", [
    ({"num_hidden_layers": 0}, r"decoder\.num_hidden_layers must be an integer in \[1, 3\], "
                               r"got int 0"),
    ({"num_hidden_layers": 10 ** 9}, r"num_hidden_layers must be an integer in \[1, 3\], got "
                                     r"int 1000000000"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ({"head_size": 0}, "head_size must be"),
    ({"num_key_value_heads": 2 ** 40}, "num_key_value_heads must be"),
    ({"inputs": ["past_key_values.%d.key"]}, "decoder.inputs and decoder.outputs must be objects"),
    ({"inputs": {"past_key_names": "p" * 2000 + "%d", "past_value_names": "v.%d"}},
     r"past_key_names must be a name pattern of at most 1024 characters .*\(2002 characters\)"),
    ({"outputs": {"present_key_names": "present.%s.%d", "present_value_names": "v.%d"}},
     "present_key_names must be a name pattern"),
    ({"outputs": {"present_key_names": 7, "present_value_names": "v.%d"}},
     "present_key_names must be a name pattern"),
])
def test_genai_decoder_extremes(tmp_path, decoder, match):
    _load_fails(_genai_folder(tmp_path, decoder), match)


@pytest.mark.parametrize("raw, match", [
    (json.dumps({"model": {"decoder": "model.onnx"}}), "got dict / dict / str"),
    (json.dumps({"model": [1]}), "got dict / list / NoneType"),
    (json.dumps([1, 2]), "got list / NoneType / NoneType"),
    ('{"model": ' * 100_000 + "1" + "}" * 100_000, "not JSON: RecursionError"),
    ("{not json", "not JSON: JSONDecodeError"),
])
def test_genai_config_shapes(tmp_path, raw, match):
    _load_fails(_genai_folder(tmp_path, raw=raw), match)


def test_genai_config_size_cap_and_huge_pattern(tmp_path):
    path = _genai_folder(tmp_path)
    # a 10**9-character name pattern would be a 1 GB file: the size cap refuses it unread
    big = {"model": {"decoder": {"filename": "model.onnx", "pad": "x" * (17 << 20)}}}
    (tmp_path / "genai_config.json").write_text(json.dumps(big))
    _load_fails(path, r"genai_config\.json: \d+ bytes; an onnxruntime-genai config of at most "
                      r"16777216 bytes is read")


# ------------------------------------------------------------------------------------------------
# GGUF metadata
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("gguf")
    return pathlib.Path(write_gguf(d / "tiny.gguf", "qwen2", "F32", hidden=64, inter=128,
                                   heads=4, kv_heads=2, vocab=128))


def _patched(src: pathlib.Path, dst: pathlib.Path, key: str, fmt: str, value) -> pathlib.Path:
    """Copy ``src`` with the scalar metadata value of ``key`` overwritten in place."""
    data = bytearray(src.read_bytes())
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4  # past the value type
    struct.pack_into(fmt, data, at, value)
    dst.write_bytes(bytes(data))
    return dst


def _convert_fails(path, tmp_path, match):
    t0 = time.perf_counter()
    with pytest.raises(ConversionError, match=match):
        olv_runtime.convert(path, tmp_path / "out" / "m.onnx")
    assert time.perf_counter() - t0 < 10
    assert not (tmp_path / "out" / "m.onnx").exists()


def test_gguf_control_converts(tiny_gguf, tmp_path):
    olv_runtime.convert(tiny_gguf, tmp_path / "m.onnx")
    assert olv_runtime.load(tmp_path / "m.onnx").metadata()["olv.num_layers"] == "2"


@pytest.mark.parametrize("key, fmt, value, match", [
    ("qwen2.attention.head_count", "<I", 0,
     r"qwen2\.attention\.head_count must be an integer in \[1, 64\], got int 0"),
    ("qwen2.attention.head_count", "<I", 3, "head_count 3 is not a multiple of head_count_kv"),
    ("qwen2.attention.head_count_kv", "<I", 0, "head_count_kv must be an integer in"),
    ("qwen2.block_count", "<I", 10 ** 9, r"block_count must be an integer in \[1, 65536\]"),
    ("qwen2.block_count", "<I", 5, r"block_count is 5, but the file has tensors for 2 layers"),
    ("qwen2.block_count", "<I", 0, "block_count must be an integer"),
    ("qwen2.embedding_length", "<I", 0, "embedding_length must be"),
    ("qwen2.feed_forward_length", "<I", 0, "feed_forward_length must be"),
    ("qwen2.attention.key_length", "<I", 0, "key_length must be"),
    ("qwen2.attention.layer_norm_rms_epsilon", "<f", float("nan"),
     "layer_norm_rms_epsilon must be a finite number > 0"),
    ("qwen2.rope.freq_base", "<f", float("inf"), "freq_base must be a finite number > 0"),
    ("qwen2.context_length", "<I", 0, "context_length must be"),
    ("tokenizer.ggml.eos_token_id", "<I", 10 ** 6, r"eos_token_id must be an integer in \[0, 127\]"),
])
def test_gguf_metadata_extremes(tiny_gguf, tmp_path, key, fmt, value, match):
    bad = _patched(tiny_gguf, tmp_path / "bad.gguf", key, fmt, value)
    _convert_fails(bad, tmp_path, match)


def _tokenizer_gguf(path, pre):
    tokens = ["<|endoftext|>"] + [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ġt"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["tekken", "smollm", "deepseek-llm", "chatglm-bpe", "Qwen2"])
def test_unknown_pretokenizer_is_refused(tmp_path, pre):
    path = _tokenizer_gguf(tmp_path / "t.gguf", pre)
    with GGUFFile(path) as g:
        with pytest.raises(ConversionError, match=rf"tokenizer\.ggml\.pre '{pre}' is not a "
                                                  r"pre-tokenizer this importer knows .*known: "):
            build_tokenizer(g)


@pytest.mark.parametrize("pre", [None, "", "default", "gpt-2", "qwen2", "llama-bpe"])
def test_known_pretokenizers_build(tmp_path, pre):
    path = _tokenizer_gguf(tmp_path / "t.gguf", pre)
    with GGUFFile(path) as g:
        tok, _cfg = build_tokenizer(g)
    assert tok.encode("t!").ids == [tok.token_to_id("t"), tok.token_to_id("!")]
