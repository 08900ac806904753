"""Activation buffer pool: zero allocations per decode token, outputs never overwritten."""
from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

import olv_runtime
from olv_runtime.kernels.dispatch import LinearMode
from olv_runtime.pool import BufferPool


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("pool") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return olv_runtime.load(path)


def _decode_deltas(sess, state, steps, recycle):
    out = state.run({"input_ids": np.array([[1, 2, 3, 4]], np.int64)})
    tok = np.array([[5]], np.int64)
    deltas = []
    for _ in range(steps):
        if recycle:
            sess.recycle(out["logits"])
        before = sess.counters.snapshot()
        out = state.run({"input_ids": tok})
        after = sess.counters.snapshot()
        deltas.append((after["arrays_allocated"] - before["arrays_allocated"],
                       after["bytes_allocated"] - before["bytes_allocated"]))
    return deltas, out


@pytest.mark.parametrize("quantize", [False, True])
def test_zero_allocations_per_decode_token_after_warmup(model, quantize):
    sess = olv_runtime.InferenceSession(
        model, olv_runtime.SessionOptions(quantize_activations=quantize))
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    deltas, _ = _decode_deltas(sess, state, 12, recycle=True)
    assert deltas[0][0] > 0  # the first decode call allocates its one-token buffers
    assert deltas[2:] == [(0, 0)] * 10
    # cross-check with tracemalloc: no numpy data retained across steady decode calls
    tracemalloc.start()
    snap1 = tracemalloc.take_snapshot()
    _decode_deltas(sess, state, 0, recycle=True)
    tok = np.array([[6]], np.int64)
    out = state.run({"input_ids": tok})
    for _ in range(5):
        sess.recycle(out["logits"])
        out = state.run({"input_ids": tok})
    snap2 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    flt = [tracemalloc.DomainFilter(True, 389047)]  # numpy's data allocation domain
    grown = sum(s.size_diff for s in snap2.filter_traces(flt).compare_to(
        snap1.filter_traces(flt), "filename") if s.size_diff > 0)
    vocab = out["logits"].shape[-1]
    assert grown <= out["logits"].nbytes + 64 * vocab  # only the live logits / KV growth


def test_without_recycling_only_the_logits_are_new(model):
    sess = olv_runtime.InferenceSession(model)
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    deltas, out = _decode_deltas(sess, state, 6, recycle=False)
    assert deltas[2:] == [(1, out["logits"].nbytes)] * 4


def test_returned_outputs_are_never_overwritten(model):
    sess = olv_runtime.InferenceSession(model)
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    first = state.run({"input_ids": np.array([[1, 2, 3]], np.int64)})["logits"]
    keep = first.copy()
    for t in range(5):
        state.run({"input_ids": np.array([[7 + t]], np.int64)})
    np.testing.assert_array_equal(first, keep)
    assert not sess.recycle(np.zeros(3, np.float32))  # foreign arrays are not taken


def test_threads_have_their_own_pool_and_workspace(model):
    sess = olv_runtime.InferenceSession(model)
    prompts = [[1, 2, 3], [9, 8, 7, 6], [4], [5, 5]]
    alone = [olv_runtime.generate(sess, p, 10).tolist() for p in prompts]
    results = [None] * len(prompts)

    def work(i):
        results[i] = olv_runtime.generate(sess, prompts[i], 10).tolist()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def test_pool_reference_counting():
    pool = BufferPool()
    a = pool.take((4,), np.float32)
    view = a.reshape(2, 2)
    pool.ref(a)
    pool.ref(view)
    pool.unref(a)
    assert pool.owns(a)  # the view still holds it
    pool.unref(view)
    assert not pool.owns(a)
    b = pool.take((4,), np.float32)
    assert b is a  # reused
    pool.ref(b)
    pool.escape([b])
    assert not pool.owns(b)
    c = pool.take((4,), np.float32)
    assert c is not b  # an escaped buffer is never handed out again...
    assert pool.recycle(b)  # ...until the caller gives it back
    pool.end_run()
    d = pool.take((4,), np.float32)
    assert d is b or d is c


def test_quantized_activation_mode_against_exact_path(model):
    """quantize_activations=True (int8 activations, explicit option) stays close to the exact path.

    Tolerance: max |logit difference| <= 2 % of max |logit| over prefill + 8 decode steps
    (activation quantization error, ~1/254 per element before averaging over K)."""
    exact = olv_runtime.InferenceSession(model)
    quant = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(quantize_activations=True))
    assert any(getattr(s.impl, "mode", None) is LinearMode.INT8 for s in quant.all_steps())
    assert any(getattr(s.impl, "mode", None) is LinearMode.EXACT for s in exact.all_steps())
    se = olv_runtime.make_state(exact, olv_runtime.empty_cache(exact))
    sq = olv_runtime.make_state(quant, olv_runtime.empty_cache(quant))
    feed = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int64)
    worst = 0.0
    for _ in range(9):
        le = se.run({"input_ids": feed})["logits"]
        lq = sq.run({"input_ids": feed})["logits"]
        worst = max(worst, float(np.max(np.abs(le - lq)) / np.max(np.abs(le))))
        feed = np.array([[int(np.argmax(le[0, -1]))]], np.int64)
    assert worst <= 0.02, worst
