"""Integer scores of INT8/INT4 key blocks against an int8 query (``paged_attention(...,
int8_query=True)``, the compiled paged decode step in int8-activation mode) and the
register-blocked ``p @ V`` of the paged kernel.

Oracle: a float64 numpy attention over the cache's blocks that follows the documented rounding
(olv_runtime.kernels.paged_attention.paged_attention, ``int8_query``): each query head quantized
to int8 with ``d = max|q| / 127``, codes ``rint(q / d)`` clipped to [-127, 127]; the score of a
key of an INT8/INT4 block is ``S * (d * scale) * kscale`` with ``S`` the integer dot product of
the query codes and the block's key codes (read from the block's own payload); keys of dense
blocks and every value use the block's decoded float values. Tolerance: rtol 1e-5, atol 1e-6
(float32 rounding of the score multipliers and of the softmax/accumulation). The VNNI and AVX2
paths give the same integer sums, so their outputs are compared bitwise.
"""
from __future__ import annotations

import numpy as np
import pytest

from olv_runtime.kernels import packed_i8
from olv_runtime.kernels.paged_attention import paged_attention
from olv_runtime.kv.paged import Geometry, PagedKV, SealPolicy, block_format, empty_paged_cache
from olv_runtime.structs.initializers import AffineValue


def _key_codes(field, d):
    """Integer key codes [KVH, BS, D] and scales [KVH, BS] of an INT8/INT4 block field."""
    kvh, bs = field.shape[0], field.shape[1]
    raw = np.asarray(field.codes).reshape(kvh, bs, -1)
    if block_format(field) == "int8":
        codes = raw.view(np.int8).astype(np.int64)
    else:
        lo = (raw & 15).astype(np.int64)
        hi = (raw >> 4).astype(np.int64)
        codes = np.empty((kvh, bs, d), np.int64)
        codes[..., 0::2] = np.where(lo >= 8, lo - 16, lo)
        codes[..., 1::2] = np.where(hi >= 8, hi - 16, hi)
    sc = np.asarray(field.scale, np.float32)
    scale = sc.reshape(kvh, bs) if sc.size == kvh * bs else np.repeat(sc.reshape(kvh, 1), bs, 1)
    return codes, scale


def _decoded(field):
    return field.astype(np.float32) if isinstance(field, np.ndarray) else field.decode()


def reference(q, cache, scale):
    """float64 attention of one query [H, D] over every block of ``cache`` (documented
    int8-query rounding for INT8/INT4 key blocks)."""
    h, d = q.shape
    blocks = cache["blocks"]
    kvh = blocks[0]["key"].shape[0]
    grp = h // kvh
    out = np.zeros((h, d))
    for hh in range(h):
        amax = np.float32(np.abs(q[hh]).max())
        dq = amax / np.float32(127.0)
        qc = (np.clip(np.rint(q[hh] / dq), -127, 127).astype(np.int64) if amax > 0
              else np.zeros(d, np.int64))
        qm = np.float64(np.float32(dq * np.float32(scale)))
        g = hh // grp
        scores, vals = [], []
        for b in blocks:
            n = int(b["length"])
            kf = b["key"]
            if isinstance(kf, AffineValue):
                codes, ks = _key_codes(kf, d)
                scores.append((codes[g, :n] @ qc) * qm * ks[g, :n].astype(np.float64))
            else:
                scores.append(_decoded(kf)[g, :n].astype(np.float64) @ q[hh].astype(np.float64)
                              * scale)
            vals.append(_decoded(b["value"])[g, :n].astype(np.float64))
        sc = np.concatenate(scores)
        p = np.exp(sc - sc.max())
        out[hh] = (p / p.sum()) @ np.concatenate(vals)
    return out


def _cache(policy, scales, d, kvh, h, ctx, seed):
    rng = np.random.default_rng(seed)
    mgr = PagedKV(Geometry(kvh, 16, d), SealPolicy(policy, scales=scales), chunk_blocks=8)
    k = rng.standard_normal((ctx, kvh, d)).astype(np.float32)
    v = rng.standard_normal((ctx, kvh, d)).astype(np.float32)
    q = rng.standard_normal((ctx, h, d)).astype(np.float32)
    _, cache = mgr.run(empty_paged_cache(), q, k, v, 1 / np.sqrt(d), True)
    rows, _ = cache.meta.table.rows(kvh)
    q1 = (rng.standard_normal((1, h, d)) * 2).astype(np.float32)
    return cache, rows, q1


CASES = [("int8", "token", 64, 2, 14, 150), ("int4", "token", 64, 2, 14, 150),
         ("int8", "block", 128, 2, 4, 37), ("int4", "block", 64, 4, 4, 100),
         ("float32:1,int8:2,int4", "token", 64, 2, 14, 170),
         ("int8", "token", 48, 2, 4, 40),  # D % 64 != 0: the float path (int8_query ignored)
         # across softmax tiles (PAGED_TILE = 256 keys: running max / rescale between tiles)
         ("int8", "token", 64, 2, 14, 600), ("float32:1,int8:2,int4", "token", 64, 2, 14, 700)]


@pytest.mark.parametrize("policy,scales,d,kvh,h,ctx", CASES)
def test_int8_query_scores_follow_the_documented_rounding(policy, scales, d, kvh, h, ctx):
    cache, rows, q1 = _cache(policy, scales, d, kvh, h, ctx, seed=d + ctx)
    scale = 1 / np.sqrt(d)
    out = np.empty_like(q1)
    paged_attention(q1, rows, rows.shape[0], ctx - 1, scale, True, kvh, 16, out,
                    int8_query=True)
    if d % 64:
        exact = np.empty_like(q1)
        paged_attention(q1, rows, rows.shape[0], ctx - 1, scale, True, kvh, 16, exact)
        np.testing.assert_array_equal(out, exact)
        return
    np.testing.assert_allclose(out[0], reference(q1[0], cache, scale), rtol=1e-5, atol=1e-6)
    # and it is an approximation of the exact-query attention (int8 rounding of q)
    exact = np.empty_like(q1)
    paged_attention(q1, rows, rows.shape[0], ctx - 1, scale, True, kvh, 16, exact)
    assert 0 < float(np.abs(out - exact).max()) < 0.05


@pytest.mark.parametrize("policy,scales,d,kvh,h,ctx", CASES[:5] + CASES[6:])
def test_vnni_and_avx2_int8_query_paths_bitwise_equal(policy, scales, d, kvh, h, ctx):
    cache, rows, q1 = _cache(policy, scales, d, kvh, h, ctx, seed=7 * d + ctx)
    outs = {}
    isas = ["avx2", "avx512vnni"] if packed_i8.HOST_VNNI else ["avx2"]
    try:
        for isa in isas:
            packed_i8.set_isa(isa)
            assert packed_i8.isa() == isa
            out = np.empty_like(q1)
            paged_attention(q1, rows, rows.shape[0], ctx - 1, 1 / np.sqrt(d), True, kvh, 16,
                            out, int8_query=True)
            outs[isa] = out
    finally:
        packed_i8.set_isa(None)
    for isa in isas[1:]:
        np.testing.assert_array_equal(outs[isa], outs["avx2"])


# the all-heads block scores (:func:`_qkblk_i8`, VNNI: one load and transpose of 16 keys for
# every head of the group; heads in a runtime loop, up to QKBLK_MAX_D = 256 features) and the
# fallbacks around it: a group of 9 heads (8 + 1 in the register-blocked INT8/INT4 ``p @ V``),
# D = 256 (four 64-feature chunks), D = 320 (beyond the stack buffer: the per-head path under
# VNNI too), each under both instruction paths against the reference and bitwise equal
ALL_HEADS = [("int8", "token", 256, 1, 9, 40), ("int4", "block", 64, 1, 9, 60),
             ("float32:1,int8:1,int4", "token", 320, 1, 9, 60)]


@pytest.mark.parametrize("policy,scales,d,kvh,h,ctx", ALL_HEADS)
def test_all_heads_block_scores_both_paths_against_reference(policy, scales, d, kvh, h, ctx):
    cache, rows, q1 = _cache(policy, scales, d, kvh, h, ctx, seed=3 * d + h)
    scale = 1 / np.sqrt(d)
    ref = reference(q1[0], cache, scale)
    isas = ["avx2", "avx512vnni"] if packed_i8.HOST_VNNI else ["avx2"]
    outs = {}
    try:
        for isa in isas:
            packed_i8.set_isa(isa)
            out = np.empty_like(q1)
            paged_attention(q1, rows, rows.shape[0], ctx - 1, scale, True, kvh, 16, out,
                            int8_query=True)
            np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-6)
            outs[isa] = out
    finally:
        packed_i8.set_isa(None)
    for isa in isas[1:]:
        np.testing.assert_array_equal(outs[isa], outs["avx2"])


@pytest.mark.parametrize("d", [64, 16, 24])
def test_paged_pv_against_float64_reference(d):
    """float32 / INT8 / INT4 value blocks through the register-blocked ``p @ V`` (D % 16 == 0)
    and the four-keys-per-pass fallback (D = 24), GQA groups of 7 (float32: 4 + 3 heads;
    INT8/INT4: 7 per pass), 9 (8 + 1) and 1."""
    for h, kvh in ((14, 2), (9, 1), (3, 3)):
        cache, rows, q1 = _cache("float32:1,int8:1,int4", "token", d, kvh, h, 90, seed=d + h)
        out = np.empty_like(q1)
        paged_attention(q1, rows, rows.shape[0], 89, 0.3, True, kvh, 16, out)
        keys = np.concatenate([_decoded(b["key"])[:, :int(b["length"])]
                               for b in cache["blocks"]], axis=1)
        vals = np.concatenate([_decoded(b["value"])[:, :int(b["length"])]
                               for b in cache["blocks"]], axis=1)
        grp = h // kvh
        for hh in range(h):
            sc = keys[hh // grp].astype(np.float64) @ q1[0, hh].astype(np.float64) * 0.3
            p = np.exp(sc - sc.max())
            ref = (p / p.sum()) @ vals[hh // grp].astype(np.float64)
            np.testing.assert_allclose(out[0, hh], ref, rtol=1e-5, atol=1e-6)


# -- the compiled paged decode step in int8-activation mode ----------------------------------------
PROMPT = [5, 17, 99, 3, 42, 64, 7]
FORCED = [11, 40, 2, 77, 9, 31, 120, 6, 15, 88, 23, 54, 3, 70, 19, 101, 44, 8, 60, 27, 95, 13,
          36, 81, 4, 57]  # 7 + 26 tokens: sealing at 16 and 32


@pytest.fixture(scope="module")
def d64_models(tmp_path_factory):
    """A tiny Qwen2 with head_dim 64 (hidden 128, 2 query heads, 1 kv head), paged-int8 and
    paged-mixed."""
    import torch
    import transformers

    import olv_runtime

    cfg = transformers.Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=96, vocab_size=128,
                                   max_position_embeddings=256, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("paged_i8q")
    transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(str(d / "ckpt"),
                                                               safe_serialization=True)
    out = {}
    for kv in ("paged-int8", "paged-mixed"):
        olv_runtime.convert(d / "ckpt", d / f"{kv}.onnx", weights="int4-block32", kv=kv)
        out[kv] = olv_runtime.load(d / f"{kv}.onnx")
    return out


def _forced(sess):
    import olv_runtime

    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    rows = [st.run({"input_ids": np.array([PROMPT], np.int64)})["logits"][0, -1].copy()]
    for t in FORCED:
        rows.append(st.run({"input_ids": np.array([[t]], np.int64)})["logits"][0, -1].copy())
    return np.stack(rows)


@pytest.mark.parametrize("kv", ["paged-int8", "paged-mixed"])
def test_compiled_int8_mode_uses_int8_queries(d64_models, kv, monkeypatch):
    """Compiled step (int8 activations) against the per-operator plan in the same mode (whose
    attention reads float queries): close, not equal (the queries are rounded to int8); the
    VNNI and AVX2 paths of the whole step bitwise equal."""
    import olv_runtime
    from olv_runtime.executor import decoder_step as decoder_stack

    monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)

    def sess(compiled):
        return olv_runtime.InferenceSession(d64_models[kv], olv_runtime.SessionOptions(
            compiled_decode=compiled, quantize_activations=True))

    ref = _forced(sess(False))
    isas = ["avx2", "avx512vnni"] if packed_i8.HOST_VNNI else ["avx2"]
    got = {}
    try:
        for isa in isas:
            packed_i8.set_isa(isa)
            s = sess(True)
            assert any(st.kind == "DecoderStack" for st in s._steps)
            got[isa] = _forced(s)
    finally:
        packed_i8.set_isa(None)
    for isa in isas[1:]:
        np.testing.assert_array_equal(got[isa], got["avx2"])
    diff = np.abs(got["avx2"][1:] - ref[1:])
    assert 0 < float(diff.max()) < 0.05
    np.testing.assert_array_equal(got["avx2"][0], ref[0])  # the prompt: per-operator in both


@pytest.mark.parametrize("kv", ["paged-int8", "paged-mixed"])
def test_compiled_step_across_tiles(d64_models, kv, monkeypatch):
    """A 600-token prompt: each of the compiled step's tasks takes 19 blocks, two softmax tiles
    (16 + 3 blocks). Exact mode: the per-operator plan's logits within 1e-4; int8-activation
    mode: close to it (int8 queries) and the VNNI and AVX2 paths bitwise equal."""
    import olv_runtime
    from olv_runtime.executor import decoder_step as decoder_stack

    monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)
    prompt = [(7 * i + 3) % 128 for i in range(600)]

    def run(compiled, quant):
        sess = olv_runtime.InferenceSession(d64_models[kv], olv_runtime.SessionOptions(
            compiled_decode=compiled, quantize_activations=quant))
        st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
        st.run({"input_ids": np.array([prompt], np.int64)})
        return np.stack([st.run({"input_ids": np.array([[t]], np.int64)})["logits"][0, -1].copy()
                         for t in FORCED[:3]])

    np.testing.assert_allclose(run(True, False), run(False, False), atol=1e-4, rtol=0)
    ref = run(False, True)
    isas = ["avx2", "avx512vnni"] if packed_i8.HOST_VNNI else ["avx2"]
    got = {}
    try:
        for isa in isas:
            packed_i8.set_isa(isa)
            got[isa] = run(True, True)
    finally:
        packed_i8.set_isa(None)
    for isa in isas[1:]:
        np.testing.assert_array_equal(got[isa], got["avx2"])
    assert 0 < float(np.abs(got["avx2"] - ref).max()) < 0.05
