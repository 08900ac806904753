"""Persistent state on a converted tiny Qwen2 model (seed 000 PR04b/PR07 acceptance):
100 decode calls with zero state-management copies and zero model serializations, pointer
identity of the KV buffers, 4 interleaved states equal to each run alone, reset, torch initial
values, and failed/cancelled calls that publish nothing."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.counters import PROCESS
from olv_runtime.errors import InvalidArgument, StateError


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("state_qwen") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return path


@pytest.fixture(scope="module")
def session(model_path):
    return olv_runtime.InferenceSession(olv_runtime.load(model_path),
                                        olv_runtime.SessionOptions(kv_initial_capacity=128))


def ptr(a) -> int:
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data_ptr()


def _ids(*tok):
    return np.array([list(tok)], np.int64)


def greedy(state, prompt, steps):
    """Prefill then ``steps`` greedy decode calls; every call's logits."""
    out = state.run({"input_ids": _ids(*prompt)})
    logits = [out["logits"]]
    for _ in range(steps):
        nxt = int(np.argmax(logits[-1][0, -1]))
        logits.append(state.run({"input_ids": _ids(nxt)})["logits"])
    return logits


def test_100_decode_calls_zero_state_copies_and_serializations(session, monkeypatch):
    meta = session.model.metadata()
    layers, kvh, d = (int(meta[k]) for k in ("olv.num_layers", "olv.num_kv_heads", "olv.head_dim"))
    per_token = 2 * layers * kvh * d * 4

    def forbidden(*a, **k):
        raise AssertionError("the model was serialized/cloned/compared on the state path")

    for cls in (pb.ModelProto, pb.GraphProto):
        for meth in ("SerializeToString", "CopyFrom", "MergeFrom", "__deepcopy__", "__eq__"):
            monkeypatch.setattr(cls, meth, forbidden)
    before = PROCESS["model_serializations"]
    initial = olv_runtime.empty_cache(session)
    state = olv_runtime.make_state(session, initial)
    assert state.construction_counters["model_serializations"] == 0
    assert state.construction_counters["bytes_copied_state"] == 0
    out = state.run({"input_ids": _ids(1, 2, 3, 4)})
    ptrs = {k: ptr(v) for k, v in state.values.items()}
    for inp, o in state.bindings:
        assert out[o] is state.values[inp]
    tok = int(np.argmax(out["logits"][0, -1]))
    for step in range(100):
        prev = dict(state.values)
        out = state.run({"input_ids": _ids(tok)})
        c = state.last_counters
        assert c["bytes_copied_state"] == 0 and c["model_serializations"] == 0
        assert c["bytes_copied_kv_append"] == per_token
        assert c["kv_reallocations"] == 0  # capacity 128 >= 104 tokens: in place
        assert c["retained_state_bytes"] == per_token * (4 + step + 1)
        for inp, o in state.bindings:
            assert out[o] is state.values[inp]  # the returned output is the retained value
            assert ptr(state.values[inp]) == ptrs[inp] == ptr(prev[inp])  # same KV buffers
        tok = int(np.argmax(out["logits"][0, -1]))
    monkeypatch.undo()
    assert state.counters["bytes_copied_state"] == 0
    assert state.counters["model_serializations"] == 0
    assert PROCESS["model_serializations"] == before
    assert state.counters["runs"] == 101
    assert state.counters["bytes_copied_kv_prefix"] == 0
    # reset restores the initial values (the same arrays)
    state.reset(initial)
    for k, v in initial.items():
        assert state.values[k].base is v or ptr(state.values[k]) == ptr(v)
        assert state.values[k].shape == v.shape
    assert state.last_counters["retained_state_bytes"] == 0


def test_four_interleaved_states_equal_each_alone(session):
    prompts = [[5, 17, 99], [3, 42], [64, 7, 8, 9], [11]]
    steps = 8
    alone = []
    for p in prompts:
        st = olv_runtime.make_state(session, olv_runtime.empty_cache(session))
        alone.append((greedy(st, p, steps), {k: np.array(v) for k, v in st.values.items()}))
        st.close()
    states = [olv_runtime.make_state(session, olv_runtime.empty_cache(session)) for _ in prompts]
    logits = [[s.run({"input_ids": _ids(*p)})["logits"]] for s, p in zip(states, prompts)]
    for _ in range(steps):
        for i, s in enumerate(states):
            others = {j: (dict(o.values), {k: np.array(v) for k, v in o.values.items()})
                      for j, o in enumerate(states) if j != i}
            nxt = int(np.argmax(logits[i][-1][0, -1]))
            logits[i].append(s.run({"input_ids": _ids(nxt)})["logits"])
            for j, (vals, snap) in others.items():  # i's call changed nothing of j's
                for k in vals:
                    assert states[j].values[k] is vals[k]
                    np.testing.assert_array_equal(states[j].values[k], snap[k])
    for i, s in enumerate(states):
        ref_logits, ref_values = alone[i]
        for a, b in zip(logits[i], ref_logits):
            np.testing.assert_array_equal(a, b)
        for k, v in s.values.items():
            np.testing.assert_array_equal(v, ref_values[k])
        assert s.counters["bytes_copied_state"] == 0
    # reset restores the initial values: the same calls give the same logits again
    s = states[0]
    s.reset(olv_runtime.empty_cache(session))
    again = greedy(s, prompts[0], steps)
    for a, b in zip(again, alone[0][0]):
        np.testing.assert_array_equal(a, b)


def test_torch_initial_cache_shares_memory(session):
    import torch
    ref = olv_runtime.make_state(session, olv_runtime.empty_cache(session))
    ref.run({"input_ids": _ids(1, 2, 3)})
    prefix = {k: torch.from_numpy(np.array(v)) for k, v in ref.values.items()}  # caller-owned
    st = olv_runtime.make_state(session, prefix)
    for k, t in prefix.items():
        assert ptr(st.values[k]) == t.data_ptr()
    a = st.run({"input_ids": torch.tensor([[4]])})["logits"]
    b = ref.run({"input_ids": _ids(4)})["logits"]
    np.testing.assert_array_equal(a, b)
    for k, t in prefix.items():  # the caller's tensors were read, never written
        np.testing.assert_array_equal(t.numpy(), np.asarray(ref.values[k])[:, :, :3])
    st.reset(prefix)
    for k, t in prefix.items():
        assert ptr(st.values[k]) == t.data_ptr()
    assert st.counters["bytes_copied_state"] == 0


@pytest.mark.parametrize("fault", [RuntimeError("injected"), KeyboardInterrupt()])
def test_fault_after_kv_append_publishes_nothing(model_path, fault):
    """A fault injected in the last step (after every Attention appended its token in place)
    leaves the previous values, their buffers and their contents as they were; the state then
    continues exactly like one that never failed."""
    sess = olv_runtime.InferenceSession(olv_runtime.load(model_path))
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    ref = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    state.run({"input_ids": _ids(1, 2, 3)})
    ref.run({"input_ids": _ids(1, 2, 3)})
    before = dict(state.values)
    snap = {k: np.array(v) for k, v in before.items()}
    last = sess._steps[-1]
    orig = last.fn

    def boom(*args):
        raise fault

    last.fn = boom
    try:
        with pytest.raises(InvalidArgument if isinstance(fault, Exception) else KeyboardInterrupt):
            state.run({"input_ids": _ids(9)})
    finally:
        last.fn = orig
    for k, v in before.items():
        assert state.values[k] is v
        np.testing.assert_array_equal(v, snap[k])
    a = state.run({"input_ids": _ids(4)})["logits"]
    b = ref.run({"input_ids": _ids(4)})["logits"]
    np.testing.assert_array_equal(a, b)
    for k in before:
        np.testing.assert_array_equal(state.values[k], ref.values[k])
        np.testing.assert_array_equal(before[k], snap[k])  # the old views are still intact
    assert state.counters["bytes_copied_state"] == 0
    with pytest.raises(StateError, match="override"):
        state.run({"input_ids": _ids(4), "past_key.0": before["past_key.0"]})
