"""Paged KV cache with per-block encodings and fused paged attention (seed 000 PR06, issue 5).

Oracles: a slow float64 attention in this file (``naive_attention``), onnx.reference's
Attention-23, the contiguous kernel, and the formats' own decoders (AffineValue.decode =
DequantizeLinear; the codebook decoder and seed 000's FunctionProto decoder of type 1102).
"""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import kernels
from olv_runtime import proto as pb
from olv_runtime.counters import Counters, recording
from olv_runtime.errors import InvalidArgument, ValidationError
from olv_runtime.proto.helper import make_node
from olv_runtime.kv.paged import (
    Geometry,
    PagedKV,
    SealPolicy,
    block_counts,
    block_format,
    empty_paged_cache,
    kv_block_type,
    kv_cache_type,
)

SEED = 1234


def naive_attention(q, keys, values, past, scale, causal=True):
    """q [S, H, D]; keys/values [KVH, T, D] (all tokens incl. the new ones); float64."""
    s_n, h_n, d = q.shape
    kvh = keys.shape[0]
    grp = h_n // kvh
    out = np.zeros((s_n, h_n, d), np.float64)
    for s in range(s_n):
        n = past + s + 1 if causal else keys.shape[1]
        for h in range(h_n):
            k = keys[h // grp, :n].astype(np.float64)
            v = values[h // grp, :n].astype(np.float64)
            if n == 0:
                continue
            sc = k @ q[s, h].astype(np.float64) * scale
            p = np.exp(sc - sc.max())
            out[s, h] = (p / p.sum()) @ v
    return out


def decoded(field) -> np.ndarray:
    """The logical float32 [KVH, BS, D] of a block field, by the format's own decoder."""
    if isinstance(field, np.ndarray):
        return field.astype(np.float32)
    return field.decode()


def cache_arrays(cache):
    """Decoded keys/values [KVH, T, D] of a cache value (test oracle only)."""
    ks, vs = [], []
    for b in cache["blocks"]:
        n = int(b["length"])
        ks.append(decoded(b["key"])[:, :n])
        vs.append(decoded(b["value"])[:, :n])
    return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def run_steps(policy, steps, geom=Geometry(2, 4, 64), h=4, seed=SEED, counters=None,
              chunk_blocks=3):
    """Feed ``steps`` (token counts per call) through one PagedKV; yields per call
    (q, past, out, cache, K, V) with K/V the exact float keys/values so far."""
    rng = np.random.default_rng(seed)
    mgr = PagedKV(geom, SealPolicy(policy) if isinstance(policy, str) else policy,
                  chunk_blocks, counters)
    cache = empty_paged_cache()
    keys = np.zeros((geom.kv_heads, 0, geom.head_dim), np.float32)
    vals = keys.copy()
    for s in steps:
        q = rand(rng, s, h, geom.head_dim)
        k = rand(rng, s, geom.kv_heads, geom.head_dim)
        v = rand(rng, s, geom.kv_heads, geom.head_dim)
        past = keys.shape[1]
        keys = np.concatenate([keys, k.transpose(1, 0, 2)], axis=1)
        vals = np.concatenate([vals, v.transpose(1, 0, 2)], axis=1)
        out, cache = mgr.run(cache, q, k, v, 1 / np.sqrt(geom.head_dim), True)
        yield q, past, out, cache, keys, vals


# -- block bookkeeping ----------------------------------------------------------------------------
@pytest.mark.parametrize("length, blocks, fill", [(4, 1, 4), (8, 2, 4), (5, 2, 1)])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_block_counts_at_boundaries(length, blocks, fill, mode):
    steps = [length] if mode == "prefill" else [1] * length
    *_, (_, _, _, cache, _, _) = run_steps("float32", steps, Geometry(2, 4, 8))
    assert block_counts(cache) == (blocks, fill)
    assert int(cache["length"]) == length
    assert [int(b["start"]) for b in cache["blocks"]] == [4 * i for i in range(blocks)]


def test_cache_struct_validates_against_declared_type():
    from olv_runtime.structs.catalogue import Catalogue
    from olv_runtime.structs.runtime import check_struct_value

    cat = Catalogue([kv_block_type(2, 4, 8), kv_cache_type()])
    ref = pb.StructTypeProto(type_ref=3001)
    *_, (_, _, _, cache, _, _) = run_steps("float32:1,int8", [9], Geometry(2, 4, 8))
    assert check_struct_value("cache", cache, ref, cat) is cache
    bad = cache.replace(length=np.array(1.0))
    with pytest.raises(InvalidArgument, match="cache.length: expected element type INT64"):
        check_struct_value("cache", bad, ref, cat)
    blk = cache["blocks"][0].replace(key=np.zeros((2, 4, 9), np.float32))
    with pytest.raises(InvalidArgument, match=r"cache.blocks\[0\].key: expected shape \[2, 4, 8\]"):
        check_struct_value("cache", cache.replace(blocks=(blk,)), ref, cat)


# -- numerics --------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [[7], [5, 1, 1, 3, 9, 1]])
def test_dense_blocks_equal_contiguous_attention(steps):
    for q, past, out, cache, keys, vals in run_steps("float32", steps):
        s, h, d = q.shape
        kc = keys[None].copy()
        vc = vals[None].copy()
        ref = kernels.attention(q[None].copy(), kc, vc, past, 1 / np.sqrt(d), True)[0]
        assert np.abs(out - ref).max() <= 1e-5


@pytest.mark.parametrize("policy", ["float16", "int8", "int4", "codebook2",
                                    SealPolicy("int8", scales="block"),
                                    SealPolicy("int4", scales="block"),
                                    SealPolicy("int8", "int4")])
def test_kernel_reads_exactly_the_decoded_blocks(policy):
    """In-loop dequantization = the format's decoder (DequantizeLinear / codebook decoder)."""
    for q, past, out, cache, _, _ in run_steps(policy, [6, 1, 5, 1, 1]):
        pass
    fmts = {block_format(b["key"]) for b in cache["blocks"][:-1]}
    assert "float32" not in fmts or policy == "float16"
    # the cache as read by the next call, decoded by the formats' own decoders
    mgr_out = out
    k, v = cache_arrays(cache)
    # re-run attention over the same cache with a fresh query through a fresh call
    rng = np.random.default_rng(7)
    geom = Geometry(2, 4, 64)
    mgr = PagedKV(geom, SealPolicy("float32"), 3)
    q2 = rand(rng, 1, 4, 64)
    k2, v2 = rand(rng, 1, 2, 64), rand(rng, 1, 2, 64)
    out2, _ = mgr.run(cache, q2, k2, v2, 0.125, True)  # adopted blocks, read as stored
    keys = np.concatenate([k, k2.transpose(1, 0, 2)], axis=1)
    vals = np.concatenate([v, v2.transpose(1, 0, 2)], axis=1)
    ref = naive_attention(q2, keys, vals, k.shape[1], 0.125)
    assert np.abs(out2 - ref).max() <= 1e-5
    assert mgr_out.shape == (1, 4, 64)


def test_codebook_block_decoder_matches_seed_function_decoder():
    from olv_runtime.decoding.decoders import FunctionDecoder
    from olv_runtime.structs.examples import scaled_codebook2_1102

    *_, (_, _, _, cache, _, _) = run_steps("codebook2", [9])
    sv = cache["blocks"][0]["key"]
    assert sv.type_id == 1102 and sv.records == 2 * 4 * 64 // 32
    fn = FunctionDecoder(scaled_codebook2_1102().decoder, sv.root, {"": 21})
    flat = fn.decode(sv.__class__(sv.name, sv.root, sv.payload, sv.records,
                                  (pb.TensorProto.FLOAT, (sv.records * 32,))))
    np.testing.assert_array_equal(flat.reshape(2, 4, 64), sv.decode())


QUANT_TOL = {"int8": 1e-2, "int4": 0.15}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_blocks_close_to_dense(fmt, capsys):
    """Fixed random case: 64 past tokens (block_size 16, D 64, H 4 / KVH 2), then a decode step
    and a 4-token prefill step; max |paged fmt - paged dense| of the attention output."""
    geom = Geometry(2, 16, 64)
    steps = [64, 1, 4]
    dense = [o for _, _, o, *_ in run_steps("float32", steps, geom, chunk_blocks=8)]
    quant = [o for _, _, o, *_ in run_steps(fmt, steps, geom, chunk_blocks=8)]
    errs = [float(np.abs(a - b).max()) for a, b in zip(dense[1:], quant[1:])]
    with capsys.disabled():
        print(f"\n[paged {fmt}] max |attention - dense| decode={errs[0]:.5f} prefill4={errs[1]:.5f}")
    assert max(errs) <= QUANT_TOL[fmt]


def test_mixed_cache_across_sealing_boundaries():
    """float32:1,int8:2,int4 with block_size 4: every decode step equals attention over the
    cache's decoded blocks, blocks move float32 -> int8 -> int4 as they age, and the output
    stays close to the dense result."""
    c = Counters()
    policy = SealPolicy("float32:1,int8:2,int4")
    dense_outs = [o for _, _, o, *_ in run_steps("float32", [3] + [1] * 25)]
    prev = empty_paged_cache()
    worst = 0.0
    for i, (q, past, out, cache, keys, vals) in enumerate(
            run_steps(policy, [3] + [1] * 25, counters=c)):
        # exactly attention over the blocks stored before the call (decoded by their own
        # decoders) plus the new tokens
        s = q.shape[0]
        if past:
            k, v = cache_arrays(prev)
        else:
            k = v = np.zeros((2, 0, 64), np.float32)
        k = np.concatenate([k, keys[:, past:]], axis=1)
        v = np.concatenate([v, vals[:, past:]], axis=1)
        assert np.abs(out - naive_attention(q, k, v, past, 0.125)).max() <= 1e-5
        worst = max(worst, float(np.abs(out - dense_outs[i]).max()))
        assert int(cache["length"]) == past + s
        prev = cache
    assert worst <= 0.3  # measured 0.27: INT4 blocks at contexts of 4..28 tokens (docs/kv_cache.md)
    fmts = [block_format(b["key"]) for b in cache["blocks"]]
    # 28 tokens = 7 full blocks: newest sealed float32, next 2 int8, rest int4
    assert fmts == ["int4"] * 4 + ["int8"] * 2 + ["float32"]
    assert c["kv_blocks_converted"] > 0 and c["bytes_kv_converted"] > 0
    # the next call reads exactly the stored (mixed) blocks
    rng = np.random.default_rng(3)
    q2, k2, v2 = rand(rng, 2, 4, 64), rand(rng, 2, 2, 64), rand(rng, 2, 2, 64)
    out2, nxt = PagedKV(Geometry(2, 4, 64), policy, 3).run(cache, q2, k2, v2, 0.125, True)
    kk, vv = cache_arrays(cache)
    ref = naive_attention(q2, np.concatenate([kk, k2.transpose(1, 0, 2)], 1),
                          np.concatenate([vv, v2.transpose(1, 0, 2)], 1), 28, 0.125)
    assert np.abs(out2 - ref).max() <= 1e-5
    assert block_counts(nxt) == (8, 2)


def test_fully_masked_rows_are_zero():
    """Non-causal attention over an empty cache with zero new tokens is empty; a causal query
    whose keys were all skipped gives zeros (the kernel's defined value)."""
    from olv_runtime.kernels import paged_attention as pk

    q = np.ones((2, 4, 8), np.float32)
    table = np.zeros((0, pk.TABLE_COLS), np.int64)  # no blocks
    out = pk.paged_attention(q, table, 0, 0, 0.5, True, 2, 16, np.full((2, 4, 8), 7, np.float32))
    np.testing.assert_array_equal(out, 0)


# -- bookkeeping: in place, branching, views stay valid -------------------------------------------
def test_append_in_place_and_branching_copies_only_the_open_block():
    c = Counters()
    geom = Geometry(2, 4, 8)
    mgr = PagedKV(geom, SealPolicy("float32"), 4, c)
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, 6, 4, 8), rand(rng, 6, 2, 8), rand(rng, 6, 2, 8)
    _, base = mgr.run(empty_paged_cache(), q, k, v, 0.3, True)  # 2 blocks, last holds 2
    snapshot = base["blocks"][-1]["key"].copy()
    ptr = base["blocks"][-1]["key"].__array_interface__["data"][0]
    q1, k1, v1 = rand(rng, 1, 4, 8), rand(rng, 1, 2, 8), rand(rng, 1, 2, 8)
    before = c.snapshot()
    _, a = mgr.run(base, q1, k1, v1, 0.3, True)  # in place: writes 1 token
    d = Counters.delta(c.snapshot(), before)
    assert d["bytes_copied_kv_prefix"] == 0 and d["kv_blocks_allocated"] == 0
    assert d["bytes_copied_kv_append"] == k1.nbytes + v1.nbytes
    assert a["blocks"][-1]["key"].__array_interface__["data"][0] == ptr
    assert a["blocks"][0] is base["blocks"][0]  # sealed blocks shared, not rebuilt
    # a second branch from the same base must not overwrite slot 2 of the first
    k2 = rand(rng, 1, 2, 8) + 10
    before = c.snapshot()
    _, b = mgr.run(base, q1, k2, v1, 0.3, True)
    d = Counters.delta(c.snapshot(), before)
    assert d["bytes_copied_kv_prefix"] == 2 * (2 * 2 * 8 * 4)  # 2 valid tokens of K and V
    assert b["blocks"][-1]["key"].__array_interface__["data"][0] != ptr
    np.testing.assert_array_equal(a["blocks"][-1]["key"][:, 2], k1[0])
    np.testing.assert_array_equal(b["blocks"][-1]["key"][:, 2], k2[0])
    # the base's view of its 2 valid tokens is unchanged
    np.testing.assert_array_equal(base["blocks"][-1]["key"][:, :2], snapshot[:, :2])


def test_workspace_independent_of_context_and_no_dequantized_bytes():
    peaks = {}
    for ctx in (64, 4096):
        c = Counters()
        gen = run_steps("int8", [ctx, 1], Geometry(2, 16, 64), h=14, counters=c, chunk_blocks=64)
        next(gen)  # prefill ctx tokens
        with recording() as d:  # exactly what the decode call counts
            next(gen)
        peaks[ctx] = d["attention_workspace_peak"]
        assert d["bytes_dequantized"] == 0
        assert d["bytes_read_kv_attention"] > 0
    # per (kv head, query) task: m, l, tile max, accumulators, two tiles of scores, one decoded
    # block and head with its row multipliers, the tile's block list
    # (kernels.paged_attention.workspace_bytes)
    g, w, bs = 7, 256, 16  # w: paged_attention.PAGED_TILE
    assert peaks[64] == peaks[4096] == 2 * (4 * (3 * g + g * 64 + 2 * g * (w + 16) + bs * 64
                                                 + bs) + 16 * w)


# -- ONNX Attention-23 reference (GQA, past lengths 0, 1, 17) -----------------------------------
def _reference(q, k, v, pk, pv, h, kvh):
    from onnx import helper as oh
    from onnx.reference import ReferenceEvaluator

    node = oh.make_node("Attention", ["Q", "K", "V", "", "PK", "PV"], ["Y", "PRK", "PRV"],
                        is_causal=1, q_num_heads=h, kv_num_heads=kvh)
    m = oh.make_model(oh.make_graph(
        [node], "g",
        [oh.make_tensor_value_info(n, 1, None) for n in ("Q", "K", "V", "PK", "PV")],
        [oh.make_tensor_value_info(n, 1, None) for n in ("Y", "PRK", "PRV")]),
        opset_imports=[oh.make_opsetid("", 23)])
    return ReferenceEvaluator(m).run(None, {"Q": q, "K": k, "V": v, "PK": pk, "PV": pv})


def _paged_session(h, kvh, d, block_size):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.struct_types.extend([kv_block_type(kvh, block_size, d), kv_cache_type()])
    g = m.graph
    for n in ("Q", "K", "V"):
        vi = g.input.add(name=n)
        vi.type.tensor_type.elem_type = pb.TensorProto.FLOAT
    g.input.add(name="cache").type.struct_type.type_ref = 3001
    g.output.add(name="Y").type.tensor_type.elem_type = pb.TensorProto.FLOAT
    g.output.add(name="present").type.struct_type.type_ref = 3001
    g.node.append(make_node("PagedAttention", ["Q", "K", "V", "cache"], ["Y", "present"],
                            name="attn", domain="olv", q_num_heads=h, kv_num_heads=kvh,
                            is_causal=1, block_size=block_size))
    g.persistent_bindings.add(input_name="cache", output_name="present")
    return olv_runtime.InferenceSession(m)


@pytest.mark.parametrize("h, kvh", [(4, 2), (14, 2)])
@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("past", [0, 1, 17])
def test_paged_attention_matches_onnx_reference(h, kvh, s, past):
    d = 16
    rng = np.random.default_rng(past * 10 + s)
    pk, pv = rand(rng, 1, kvh, past, d), rand(rng, 1, kvh, past, d)
    q, k, v = rand(rng, 1, s, h * d), rand(rng, 1, s, kvh * d), rand(rng, 1, s, kvh * d)
    y_ref, prk, _ = _reference(q, k, v, pk, pv, h, kvh)
    sess = _paged_session(h, kvh, d, block_size=4)
    # build the past cache through the op itself (one prefill call of the past tokens, whose
    # queries are irrelevant), then run the step against the reference
    cache = empty_paged_cache()
    if past:
        pk3 = pk[0].transpose(1, 0, 2).reshape(1, past, kvh * d).copy()
        pv3 = pv[0].transpose(1, 0, 2).reshape(1, past, kvh * d).copy()
        _, cache = sess.run(None, {"Q": np.zeros((1, past, h * d), np.float32), "K": pk3,
                                   "V": pv3, "cache": cache})
    y, present = sess.run(None, {"Q": q, "K": k, "V": v, "cache": cache})
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    keys, _ = cache_arrays(present)
    np.testing.assert_array_equal(keys, prk[0])
    assert block_counts(present) == (-(-(past + s) // 4), (past + s - 1) % 4 + 1)


@pytest.mark.parametrize("h, kvh", [(4, 2), (14, 2)])
@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("past", [0, 1, 17])
def test_contiguous_attention_matches_onnx_reference(h, kvh, s, past):
    from onnx import helper as oh

    d = 16
    rng = np.random.default_rng(past * 10 + s + 1)
    pk, pv = rand(rng, 1, kvh, past, d), rand(rng, 1, kvh, past, d)
    q, k, v = rand(rng, 1, s, h * d), rand(rng, 1, s, kvh * d), rand(rng, 1, s, kvh * d)
    y_ref, prk, prv = _reference(q, k, v, pk, pv, h, kvh)
    node = oh.make_node("Attention", ["Q", "K", "V", "", "PK", "PV"], ["Y", "PRK", "PRV"],
                        is_causal=1, q_num_heads=h, kv_num_heads=kvh)
    m = oh.make_model(oh.make_graph(
        [node], "g", [oh.make_tensor_value_info(n, 1, None) for n in ("Q", "K", "V", "PK", "PV")],
        [oh.make_tensor_value_info(n, 1, None) for n in ("Y", "PRK", "PRV")]),
        opset_imports=[oh.make_opsetid("", 23)])
    sess = olv_runtime.InferenceSession(m)
    y, k_out, v_out = sess.run(None, {"Q": q, "K": k, "V": v, "PK": pk, "PV": pv})
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(k_out, prk)
    np.testing.assert_array_equal(v_out, prv)


def test_gqa_head_counts_rejected_at_session_creation():
    m = _paged_session(4, 2, 16, 4).model.proto
    for a in m.graph.node[0].attribute:
        if a.name == "q_num_heads":
            a.i = 5
    with pytest.raises(ValidationError, match="q_num_heads 5 must be a positive multiple of "
                                              "kv_num_heads 2"):
        olv_runtime.InferenceSession(m)


def test_struct_feed_of_wrong_kind_is_rejected():
    sess = _paged_session(4, 2, 16, 4)
    z = np.zeros((1, 1, 64), np.float32)
    with pytest.raises(InvalidArgument, match="input cache: expected a struct value"):
        sess.run(None, {"Q": z, "K": z[..., :32], "V": z[..., :32], "cache": np.zeros(3)})
    with pytest.raises(InvalidArgument, match="missing field 'length'"):
        sess.run(None, {"Q": z, "K": z[..., :32], "V": z[..., :32],
                        "cache": olv_runtime.RuntimeStruct({"blocks": ()})})


def test_state_retains_paged_cache_whole():
    sess = _paged_session(4, 2, 16, 4)
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    rng = np.random.default_rng(0)
    ptrs = []
    for _ in range(6):
        out = state.run({"Q": rand(rng, 1, 1, 64), "K": rand(rng, 1, 1, 32),
                         "V": rand(rng, 1, 1, 32)})
        cache = state.values["cache"]
        assert out["present"] is cache
        ptrs.append(cache["blocks"][0]["key"].__array_interface__["data"][0])
    assert len(set(ptrs)) == 1  # block 0 kept in place across calls
    assert block_counts(state.values["cache"]) == (2, 2)
    assert state.last_counters["bytes_copied_state"] == 0
    # 2 blocks x (K + V) x [KVH=2, BS=4, D=16] float32 + the INT64 length/start scalars
    assert state.last_counters["retained_state_bytes"] == 2 * 2 * (2 * 4 * 16 * 4) + 8 * (1 + 2 * 2)
