"""NaN and infinity in the KV cache propagate like the IEEE softmax (ONNX Attention reference:
a NaN or infinite score makes the query row NaN) on every attention path: the one-token path
(compiled decode step with its flash-decoding merge, per-operator kernels) gives what the
multi-token path and a float64 numpy reference give. Quantized (INT8/INT4) blocks cannot hold
a NaN: the token's (or block's) scale becomes NaN, so the rows attending it are NaN."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import kernels
from olv_runtime.kv.paged import Geometry, PagedKV, SealPolicy, empty_paged_cache

D = 64
KVH = 2
H = 4


def reference(q, keys, values, past, scale):
    """float64 attention, IEEE semantics (NaN/inf not special-cased); q [S, H, D],
    keys/values [KVH, T, D]."""
    s_n, h_n, d = q.shape
    grp = h_n // keys.shape[0]
    out = np.zeros((s_n, h_n, d))
    with np.errstate(invalid="ignore", over="ignore"):
        for s in range(s_n):
            n = past + s + 1
            for h in range(h_n):
                k = keys[h // grp, :n].astype(np.float64)
                v = values[h // grp, :n].astype(np.float64)
                sc = k @ q[s, h].astype(np.float64) * scale
                p = np.exp(sc - sc.max())
                out[s, h] = (p / p.sum()) @ v
    return out


def _data(seed, ctx, where, val):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((ctx, KVH, D)).astype(np.float32)
    v = rng.standard_normal((ctx, KVH, D)).astype(np.float32)
    q = rng.standard_normal((ctx + 2, H, D)).astype(np.float32)
    (k if where == "key" else v)[ctx // 2, 1, 3] = val
    return q, k, v


@pytest.mark.parametrize("val", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("ctx", [5, 300])  # 300: across the softmax tiles
def test_contiguous_kernel_one_and_two_queries(val, where, ctx):
    q, k, v = _data(0, ctx, where, val)
    rng = np.random.default_rng(1)
    kn = rng.standard_normal((2, KVH, D)).astype(np.float32)
    vn = rng.standard_normal((2, KVH, D)).astype(np.float32)
    keys = np.concatenate([k, kn]).transpose(1, 0, 2)
    vals = np.concatenate([v, vn]).transpose(1, 0, 2)
    scale = 1 / np.sqrt(D)
    for s in (1, 2):
        qs = q[:s].copy()
        ref = reference(qs, keys, vals, ctx, scale)
        got = kernels.attention(qs[None], np.ascontiguousarray(keys[None]),
                                np.ascontiguousarray(vals[None]), ctx, scale, True)[0]
        assert (np.isnan(got) == np.isnan(ref)).all(), (s, np.isnan(got).sum(), np.isnan(ref).sum())
        if np.isnan(val):
            assert np.isnan(ref[:, 2:]).any(axis=-1).all()  # the poisoned kv head's heads 2, 3
        ok = np.isfinite(ref)
        assert (np.isfinite(got) == ok).all() and (got[~ok] == ref[~ok]).sum() == (~ok & ~np.isnan(ref)).sum()
        assert np.abs(got[ok] - ref[ok]).max() <= 1e-5


@pytest.mark.parametrize("policy", ["float32", "float16", "int8", "int4", "float32:1,int8:2,int4",
                                    SealPolicy("int8", scales="block")])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("ctx", [40, 600])
def test_paged_kernel_nan(policy, where, ctx):
    q, k, v = _data(2, ctx, where, np.nan)
    mgr = PagedKV(Geometry(KVH, 16, D), SealPolicy(policy) if isinstance(policy, str) else policy,
                  chunk_blocks=8)
    _, cache = mgr.run(empty_paged_cache(), q[:ctx].copy(), k, v, 1 / np.sqrt(D), True)
    rng = np.random.default_rng(3)
    for s in (1, 2):
        kn = rng.standard_normal((s, KVH, D)).astype(np.float32)
        vn = rng.standard_normal((s, KVH, D)).astype(np.float32)
        out, _ = mgr.run(cache, q[ctx:ctx + s].copy(), kn, vn, 1 / np.sqrt(D), True)
        # the poisoned kv head's query heads are NaN, the other heads finite
        assert np.isnan(out[:, 2:]).any(axis=-1).all(), (policy, where, s)
        assert np.isfinite(out[:, :2]).all()
        if where == "key":
            assert np.isnan(out[:, 2:]).all()


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("nonfinite") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return path


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("name", ["past_key.0", "past_value.1", "past_key.1"])
@pytest.mark.parametrize("val", [np.nan, np.inf, -np.inf])
def test_session_one_token_like_two_tokens(model, compiled, name, val):
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(compiled_decode=compiled))
    rng = np.random.default_rng(0)
    past = {k: rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
            for k in olv_runtime.empty_cache(sess)}
    past[name][0, 1, 2, 0] = val
    one = sess.run(["logits"], {"input_ids": np.array([[5]]), **past})[0]
    two = sess.run(["logits"], {"input_ids": np.array([[5, 6]]), **past})[0]
    assert (np.isnan(one[0, 0]) == np.isnan(two[0, 0])).all()
    if np.isnan(val) or "value" in name:
        assert np.isnan(one).all()


@pytest.mark.parametrize("val", [np.nan, np.inf])
def test_state_with_nonfinite_initial_kv(model, val):
    sess = olv_runtime.InferenceSession(model)
    cache = {k: np.full((1, 2, 3, 16), val, np.float32) for k in olv_runtime.empty_cache(sess)}
    state = olv_runtime.make_state(sess, cache)
    out = state.run({"input_ids": np.array([[5]], np.int64)})["logits"]
    assert np.isnan(out).all()


@pytest.fixture(scope="module")
def paged_models(tmp_path_factory, tiny_qwen2_dir):
    from olv_runtime.cli import main as cli_main
    d = tmp_path_factory.mktemp("nonfinite_paged")
    out = {}
    for kv in ("paged", "paged-int8"):
        out[kv] = d / f"{kv}.onnx"
        assert cli_main(["convert", str(tiny_qwen2_dir), str(out[kv]), "--kv", kv]) == 0
    return out


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("kv, policy", [("paged", "float32"), ("paged-int8", "int8")])
@pytest.mark.parametrize("pos", [5, 35])  # a sealed block, the open (float32) block
def test_paged_session_one_token_like_two_tokens(paged_models, compiled, kv, policy, pos):
    sess = olv_runtime.InferenceSession(paged_models[kv],
                                        olv_runtime.SessionOptions(compiled_decode=compiled))
    rng = np.random.default_rng(0)
    caches = {}
    for li in range(2):  # tiny Qwen2: 2 kv heads of 16, blocks of 16 tokens
        mgr = PagedKV(Geometry(2, 16, 16), SealPolicy(policy), chunk_blocks=4)
        k = rng.standard_normal((40, 2, 16)).astype(np.float32)
        v = rng.standard_normal((40, 2, 16)).astype(np.float32)
        if li == 0:
            k[pos, 1, 0] = np.nan
        q = rng.standard_normal((40, 4, 16)).astype(np.float32)
        _, caches[f"cache.{li}"] = mgr.run(empty_paged_cache(), q, k, v, 0.25, True)
    one = sess.run(["logits"], {"input_ids": np.array([[5]]), **caches})[0]
    two = sess.run(["logits"], {"input_ids": np.array([[5, 6]]), **caches})[0]
    assert np.isnan(two).all()
    assert np.isnan(one).all()
