"""Contiguous KV cache: in-place append into capacity buffers (seed 000 PR05)."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime.kv import contiguous as kv


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("kv") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return path


def _geometry(model):
    meta = model.metadata()
    return int(meta["olv.num_layers"]), int(meta["olv.num_kv_heads"]), int(meta["olv.head_dim"])


def test_append_in_place_after_first_call(model_path):
    model = olv_runtime.load(model_path)
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(kv_initial_capacity=64))
    layers, kvh, d = _geometry(model)
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    state.run({"input_ids": np.array([[1, 2, 3, 4]], np.int64)})
    ptrs = {k: v.__array_interface__["data"][0] for k, v in state.values.items()}
    c0 = sess.counters.snapshot()
    per_token = 2 * layers * kvh * d * 4
    tok = np.array([[5]], np.int64)
    for step in range(20):
        before = sess.counters.snapshot()
        state.run({"input_ids": tok})
        delta = olv_runtime.counters.Counters.delta(sess.counters.snapshot(), before)
        assert delta["bytes_copied_kv_append"] == per_token
        assert delta["bytes_copied_kv_prefix"] == 0
        assert delta["kv_reallocations"] == 0
        for k, v in state.values.items():
            assert v.__array_interface__["data"][0] == ptrs[k]
            assert v.shape[2] == 4 + step + 1
    c1 = sess.counters.snapshot()
    assert c1["bytes_copied_kv_append"] - c0["bytes_copied_kv_append"] == 20 * per_token


def test_growth_copies_prefix_only_at_capacity_boundaries(model_path):
    model = olv_runtime.load(model_path)
    sess = olv_runtime.InferenceSession(
        model, olv_runtime.SessionOptions(kv_initial_capacity=4, kv_growth=2.0))
    layers, kvh, d = _geometry(model)
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    reallocs = []
    length = 0
    for step in range(20):
        before = sess.counters.snapshot()
        n = 3 if step == 0 else 1
        state.run({"input_ids": np.full((1, n), 7, np.int64)})
        length += n
        after = sess.counters.snapshot()
        if after["kv_reallocations"] != before["kv_reallocations"]:
            assert after["kv_reallocations"] - before["kv_reallocations"] == 2 * layers
            copied = after["bytes_copied_kv_prefix"] - before["bytes_copied_kv_prefix"]
            assert copied == 2 * layers * kvh * d * 4 * (length - n)
            reallocs.append(length)
    # capacities 4, 8, 16, 32: a new buffer when the length first exceeds them
    assert reallocs == [3, 5, 9, 17]


def test_returned_views_stay_valid_and_branches_do_not_alias(model_path):
    model = olv_runtime.load(model_path)
    sess = olv_runtime.InferenceSession(model)
    a = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    out = a.run({"input_ids": np.array([[1, 2, 3]], np.int64)})
    snapshot = {k: np.array(v) for k, v in a.values.items()}
    kept = dict(a.values)
    # a second state starts from a's retained cache: same buffers
    b = olv_runtime.make_state(sess, dict(a.values))
    assert all(np.shares_memory(b.values[k], kept[k]) for k in kept)
    ra = a.run({"input_ids": np.array([[4]], np.int64)})["logits"]
    rb = b.run({"input_ids": np.array([[9]], np.int64)})["logits"]
    # b's first append would alias a's slots: it copied into its own buffer
    for k in kept:
        assert not np.shares_memory(a.values[k], b.values[k])
        np.testing.assert_array_equal(kept[k], snapshot[k])  # old views untouched
        np.testing.assert_array_equal(a.values[k][:, :, :3], snapshot[k])
        np.testing.assert_array_equal(b.values[k][:, :, :3], snapshot[k])
    # each equals a fresh run of the same token sequence
    fresh = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    fresh.run({"input_ids": np.array([[1, 2, 3]], np.int64)})
    np.testing.assert_array_equal(fresh.run({"input_ids": np.array([[9]], np.int64)})["logits"], rb)
    fresh.reset(olv_runtime.empty_cache(sess))
    fresh.run({"input_ids": np.array([[1, 2, 3]], np.int64)})
    np.testing.assert_array_equal(fresh.run({"input_ids": np.array([[4]], np.int64)})["logits"], ra)
    assert out["logits"].shape[1] == 3


def test_registry_unit():
    past = np.zeros((1, 2, 0, 4), np.float32)
    new = np.arange(1 * 3 * 8, dtype=np.float32).reshape(1, 3, 8)
    p1, buf = kv.append(past, new, initial_capacity=8)
    assert p1.shape == (1, 2, 3, 4) and buf.shape == (1, 2, 8, 4) and not p1.flags.writeable
    assert kv.committed_length(p1) == 3
    np.testing.assert_array_equal(p1[0, 1, 2], new[0, 2, 4:])
    p2, buf2 = kv.append(p1, new[:, :1], initial_capacity=8)
    assert buf2 is buf and kv.committed_length(p2) == 4
    p3, buf3 = kv.append(p1, new[:, 1:2], initial_capacity=8)  # p1 is stale now: copy
    assert buf3 is not buf
    np.testing.assert_array_equal(p2[:, :, 3], new[:, 0].reshape(1, 2, 4))
    np.testing.assert_array_equal(p3[:, :, 3], new[:, 1].reshape(1, 2, 4))
    np.testing.assert_array_equal(p3[:, :, :3], p1)
