"""Export an olv INT4 model (``olv convert --weights int4-block32``) to an onnxruntime graph that
computes on exactly the same INT4 weights.

    python bench/ort_export.py OLV_MODEL.onnx OUT.onnx [--accuracy-level 4]

Graph contract ("ORT-GQA-NBits", opsets ai.onnx 21 + com.microsoft 1), the layout the
onnxruntime-genai builder emits for CPU INT4 models:

* inputs: ``input_ids`` int64 [1, S]; ``seqlens_k`` int32 [1] (= total length - 1);
  ``total_sequence_length`` int32 scalar; ``past_key.{i}`` / ``past_value.{i}`` float32
  [1, KVH, P, D] (BNSH, P = 0 for the first call).
* outputs: ``logits`` float32 [1, S, vocab]; ``present_key.{i}`` / ``present_value.{i}``
  [1, KVH, P + S, D].
* embedding: ``com.microsoft.GatherBlockQuantized`` (uint8 data, bits 4, block 32, default zero
  point 8) over the encoded embedding; the tied lm_head is a ``MatMulNBits`` over the same bytes
  (stored a second time: ONNX initializers cannot share storage with another shape).
* per layer: ``SimplifiedLayerNormalization`` (layer 0) / ``SkipSimplifiedLayerNormalization``
  (residual add + RMSNorm fused); q/k/v as ONE ``MatMulNBits`` (N = H*D + 2*KVH*D, bias input)
  feeding ``GroupQueryAttention`` in packed-QKV form with ``do_rotary=1`` (rotary inside the
  attention, cos/sin caches [4096, D/2] from the model's ``inv_freq``) and past/present KV;
  o_proj ``MatMulNBits``; gate/up as ONE ``MatMulNBits`` (N = 2*I) + ``Split``;
  ``Sigmoid``/``Mul``/``Mul`` (SiLU gate); down_proj ``MatMulNBits``.
* every ``MatMulNBits``: bits 4, block_size 32, B = uint8 [N, K/32, 16] with the *unsigned*
  codes ``u = q + 8`` (no zero_points input: the default zero point 8 gives back exactly
  ``(u - 8) * scale = q * scale``), scales float32 [N, K/32]; ``accuracy_level`` from the
  command line (4: activations quantized to int8 per block, like llama.cpp; 0: unset, float).

The olv codes are signed nibbles (two per byte, low first, row-major over [N, K]); flipping bit 3
of every nibble (``byte ^ 0x88``) turns ``q`` into ``u = q + 8``, and with K a multiple of 32 the
byte order is already MatMulNBits' [N, K/32, 16] block order.
"""
from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np

ROPE_CACHE_LEN = 4096


def _olv_constants(olv_model):
    """name -> numpy array (dense) or AffineValue (encoded) of an olv model, without decoding."""
    import olv_runtime

    model = olv_runtime.load(olv_model) if not hasattr(olv_model, "proto") else olv_model
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(enable_fusion=False))
    return model, sess._constants


def _unsigned_blocks(w):
    """MatMulNBits B ([N, K/32, 16] uint8, u = q + 8) and scales [N, K/32] of an AffineValue."""
    n, k = w.shape
    if (w.block_size != 32 or k % 32 or w.zero_point is not None or w.axis != 1 or w.bits != 4
            or not w.signed):
        raise ValueError(f"expected symmetric INT4 block-32 along K with K % 32 == 0, got "
                         f"shape {w.shape} block {w.block_size} zp {w.zero_point is not None}")
    codes = np.asarray(w.codes, np.uint8)[: n * k // 2] ^ np.uint8(0x88)
    return codes.reshape(n, k // 32, 16), np.ascontiguousarray(w.scale, np.float32)


def export(olv_model, out_path, accuracy_level: int = 4, progress=print) -> pathlib.Path:
    """Write the ORT graph (model + ``.data`` external file) for ``olv_model``; returns out_path."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    t0 = time.perf_counter()
    model, c = _olv_constants(olv_model)
    md = model.metadata()
    L = int(md["olv.num_layers"])
    H = int(md["olv.num_heads"])
    KVH = int(md["olv.num_kv_heads"])
    D = int(md["olv.head_dim"])
    E = int(md["olv.hidden_size"])
    I = int(md["olv.intermediate_size"])
    V = int(md["olv.vocab_size"])
    eps = float(md["olv.rms_norm_eps"])
    tied = md.get("olv.tie_word_embeddings", "1") == "1"
    if md.get("olv.architecture") != "Qwen2ForCausalLM":
        raise ValueError(f"only Qwen2ForCausalLM is supported, got {md.get('olv.architecture')}")

    inits: list = []
    nodes: list = []

    def init(name, arr):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def nbits(x, prefix, ws, biases, out):
        """One MatMulNBits over the weights ``ws`` concatenated along N (+ optional bias)."""
        bs, ss = zip(*(_unsigned_blocks(c[w]) for w in ws))
        b = np.concatenate(bs, 0)
        s = np.concatenate(ss, 0)
        n, k = b.shape[0], b.shape[1] * 32
        ins = [x, init(prefix + ".B", b), init(prefix + ".scales", s)]
        if biases is not None:
            bias = np.concatenate([np.asarray(c[bn], np.float32) for bn in biases])
            ins += ["", "", init(prefix + ".bias", bias)]
        nodes.append(helper.make_node("MatMulNBits", ins, [out], name=prefix, domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=32,
                                      accuracy_level=int(accuracy_level)))
        return out

    # rotary caches (float32: positions * inv_freq, as the olv graph computes them)
    inv_freq = np.asarray(c["model.rotary_emb.inv_freq"], np.float32)
    freqs = np.arange(ROPE_CACHE_LEN, dtype=np.float32)[:, None] * inv_freq[None, :]
    init("cos_cache", np.cos(freqs).astype(np.float32))
    init("sin_cache", np.sin(freqs).astype(np.float32))

    # embedding
    emb = c["model.embed_tokens.weight"]
    eb, es = _unsigned_blocks(emb)
    init("embed.data", eb.reshape(V, E // 2))
    init("embed.scales", es)
    nodes.append(helper.make_node("GatherBlockQuantized", ["embed.data", "input_ids", "embed.scales"],
                                  ["h0"], name="embed", domain="com.microsoft", bits=4,
                                  block_size=32, gather_axis=0, quantize_axis=1))
    h = "h0"
    prev_mlp = None
    for i in range(L):
        p = f"model.layers.{i}."
        ln_in = init(p + "input_layernorm.weight", np.asarray(c[p + "input_layernorm.weight"], np.float32))
        if prev_mlp is None:
            nodes.append(helper.make_node("SimplifiedLayerNormalization", [h, ln_in], [f"x{i}"],
                                          name=f"ln_in{i}", axis=-1, epsilon=eps, stash_type=1))
        else:
            nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [prev_mlp, h, ln_in],
                                          [f"x{i}", "", "", f"h{i}a"], name=f"ln_in{i}",
                                          domain="com.microsoft", epsilon=eps))
            h = f"h{i}a"
        a = p + "self_attn."
        nbits(f"x{i}", f"l{i}.qkv", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
              [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], f"qkv{i}")
        nodes.append(helper.make_node(
            "GroupQueryAttention",
            [f"qkv{i}", "", "", f"past_key.{i}", f"past_value.{i}", "seqlens_k",
             "total_sequence_length", "cos_cache", "sin_cache"],
            [f"attn{i}", f"present_key.{i}", f"present_value.{i}"], name=f"gqa{i}",
            domain="com.microsoft", num_heads=H, kv_num_heads=KVH, do_rotary=1,
            rotary_interleaved=0, scale=float(1.0 / np.sqrt(D)), local_window_size=-1))
        nbits(f"attn{i}", f"l{i}.o", [a + "o_proj.weight"], None, f"o{i}")
        ln_post = init(p + "post_attention_layernorm.weight",
                       np.asarray(c[p + "post_attention_layernorm.weight"], np.float32))
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [f"o{i}", h, ln_post],
                                      [f"x{i}m", "", "", f"h{i}b"], name=f"ln_post{i}",
                                      domain="com.microsoft", epsilon=eps))
        h = f"h{i}b"
        m = p + "mlp."
        nbits(f"x{i}m", f"l{i}.gate_up", [m + "gate_proj.weight", m + "up_proj.weight"], None, f"gu{i}")
        init(f"l{i}.split", np.array([I, I], np.int64))
        nodes.append(helper.make_node("Split", [f"gu{i}", f"l{i}.split"], [f"g{i}", f"u{i}"],
                                      name=f"split{i}", axis=-1))
        nodes.append(helper.make_node("Sigmoid", [f"g{i}"], [f"sg{i}"], name=f"sig{i}"))
        nodes.append(helper.make_node("Mul", [f"g{i}", f"sg{i}"], [f"silu{i}"], name=f"silu{i}"))
        nodes.append(helper.make_node("Mul", [f"silu{i}", f"u{i}"], [f"act{i}"], name=f"gate{i}"))
        nbits(f"act{i}", f"l{i}.down", [m + "down_proj.weight"], None, f"mlp{i}")
        prev_mlp = f"mlp{i}"
    fn = init("model.norm.weight", np.asarray(c["model.norm.weight"], np.float32))
    nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [prev_mlp, h, fn],
                                  ["xf", "", "", ""], name="ln_final", domain="com.microsoft",
                                  epsilon=eps))
    if tied:
        init("lm_head.B", eb)
        init("lm_head.scales", es)
        nodes.append(helper.make_node("MatMulNBits", ["xf", "lm_head.B", "lm_head.scales"], ["logits"],
                                      name="lm_head", domain="com.microsoft", K=E, N=V, bits=4,
                                      block_size=32, accuracy_level=int(accuracy_level)))
    else:
        nbits("xf", "lm_head", ["lm_head.weight"], None, "logits")

    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("logits", f32, [1, "S", V])]
    for i in range(L):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", f32, [1, KVH, "P", D]))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", f32, [1, KVH, "T", D]))
    graph = helper.make_graph(nodes, "qwen2_ort_int4", inputs, outputs, inits)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                         helper.make_opsetid("com.microsoft", 1)])
    onnx_model.ir_version = 10
    helper.set_model_props(onnx_model, {"contract": contract(accuracy_level),
                                        "source": str(getattr(model, "path", olv_model))})
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = out.name + ".data"
    if (out.parent / data).exists():
        (out.parent / data).unlink()
    onnx.save_model(onnx_model, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data, size_threshold=1024)
    progress(f"wrote {out} (accuracy_level {accuracy_level}) in {time.perf_counter() - t0:.1f} s")
    return out


def contract(accuracy_level: int) -> str:
    return (f"MatMulNBits(4b,blk32,acc{accuracy_level})+GQA(rotary,past/present)"
            "+SkipSimplifiedLN+GatherBlockQuantized")


def weight_bytes_per_token(olv_model) -> int:
    """Bytes the ORT graph's INT4 linear weights occupy (codes + fp32 scales), lm_head included."""
    model, c = _olv_constants(olv_model)
    total = 0
    for name, v in c.items():
        if hasattr(v, "codes") and name.endswith(".weight"):
            n, k = v.shape
            total += n * k // 2 + 4 * n * (k // 32)
    return total


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("olv_model")
    ap.add_argument("out")
    ap.add_argument("--accuracy-level", type=int, default=4, choices=[0, 1, 4])
    ns = ap.parse_args()
    export(ns.olv_model, ns.out, ns.accuracy_level)
