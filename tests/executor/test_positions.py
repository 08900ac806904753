"""The fused rotary position step (olv_runtime.executor.positions).

Oracle: the 18 operators of the converter's position subgraph it replaces, run one by one (the
step's generic path is exactly those steps); the fused values must be bitwise equal for every
past length, sequence length and batch tried. The whole model's greedy tokens are unchanged
against the unfused plan (``enable_fusion=False``, itself checked against transformers).
"""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime.executor.positions import RotaryPositions


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("positions") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return olv_runtime.load(path)


def _step(sess):
    (step,) = [s for s in sess.all_steps() if s.kind == "RotaryPositions"]
    return step


def test_plan_has_one_position_step(model):
    sess = olv_runtime.InferenceSession(model)
    kinds = [k for k, _ in sess.plan()]
    assert kinds.count("RotaryPositions") == 1
    for k in ("Range", "Cos", "Sin", "Expand", "Shape"):
        assert k not in kinds
    step = _step(sess)
    assert len(step.impl.sub_steps) == 18
    assert step.inputs == ("past_key.0", "input_ids")
    assert step.outputs == ("rotary/cos", "rotary/sin")


@pytest.mark.parametrize("batch", [1, 2, 0])
def test_bitwise_equal_to_the_operator_chain(model, batch):
    sess = olv_runtime.InferenceSession(model)
    rp = _step(sess).impl
    assert isinstance(rp, RotaryPositions)
    d = int(model.metadata()["olv.head_dim"])
    kvh = int(model.metadata()["olv.num_kv_heads"])
    for t in (0, 1, 7, 63, 64, 65, 1000, 4095, 40000):
        for s in (1, 3, 70):
            past = np.zeros((1, kvh, t, d), np.float32)
            ids = np.zeros((batch, s), np.int64)
            got = rp(past, ids)
            want = rp._run_generic(past, ids)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype == np.float32
                assert g.shape == w.shape == (batch, s, d // 2)
                assert g.flags.c_contiguous
                np.testing.assert_array_equal(g, w)
                assert g.tobytes() == w.tobytes()  # bitwise (signed zeros, NaN payloads)


def test_other_ranks_run_the_operators(model):
    """A past of another rank goes through the original operators (their results, their
    errors)."""
    sess = olv_runtime.InferenceSession(model)
    rp = _step(sess).impl
    got = rp(np.zeros((1, 2, 5), np.float32), np.zeros((1, 2), np.int64))
    want = rp._run_generic(np.zeros((1, 2, 5), np.float32), np.zeros((1, 2), np.int64))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(olv_runtime.errors.OlvError, match="squeeze"):
        rp(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.int64))


def test_greedy_tokens_unchanged(model):
    prompt = [5, 17, 99, 3, 42]
    fused = olv_runtime.generate(olv_runtime.InferenceSession(model), prompt, 6)
    plain = olv_runtime.generate(
        olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(enable_fusion=False)),
        prompt, 6)
    assert fused.tolist() == plain.tolist()


# -- the paged form (olv convert --kv paged*: the past length is the cache struct's field) -------
@pytest.fixture(scope="module")
def paged_model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("positions_paged") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32", kv="paged-int8")
    return olv_runtime.load(path)


def test_paged_plan_has_one_position_step(paged_model):
    sess = olv_runtime.InferenceSession(paged_model)
    kinds = [k for k, _ in sess.plan()]
    assert kinds.count("RotaryPositions") == 1
    for k in ("Range", "Cos", "Sin", "Expand", "Shape", "StructGet"):
        assert k not in kinds
    step = _step(sess)
    assert len(step.impl.sub_steps) == 19 and step.impl.paged
    assert step.inputs == ("cache.0", "input_ids")


def _paged_cache(length):
    from olv_runtime.structs.runtime import RuntimeStruct

    return RuntimeStruct({"blocks": (), "length": np.array(length, np.int64)})


@pytest.mark.parametrize("batch", [1, 2])
def test_paged_bitwise_equal_to_the_operator_chain(paged_model, batch):
    rp = _step(olv_runtime.InferenceSession(paged_model)).impl
    d = int(paged_model.metadata()["olv.head_dim"])
    for t in (0, 1, 15, 16, 1000, 40000):
        for s in (1, 3, 70):
            cache, ids = _paged_cache(t), np.zeros((batch, s), np.int64)
            got = rp(cache, ids)
            want = rp._run_generic(cache, ids)
            for g, w in zip(got, want):
                assert g.shape == w.shape == (batch, s, d // 2) and g.dtype == np.float32
                assert g.tobytes() == w.tobytes()


def test_paged_other_values_run_the_operators(paged_model):
    """A past that is not a struct with an INT64 scalar length goes through the original
    operators (their errors)."""
    from olv_runtime.structs.runtime import RuntimeStruct

    rp = _step(olv_runtime.InferenceSession(paged_model)).impl
    ids = np.zeros((1, 2), np.int64)
    with pytest.raises(olv_runtime.errors.OlvError, match="struct"):
        rp(np.zeros((1, 2, 5, 4), np.float32), ids)
    odd = RuntimeStruct({"length": np.array([5], np.int64)})  # not a scalar: the operators' way
    got = rp(odd, ids)
    want = rp._run_generic(odd, ids)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_paged_greedy_tokens_unchanged(paged_model):
    prompt = [5, 17, 99, 3, 42]
    fused = olv_runtime.generate(olv_runtime.InferenceSession(paged_model), prompt, 20)
    plain = olv_runtime.generate(olv_runtime.InferenceSession(
        paged_model, olv_runtime.SessionOptions(enable_fusion=False)), prompt, 20)
    assert fused.tolist() == plain.tolist()
