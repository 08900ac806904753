"""Write a llama.cpp Q4_0 GGUF with the INT4 values of an olv model (for bench/decode.py's
llama.cpp row; needs ``pip install gguf``).

    python bench/gguf_export.py OLV_MODEL.onnx OUT.gguf [--check]

Every INT4 linear weight (and the tied embedding, which llama.cpp also uses as the output
matrix) goes to Q4_0 without re-quantizing: the olv block-32 codes ``q`` in [-8, 7] become the
Q4_0 nibbles ``q + 8`` (llama.cpp order: byte j of a block holds elements j and j + 16) and the
float32 block scale becomes Q4_0's float16 ``d`` — the only possible difference from the olv
values is that scale rounding (relative error <= 2^-11; none for models from ``olv convert`` of a
bf16 checkpoint, whose scales are float16-exact: ``--check`` reports 0). Norm weights and q/k/v biases stay float32.
Architecture ``qwen2``. The model's byte-level BPE ``tokenizer.json`` (recorded beside it, e.g.
``olv make-checkpoint`` + ``olv convert``) and its chat template are written as the GGUF's
tokenizer; without one (the benchmark's random checkpoint) a placeholder BPE vocabulary of
``vocab_size`` tokens is written (token ids only: text prompts encode to nothing). ``--check`` reads
the file back with gguf's reader and compares the dequantized weights with the olv values.

Untested against llama.cpp itself here (llama-cpp-python is not installed on the benchmark
machine); decode.py only runs it when ``llama_cpp`` imports.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

from olv_runtime.io.sidecars import sidecar_path

HERE = pathlib.Path(__file__).resolve().parent


def _olv(olv_model):
    sys.path.insert(0, str(HERE))
    from ort_export import _olv_constants

    return _olv_constants(olv_model)


def signed_codes(w) -> np.ndarray:
    """int8 [N, K] codes of a signed INT4 AffineValue (block 32 along K, no zero point)."""
    n, k = w.shape
    if w.block_size != 32 or k % 32 or w.zero_point is not None or w.axis != 1 or not w.signed:
        raise ValueError(f"{w.name}: expected symmetric signed INT4, block 32 along K")
    b = np.asarray(w.codes, np.uint8)[: n * k // 2]
    nib = np.empty(n * k, np.int8)
    nib[0::2] = (b & 15).astype(np.int8)
    nib[1::2] = (b >> 4).astype(np.int8)
    nib = ((nib ^ 8) - 8).astype(np.int8)  # sign-extend the 4-bit codes
    return nib.reshape(n, k)


def q4_0_bytes(w) -> np.ndarray:
    """Q4_0 blocks (uint8 [N, K/32*18]) holding exactly the olv codes, scales as float16."""
    n, k = w.shape
    q = signed_codes(w).reshape(n, k // 32, 32).astype(np.int16) + 8  # 0..15
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)          # [N, KB, 16]
    d = np.asarray(w.scale, np.float32).astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
    return np.concatenate([d, qs], axis=2).reshape(n, k // 32 * 18)


def q4_0_weight_bytes(olv_model) -> int:
    """Bytes of the Q4_0 linear weights read per token (lm_head = the tied embedding)."""
    _, c = _olv(olv_model)
    return sum(v.shape[0] * v.shape[1] // 32 * 18 for n, v in c.items()
               if hasattr(v, "codes") and n.endswith(".weight"))


NAMES = {  # olv (checkpoint) name suffix -> GGUF name suffix
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

QK_NORM_NAMES = {"self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight"}  # Qwen3


def _tokenizer_metadata(model, V: int):
    """(pre, tokens, token types, merges, chat template) for the GGUF from the byte-level BPE
    ``tokenizer.json`` recorded beside ``model`` (``olv make-checkpoint`` / a Qwen2 checkpoint),
    or None when there is none or it is of another kind (a placeholder is written then).
    Ids beyond the tokenizer (an embedding padded past the vocabulary) get unused placeholders."""
    import gguf

    path = sidecar_path(model, "tokenizer.json")
    if path is None:
        return None
    tj = json.loads(path.read_text(encoding="utf-8"))
    m, pre_tok = tj.get("model") or {}, tj.get("pre_tokenizer") or {}
    if m.get("type") != "BPE":
        return None
    if pre_tok.get("type") == "ByteLevel" and pre_tok.get("use_regex", True):
        pre = "default"  # GPT-2's split (ByteLevel's own regex)
    else:
        return None
    by_id = {i: t for t, i in m["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in by_id}
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
        types[a["id"]] = gguf.TokenType.CONTROL if a.get("special") else \
            gguf.TokenType.USER_DEFINED
    if max(by_id) >= V:
        return None
    tokens = [by_id.get(i, f"<unused{i}>") for i in range(V)]
    ttypes = [types.get(i, gguf.TokenType.UNUSED) for i in range(V)]
    merges = [mg if isinstance(mg, str) else " ".join(mg) for mg in m.get("merges", [])]
    template = None
    cfg = sidecar_path(model, "tokenizer_config.json")
    if cfg is not None:
        t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        template = t if isinstance(t, str) else None
    return pre, tokens, ttypes, merges or ["<unused0> <unused1>"], template


def export(olv_model, out_path, progress=print) -> pathlib.Path:
    import gguf

    t0 = time.perf_counter()
    model, c = _olv(olv_model)
    md = model.metadata()
    L = int(md["olv.num_layers"])
    V = int(md["olv.vocab_size"])
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name("olv-bench-qwen2")
    w.add_context_length(32768)
    w.add_embedding_length(int(md["olv.hidden_size"]))
    w.add_block_count(L)
    w.add_feed_forward_length(int(md["olv.intermediate_size"]))
    w.add_head_count(int(md["olv.num_heads"]))
    w.add_head_count_kv(int(md["olv.num_kv_heads"]))
    w.add_rope_freq_base(float(md["olv.rope_theta"]))
    w.add_layer_norm_rms_eps(float(md["olv.rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("gpt2")
    eos = int(md.get("olv.eos_token_id", V - 1))
    real = _tokenizer_metadata(model, V)
    if real is not None:  # the model's own byte-level BPE tokenizer.json (and chat template)
        pre, tokens, types, merges, template = real
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        if template:
            w.add_chat_template(template)
        progress(f"tokenizer: {len(tokens)} tokens, {len(merges)} merges, pre {pre!r} "
                 f"(from tokenizer.json beside {olv_model})")
    else:
        w.add_tokenizer_pre("qwen2")
        w.add_token_list([f"<t{i}>" for i in range(V)])
        w.add_token_types([gguf.TokenType.NORMAL] * V)
        w.add_token_merges(["<t1> <t2>"])  # llama.cpp refuses a BPE vocabulary without merges
        progress("tokenizer: a placeholder vocabulary (no usable tokenizer.json beside the "
                 "model): feed token ids, text prompts encode to nothing")
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    Q4 = gguf.GGMLQuantizationType.Q4_0

    def put(name, src):
        v = c[src]
        if hasattr(v, "codes"):
            w.add_tensor(name, q4_0_bytes(v), raw_dtype=Q4)
        else:
            w.add_tensor(name, np.ascontiguousarray(v, np.float32))

    put("token_embd.weight", "model.embed_tokens.weight")
    if md.get("olv.tie_word_embeddings", "1") != "1":
        put("output.weight", "lm_head.weight")
    put("output_norm.weight", "model.norm.weight")
    for i in range(L):
        for src, dst in NAMES.items():
            put(f"blk.{i}.{dst}", f"model.layers.{i}.{src}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    progress(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB, Q4_0) in {time.perf_counter() - t0:.1f} s")
    return out


def export_f16(checkpoint_dir, out_path, progress=print) -> pathlib.Path:
    """An F16 GGUF (norms and biases F32) of a Hugging Face Qwen2 or Qwen3 checkpoint (Qwen3:
    ``attn_q_norm`` / ``attn_k_norm`` and the head size as ``key_length``/``value_length``): the
    input of llama.cpp's own quantizer (:func:`quantize`)."""
    import json

    import gguf

    sys.path.insert(0, str(HERE.parent))
    from olv_runtime.models.checkpoint import Checkpoint
    from olv_runtime.models.qwen_graph import QwenConfig

    t0 = time.perf_counter()
    cfg = json.loads((pathlib.Path(checkpoint_dir) / "config.json").read_text())
    qc = QwenConfig(cfg)
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    L, V = qc.num_layers, qc.vocab_size
    arch = "qwen3" if qc.has_qk_norm else "qwen2"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"olv-bench-{arch}-f16")
    if qc.has_qk_norm:
        w.add_key_length(qc.head_dim)
        w.add_value_length(qc.head_dim)
    w.add_context_length(int(cfg.get("max_position_embeddings", 32768)))
    w.add_embedding_length(qc.hidden_size)
    w.add_block_count(L)
    w.add_feed_forward_length(qc.intermediate_size)
    w.add_head_count(qc.num_heads)
    w.add_head_count_kv(qc.num_kv_heads)
    w.add_rope_freq_base(qc.rope_theta)
    w.add_layer_norm_rms_eps(qc.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"<t{i}>" for i in range(V)])
    w.add_token_types([gguf.TokenType.NORMAL] * V)
    w.add_token_merges(["<t1> <t2>"])  # llama.cpp refuses a BPE vocabulary without merges
    w.add_eos_token_id(V - 1)
    w.add_bos_token_id(V - 1)
    with Checkpoint(checkpoint_dir) as ck:
        def put(name, src):
            a = ck.get(src)
            w.add_tensor(name, np.ascontiguousarray(a, np.float16 if a.ndim == 2 else np.float32))

        put("token_embd.weight", "model.embed_tokens.weight")
        if not qc.tie_word_embeddings:
            put("output.weight", "lm_head.weight")
        put("output_norm.weight", "model.norm.weight")
        names = dict(NAMES, **QK_NORM_NAMES) if qc.has_qk_norm else NAMES
        for i in range(L):
            for src, dst in names.items():
                if src.endswith(".bias") and f"model.layers.{i}.{src}" not in ck:
                    continue  # Qwen3: no q/k/v biases
                put(f"blk.{i}.{dst}", f"model.layers.{i}.{src}")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    w.close()
    progress(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB, F16) in {time.perf_counter() - t0:.1f} s")
    return out


#: file type name (as llama.cpp's ``llama-quantize`` spells it, lower case) -> llama_cpp's
#: ``LLAMA_FTYPE_*`` constant name
FILE_TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
              "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
              "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
              "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
              "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def quantize(f16_path, out_path, file_type: str, threads=2, progress=print) -> pathlib.Path:
    """``out_path`` = ``f16_path`` quantized to ``file_type`` (a key of :data:`FILE_TYPES`, e.g.
    ``q4_k_m``, ``q8_0``) by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``),
    which picks the per-tensor types of that file type exactly as ``llama-quantize`` does.
    Raises KeyError for an unknown type, RuntimeError when the quantizer fails."""
    import ctypes

    import llama_cpp

    if file_type not in FILE_TYPES:
        raise KeyError(f"file type {file_type!r}: expected one of {sorted(FILE_TYPES)}")
    t0 = time.perf_counter()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FILE_TYPES[file_type])
    params.nthread = threads
    log_path = pathlib.Path(str(out_path) + ".quantize.log")
    # llama.cpp prints a line per tensor on the C stderr: into a log file beside the output
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 2)
            rc = llama_cpp.llama_model_quantize(str(f16_path).encode(), str(out_path).encode(),
                                                ctypes.byref(params))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({file_type}) returned {rc} (log: {log_path})")
    progress(f"wrote {out_path} ({file_type.upper()} by llama.cpp) in "
             f"{time.perf_counter() - t0:.1f} s")
    return pathlib.Path(out_path)


def quantize_q4_k_m(f16_path, out_path, threads=2, progress=print) -> pathlib.Path:
    """Q4_K_M with llama.cpp's own quantizer: :func:`quantize` with ``"q4_k_m"``."""
    return quantize(f16_path, out_path, "q4_k_m", threads, progress)


def check(olv_model, gguf_path, names=("token_embd.weight", "blk.0.attn_q.weight",
                                       "blk.23.ffn_down.weight")) -> float:
    """Max relative difference between dequantized GGUF tensors and the olv values."""
    import gguf
    from gguf.quants import dequantize

    _, c = _olv(olv_model)
    inv = {"token_embd.weight": "model.embed_tokens.weight"}
    for src, dst in NAMES.items():
        inv.update({f"blk.{i}.{dst}": f"model.layers.{i}.{src}" for i in range(64)})
    worst = 0.0
    reader = gguf.GGUFReader(str(gguf_path))
    for t in reader.tensors:
        if t.name not in names:
            continue
        v = c[inv[t.name]]
        ref = signed_codes(v).astype(np.float32) * np.repeat(np.asarray(v.scale, np.float32), 32, 1)
        got = dequantize(t.data, t.tensor_type).reshape(ref.shape)
        rel = float(np.abs(got - ref).max() / np.abs(ref).max())
        print(f"  {t.name}: {list(ref.shape)} max |diff| / max |w| = {rel:.2e}")
        worst = max(worst, rel)
    return worst


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("olv_model")
    ap.add_argument("out")
    ap.add_argument("--check", action="store_true")
    ns = ap.parse_args()
    export(ns.olv_model, ns.out)
    if ns.check:
        print(f"worst relative difference {check(ns.olv_model, ns.out):.2e}")
