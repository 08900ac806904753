"""The compiled decode step over paged KV caches (olv_runtime.executor.paged_decoder_step +
kernels.decode_stack.decode_stack_paged) and the vectorised attention kernels.

Oracles: the same paged model with ``compiled_decode=False`` (the per-operator plan: PagedAttention
per layer, itself checked against ONNX Attention-23 and a float64 reference in test_kv_paged), the
contiguous model (test_kv_paged_qwen's bars), a float64 attention (tests/naive.py) for the
contiguous kernel at contexts spanning several key tiles, and numpy's float64 ``exp`` for the
vectorised exponential. Tolerances: compiled vs per-operator paged logits 1e-4 (float32 rounding:
the same kernels, another summation order across the threads' key ranges); the exponential within
2 ulp; attention rtol 1e-5.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

import olv_runtime
import naive
from olv_runtime.kernels import attention, get_num_threads, set_num_threads, threading_layer
from olv_runtime.kv.paged import block_counts, block_format

PROMPT = [5, 17, 99, 3, 42, 64, 7]
FORCED = [11, 40, 2, 77, 9, 31, 120, 6, 15, 88, 23, 54, 3, 70, 19, 101, 44, 8, 60, 27, 95, 13,
          36, 81, 4, 57, 110, 29, 66, 12, 90, 47]  # 7 + 32 tokens: sealing at 16 and 32

_att = sys.modules["olv_runtime.kernels.attention"]


# -- kernels ---------------------------------------------------------------------------------------
def test_vectorised_exp_within_2_ulp():
    from numba import njit

    @njit
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = _att._exp_neg(x[i])

    x = np.concatenate([np.linspace(-87, 0, 200001, dtype=np.float32),
                        -np.logspace(-8, 0, 1001).astype(np.float32), [np.float32(0)]])
    got = np.empty_like(x)
    run(x, got)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert float(np.max(np.abs(got - ref) / ulp)) <= 2.0
    run(np.array([-np.inf, -1000.0], np.float32), got[:2])  # clamped: tiny, never NaN
    assert 0 < got[0] < 1e-37 and 0 < got[1] < 1e-37


@pytest.mark.parametrize("past,s", [(0, 1), (63, 1), (64, 1), (200, 1), (150, 70)])
@pytest.mark.parametrize("h,kvh", [(14, 2), (4, 4)])
def test_attention_across_key_tiles(past, s, h, kvh):
    """Contexts below, at and across the 64-key tile, prefill rows with causal limits inside a
    tile, GQA groups of 7 and 1."""
    rng = np.random.default_rng(past + 7 * s + h)
    d = 64
    q = rng.standard_normal((1, s, h, d), dtype=np.float32)
    k = rng.standard_normal((1, kvh, past + s + 5, d), dtype=np.float32) * 2
    v = rng.standard_normal((1, kvh, past + s + 5, d), dtype=np.float32)
    for causal in (True, False):
        got = attention(q, k, v, past, 0.125, causal)
        np.testing.assert_allclose(got, naive.attention(q, k, v, past, 0.125, causal),
                                   rtol=1e-5, atol=1e-6)


# -- the compiled paged step -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def paged_models(tmp_path_factory, tiny_qwen2_dir):
    d = tmp_path_factory.mktemp("paged_stack")
    out = {}
    for kv in ("contiguous", "paged", "paged-int8", "paged-mixed"):
        path = d / f"{kv}.onnx"
        olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32", kv=kv)
        out[kv] = olv_runtime.load(path)
    # float16 open blocks (the compiled step writes the new key/value as float16)
    from olv_runtime import proto as pb
    from olv_runtime.models.paged_kv import to_paged

    m = pb.ModelProto()
    m.ParseFromString((d / "contiguous.onnx").read_bytes())  # external data stays beside it
    to_paged(m, "paged-int8", open_format="float16")
    path = d / "paged-int8-f16.onnx"
    path.write_bytes(m.SerializeToString())
    out["paged-int8-f16"] = olv_runtime.load(path)
    return out


def _session(model, compiled, threads=None):
    return olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(
        compiled_decode=compiled, num_threads=threads))


def _stack(sess):
    stacks = [s.impl for s in sess._steps if s.kind == "DecoderStack"]
    return stacks[0] if stacks else None


def _teacher_forced(sess, tokens=FORCED):
    """Logits after the prompt and each forced token, the last state, per-call counter deltas."""
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    rows = [st.run({"input_ids": np.array([PROMPT], np.int64)})["logits"][0, -1].copy()]
    deltas = []
    for t in tokens:
        before = sess.counters.snapshot()
        rows.append(st.run({"input_ids": np.array([[t]], np.int64)})["logits"][0, -1].copy())
        after = sess.counters.snapshot()
        deltas.append({k: after[k] - before.get(k, 0) for k in after})
    return np.stack(rows), st, deltas


def test_paged_plan_runs_one_compiled_step(paged_models):
    sess = _session(paged_models["paged-int8"], True)
    kinds = [k for k, _ in sess.plan()]
    assert kinds.count("DecoderStack") == 1
    assert "PagedAttention" not in kinds and "Linear" not in kinds
    assert "RotaryEmbedding" not in kinds
    assert len(kinds) < len(_session(paged_models["paged-int8"], False).plan()) - 20
    assert type(_stack(sess)).__name__ == "PagedDecoderStack"
    assert _stack(_session(paged_models["contiguous"], True)).__class__.__name__ == "DecoderStack"


@pytest.mark.parametrize("kv", ["paged", "paged-int8", "paged-mixed", "paged-int8-f16"])
def test_compiled_paged_matches_per_operator_and_contiguous(paged_models, kv, monkeypatch):
    # the tiny models' linears are below the serial threshold: force the parallel driver (the
    # one-thread test below covers the serial one)
    from olv_runtime.executor import decoder_step as decoder_stack

    monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)
    sess = _session(paged_models[kv], True)
    stack = _stack(sess)
    calls = []
    real = stack.run_kernel

    def counting(*a):
        calls.append(1)
        return real(*a)
    stack.run_kernel = counting
    got, st, d_got = _teacher_forced(sess)
    assert len(calls) == len(FORCED)  # every one-token call ran the compiled step
    assert stack.tasks == (get_num_threads() if threading_layer() == "omp" else 1)
    ref, st_ref, d_ref = _teacher_forced(_session(paged_models[kv], False))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    cont, _, _ = _teacher_forced(_session(paged_models["contiguous"], True))
    assert float(np.abs(got - cont).max()) <= (1e-4 if kv == "paged" else 0.05)
    # the same cache values and the same counters as the per-operator plan
    for name in ("cache.0", "cache.1"):
        a, b = st.values[name], st_ref.values[name]
        assert block_counts(a) == block_counts(b) == (3, (len(PROMPT) + len(FORCED) - 1) % 16 + 1)
        assert ([block_format(x["key"]) for x in a["blocks"]]
                == [block_format(x["key"]) for x in b["blocks"]])
        assert ([block_format(x["value"]) for x in a["blocks"]]
                == [block_format(x["value"]) for x in b["blocks"]])
    for key in ("bytes_read_kv_attention", "bytes_copied_kv_append", "kv_blocks_allocated",
                "kv_blocks_converted", "bytes_kv_converted", "kv_committed_bytes",
                "bytes_copied_state", "bytes_dequantized"):
        assert [x.get(key, 0) for x in d_got] == [x.get(key, 0) for x in d_ref], key
    assert st.last_counters["retained_state_bytes"] == st_ref.last_counters["retained_state_bytes"]
    assert (st.last_counters["retained_state_buffer_bytes"]
            == st_ref.last_counters["retained_state_buffer_bytes"])
    assert all(x.get("bytes_copied_state", 0) == 0 for x in d_got)
    if kv == "paged-int8":
        fmts = [block_format(b["key"]) for b in st.values["cache.0"]["blocks"]]
        assert fmts == ["int8", "int8", "float32"]


def test_compiled_paged_one_thread_and_branching(paged_models):
    """The serial driver (1 thread), and two states continuing one cache value: the second
    copies the open block, the table of the first is never seen by the second."""
    model = paged_models["paged-mixed"]
    nt = get_num_threads()
    try:
        set_num_threads(1)
        got1, _, _ = _teacher_forced(_session(model, True, threads=1), FORCED[:10])
    finally:
        set_num_threads(nt)
    ref1, _, _ = _teacher_forced(_session(model, False), FORCED[:10])
    np.testing.assert_allclose(got1, ref1, atol=1e-4, rtol=0)

    sess, ref = _session(model, True), _session(model, False)
    outs = {}
    for name, s in (("got", sess), ("ref", ref)):
        base = olv_runtime.make_state(s, olv_runtime.empty_cache(s))
        base.run({"input_ids": np.array([PROMPT + FORCED[:8]], np.int64)})  # 15 tokens
        past = dict(base.values)
        a = olv_runtime.make_state(s, past)
        b = olv_runtime.make_state(s, past)
        rows = []
        for ta, tb in zip(FORCED[8:20], FORCED[20:32]):  # a and b interleaved
            rows.append(a.run({"input_ids": np.array([[ta]], np.int64)})["logits"][0, -1].copy())
            rows.append(b.run({"input_ids": np.array([[tb]], np.int64)})["logits"][0, -1].copy())
        rows.append(base.run({"input_ids": np.array([[5]], np.int64)})["logits"][0, -1].copy())
        outs[name] = np.stack(rows)
    np.testing.assert_allclose(outs["got"], outs["ref"], atol=1e-4, rtol=0)
