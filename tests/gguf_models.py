"""Tiny random GGUF checkpoints written with gguf-py (``gguf.GGUFWriter``) for the importer tests.

Tensor types Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 are quantized by ``gguf.quants.quantize``, F16 and
F32 written as numpy arrays; gguf-py 0.19 has no K-quant encoder, so Q4_K / Q5_K / Q6_K blocks
are random valid bytes whose float16 scales are chosen to give weights of a sensible size
(:func:`random_kquant`). Norm weights and biases are F32, as llama.cpp writes them.
"""
from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QUANTIZE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16")
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def random_kquant(name: str, shape, rng, size: float = 0.05) -> np.ndarray:
    """Random valid ``name`` blocks (uint8 ``[rows, K/256*type_size]``) with weights ~ ``size``."""
    bs, ts = gguf.GGML_QUANT_SIZES[T[name]]
    rows, k = (1, shape[0]) if len(shape) == 1 else shape
    nb = k // bs
    raw = rng.integers(0, 256, (rows, nb, ts), dtype=np.uint8)

    def f16(x):
        return np.asarray(x, np.float16).view(np.uint8).reshape(rows, nb, 2)

    if name == "Q6_K":  # w = d * scale * (q - 32): scale int8 random, |q - 32| <= 32
        raw[:, :, ts - 2:] = f16(rng.uniform(0.5, 1.0, (rows, nb)) * size / (32 * 64))
    else:  # w = d * sc * q - dmin * m: sc, m in [0, 63], q in [0, 15] (Q5_K: [0, 31])
        qmax = 31 if name == "Q5_K" else 15
        d = rng.uniform(0.5, 1.0, (rows, nb)) * 2 * size / (63 * qmax)
        raw[:, :, 0:2] = f16(d)
        raw[:, :, 2:4] = f16(d * qmax / 2)  # centre the weights around 0 on average
    return raw.reshape(tuple(shape[:-1]) + (nb * ts,))


def encode(ttype: str, w: np.ndarray, rng) -> tuple[np.ndarray, object]:
    """(array, raw_dtype) to pass to ``GGUFWriter.add_tensor`` for a float32 weight ``w``."""
    if ttype == "F32":
        return np.ascontiguousarray(w, np.float32), None
    if ttype == "F16":
        return np.ascontiguousarray(w, np.float16), None
    if ttype in QUANTIZE:
        return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), T[ttype]), T[ttype]
    if ttype in KQUANTS:
        return random_kquant(ttype, w.shape, rng, float(np.std(w)) * 2), T[ttype]
    raise ValueError(ttype)


TOKENS = (["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
          + [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ġt", "he", "Ġthe", "in", "Ġa"])


def write_gguf(path, arch: str = "qwen2", ttype: str = "Q8_0", *, tied: bool = True,
               seed: int = 0, layers: int = 2, hidden: int = 256, inter: int = 512,
               heads: int = 4, kv_heads: int = 2, vocab: int = 320, embd_type: str | None = None,
               tokenizer: bool = True, types: dict | None = None) -> str:
    """Write a tiny random ``arch`` GGUF whose matrices are ``ttype``; returns the path.

    ``types`` overrides the type per matrix, keyed by tensor name (``"blk.1.attn_v.weight"``)
    or by role (``"attn_v"``, ``"ffn_down"``, ``"output"``): a llama.cpp-style mix (Q4_K_M)."""
    types = types or {}

    def ttype_of(name):
        role = name.split(".")[-2]
        return types.get(name, types.get(role, ttype))
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{ttype}")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    if tokenizer:
        toks = TOKENS + [f"<t{i}>" for i in range(vocab - len(TOKENS))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(toks)
        w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL
                           for t in toks])
        w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n", "Ġ a"])
        w.add_eos_token_id(1)
        w.add_bos_token_id(1)
    sd = 0.05

    def mat(n, k):
        return (rng.standard_normal((n, k)) * sd).astype(np.float32)

    def put(name, arr, tt):
        if tt == ttype:
            tt = ttype_of(name)
        data, raw = encode(tt, arr, rng)
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)

    def vec(n, base=1.0):
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    put("token_embd.weight", mat(vocab, hidden), embd_type or ttype)
    for i in range(layers):
        put(f"blk.{i}.attn_norm.weight", vec(hidden), "F32")
        put(f"blk.{i}.attn_q.weight", mat(heads * hd, hidden), ttype)
        put(f"blk.{i}.attn_k.weight", mat(kv_heads * hd, hidden), ttype)
        put(f"blk.{i}.attn_v.weight", mat(kv_heads * hd, hidden), ttype)
        if arch == "qwen2":
            put(f"blk.{i}.attn_q.bias", vec(heads * hd, 0.0), "F32")
            put(f"blk.{i}.attn_k.bias", vec(kv_heads * hd, 0.0), "F32")
            put(f"blk.{i}.attn_v.bias", vec(kv_heads * hd, 0.0), "F32")
        if arch == "qwen3":
            put(f"blk.{i}.attn_q_norm.weight", vec(hd), "F32")
            put(f"blk.{i}.attn_k_norm.weight", vec(hd), "F32")
        put(f"blk.{i}.attn_output.weight", mat(hidden, heads * hd), ttype)
        put(f"blk.{i}.ffn_norm.weight", vec(hidden), "F32")
        put(f"blk.{i}.ffn_gate.weight", mat(inter, hidden), ttype)
        put(f"blk.{i}.ffn_up.weight", mat(inter, hidden), ttype)
        put(f"blk.{i}.ffn_down.weight", mat(hidden, inter), ttype)
    put("output_norm.weight", vec(hidden), "F32")
    if not tied:
        put("output.weight", mat(vocab, hidden), ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
