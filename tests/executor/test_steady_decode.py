"""The steady decode path of a state (olv_runtime.state.State._run_steady) and the session's
decode program (olv_runtime.executor.session.DecodeProgram).

Oracle: the same model and token sequence through the generic path (a state that never takes
the steady path: every feed checked, every retained output checked, the executor running every
plan step). The steady calls must give bitwise the same logits and KV values (the same kernels
on the same inputs), the same per-call and cumulative counters, and keep every state rule:
atomic publication, nothing published by a failing call, concurrent calls refused, earlier views
valid, branching, reset/close, errors for bad feeds and outputs.
"""
from __future__ import annotations

import threading
import types

import numpy as np
import pytest

import olv_runtime
from olv_runtime.executor import decoder_step as decoder_stack
from olv_runtime.counters import Counters
from olv_runtime.errors import InvalidArgument, StateError
from olv_runtime.executor.program import DecodeProgram

PROMPT = [5, 17, 99, 3, 42, 64, 7]
TOKENS = [3, 8, 13, 21, 34, 55, 89, 1, 2, 4, 9, 16]
LOGITS = ("logits",)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("steady") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return olv_runtime.load(path)


def _session(model, quant=False, program=True):
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(
        quantize_activations=quant))
    if not program:
        sess.__dict__["_program"] = None  # the executor runs every steady call
    return sess


def _generic(sess):
    """A state that never takes the steady path."""
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    st._steady_ok = False
    return st


def _ids(*t):
    return np.array([list(t)], np.int64)


def _steady(sess):
    """A state of ``sess`` after the prompt and 3 one-token calls (steady from the 2nd)."""
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    st.run({"input_ids": _ids(*PROMPT)}, outputs=LOGITS)
    for tok in TOKENS[:3]:
        st.run({"input_ids": _ids(tok)}, outputs=LOGITS)
    return st


def _program_calls(monkeypatch):
    """Counts the decode program's calls that ran a token (returned a result)."""
    calls = []
    real = DecodeProgram.run

    def counting(self, ids, kv):
        res = real(self, ids, kv)
        calls.append(res is not None)
        return res
    monkeypatch.setattr(DecodeProgram, "run", counting)
    return calls


def test_plan_has_a_decode_program(model):
    prog = _session(model).decode_program()
    assert prog is not None
    assert prog.feed == "input_ids" and prog.logits == "logits"
    assert len(prog.kv_inputs) == len(prog.kv_outputs) == 4  # 2 layers x (key, value)
    # plans of another form have none (per-operator plan: no DecoderStack)
    per_op = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(
        compiled_decode=False))
    assert per_op.decode_program() is None


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("parallel", [False, True])
def test_steady_paths_equal_the_generic_path(model, quant, parallel, monkeypatch):
    """Program path (logits only, then all outputs), executor steady path and generic path:
    bitwise the same logits and KV values, the same last_counters at every call and the same
    session counter totals."""
    if parallel:  # two tasks in the compiled step (the tiny model is serial otherwise)
        monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)
    calls = _program_calls(monkeypatch)
    sessions = {"program": _session(model, quant), "executor": _session(model, quant, False),
                "generic": _session(model, quant)}
    states = {k: (_generic(s) if k == "generic" else
                  olv_runtime.make_state(s, olv_runtime.empty_cache(s)))
              for k, s in sessions.items()}
    before = {k: s.counters.snapshot() for k, s in sessions.items()}
    for k, st in states.items():
        st.run({"input_ids": _ids(*PROMPT)}, outputs=LOGITS)
    for i, tok in enumerate(TOKENS):
        got = {}
        for k, st in states.items():
            outputs = LOGITS if (k != "program" or i < 8) else None
            out = st.run({"input_ids": _ids(tok)}, outputs=outputs)
            got[k] = (out["logits"].copy(), dict(st.last_counters))
            if outputs is None:
                assert set(out) == set(sessions[k]._output_names)
                for inp, o in st.bindings:
                    assert out[o] is st.values[inp]
            else:
                assert list(out) == ["logits"]
            sessions[k].recycle(out["logits"])
        for k in ("program", "executor"):
            np.testing.assert_array_equal(got[k][0], got["generic"][0])
            assert got[k][1] == got["generic"][1], (k, i)
    # the first decode token reserves the KV buffers (a prefill leaves no steady claim), the
    # second claims in place and makes the ticket: every later one runs on the program
    assert calls == [True] * (len(TOKENS) - 2)
    for k in ("program", "executor"):
        for name, v in states["generic"].values.items():
            assert states[k].values[name].shape == v.shape
            np.testing.assert_array_equal(states[k].values[name], v)
        assert states[k].counters.snapshot() == states["generic"].counters.snapshot()
        delta = Counters.delta(sessions[k].counters.snapshot(), before[k])
        want = Counters.delta(sessions["generic"].counters.snapshot(),
                                                   before["generic"])
        assert delta == want


def test_generate_through_the_program(model, monkeypatch):
    calls = _program_calls(monkeypatch)
    sess, ref = _session(model), _session(model, program=False)
    a = olv_runtime.generate(sess, PROMPT, 10)
    b = olv_runtime.generate(ref, PROMPT, 10)
    np.testing.assert_array_equal(a, b)
    assert calls == [True] * 7  # decode calls 3..9 of the 10 tokens (see the test above)
    # the KV values of a returned state equal the executor's
    ids_a, st_a = olv_runtime.generate(sess, PROMPT, 6, return_state=True)
    ids_b, st_b = olv_runtime.generate(ref, PROMPT, 6, return_state=True)
    np.testing.assert_array_equal(ids_a, ids_b)
    for name, v in st_b.values.items():
        np.testing.assert_array_equal(st_a.values[name], v)


def test_lazy_values_views_and_branching(model):
    """After program calls the retained values are made when read: read-only views of the
    right length, the same objects at every read and as the next full call's inputs; earlier
    views keep their contents; a state branched from them appends in place first and the
    original then copies."""
    sess = _session(model)
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    st.run({"input_ids": _ids(*PROMPT)}, outputs=LOGITS)
    for tok in TOKENS[:4]:
        sess.recycle(st.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"])
    n = len(PROMPT) + 4
    vals = st.values
    assert type(vals) is not types.MappingProxyType  # held as a span, views made when read
    assert len(vals) == 4 and set(vals) == {b[0] for b in st.bindings}
    first = {k: vals[k] for k in vals}
    for k, v in first.items():
        assert v.shape[2] == n and not v.flags.writeable
        assert st.values[k] is v  # same objects at every read
    snap = {k: np.array(v) for k, v in first.items()}
    with pytest.raises(TypeError):
        vals["past_key.0"] = first["past_key.0"]
    out = st.run({"input_ids": _ids(TOKENS[4])})  # all outputs: views of length n + 1
    for inp, o in st.bindings:
        assert out[o] is st.values[inp] and out[o].shape[2] == n + 1
        np.testing.assert_array_equal(out[o][:, :, :n], snap[inp])
    for k, v in first.items():  # the earlier views are intact
        np.testing.assert_array_equal(v, snap[k])
    # branch: b starts from a's lazily held values
    for tok in TOKENS[5:8]:
        st.run({"input_ids": _ids(tok)}, outputs=LOGITS)
    kept = {k: np.array(v) for k, v in st.values.items()}
    b = olv_runtime.make_state(sess, dict(st.values))
    before = sess.counters.snapshot()
    gb = b.run({"input_ids": _ids(5)})
    assert sess.counters["kv_reallocations"] == before["kv_reallocations"]  # b: in place
    ga = st.run({"input_ids": _ids(6)})
    assert sess.counters["kv_reallocations"] > before["kv_reallocations"]  # a: copies
    for k, v in kept.items():
        np.testing.assert_array_equal(ga[k.replace("past", "present")][:, :, :-1], v)
        np.testing.assert_array_equal(gb[k.replace("past", "present")][:, :, :-1], v)
    ref = _generic(_session(model, program=False))
    ref.reset({k: v for k, v in kept.items()})
    np.testing.assert_array_equal(ref.run({"input_ids": _ids(6)})["logits"], ga["logits"])
    # reset and close
    st.reset(olv_runtime.empty_cache(sess))
    assert type(st.values) is types.MappingProxyType and st.values["past_key.0"].shape[2] == 0
    st.close()
    with pytest.raises(StateError):
        st.run({"input_ids": _ids(1)}, outputs=LOGITS)


@pytest.mark.parametrize("fault", [RuntimeError("injected"), KeyboardInterrupt()])
def test_failing_program_call_publishes_nothing(model, fault):
    sess = _session(model)
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    ref = _generic(_session(model, program=False))
    for s in (st, ref):
        s.run({"input_ids": _ids(*PROMPT)}, outputs=LOGITS)
        for tok in TOKENS[:3]:
            s.run({"input_ids": _ids(tok)}, outputs=LOGITS)
    vals = st.values
    held = {k: vals[k] for k in vals}
    snap = {k: np.array(v) for k, v in held.items()}
    last = dict(st.last_counters)
    stack = next(s.impl for s in sess.all_steps() if s.kind == "DecoderStack")

    def boom(*args):
        raise fault
    real = stack.run_kernel
    stack.run_kernel = boom
    try:
        with pytest.raises(InvalidArgument if isinstance(fault, Exception) else KeyboardInterrupt):
            st.run({"input_ids": _ids(TOKENS[3])}, outputs=LOGITS)
    finally:
        stack.run_kernel = real
    assert st.values is vals and all(st.values[k] is v for k, v in held.items())
    assert st.last_counters["runs"] == 1 and st.last_counters["retained_state_bytes"] == \
        last["retained_state_bytes"]
    for tok in TOKENS[3:7]:
        a = st.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"]
        b = ref.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"]
        np.testing.assert_array_equal(a, b)
    for k, v in held.items():
        np.testing.assert_array_equal(v, snap[k])
    for k, v in ref.values.items():
        np.testing.assert_array_equal(st.values[k], v)
    assert st.counters["bytes_copied_state"] == 0


def test_steady_calls_refuse_what_the_generic_path_refuses(model, monkeypatch):
    calls = _program_calls(monkeypatch)
    sess = _session(model)
    st = _steady(sess)
    assert calls[-1]
    vals = st.values
    with pytest.raises(InvalidArgument, match=r"ids: expected indices in \[-128, 128\), got 128"):
        st.run({"input_ids": _ids(128)}, outputs=LOGITS)  # the program's own range check
    assert st.values is vals
    with pytest.raises(StateError, match="override"):
        st.run({"input_ids": _ids(1), "past_key.0": vals["past_key.0"]}, outputs=LOGITS)
    with pytest.raises(InvalidArgument, match="unknown input"):
        st.run({"input_idz": _ids(1)}, outputs=LOGITS)
    with pytest.raises(InvalidArgument, match="outputs: unknown output 'logitz'"):
        st.run({"input_ids": _ids(1)}, outputs=("logitz",))
    with pytest.raises(InvalidArgument, match="outputs: expected a sequence"):
        st.run({"input_ids": _ids(1)}, outputs="logits")
    with pytest.raises(InvalidArgument, match="element type"):
        st.run({"input_ids": np.array([[1.0]], np.float32)}, outputs=LOGITS)
    assert st.values is vals
    # a strided feed, two tokens, a negative id: the generic path, the results of a reference
    ref = _generic(_session(model, program=False))
    ref.reset({k: np.array(v) for k, v in vals.items()})
    for feed in (_ids(7, 8)[:, 1:], _ids(2, 3), _ids(-1), _ids(11), _ids(12)):
        a = st.run({"input_ids": feed}, outputs=LOGITS)["logits"]
        b = ref.run({"input_ids": feed}, outputs=LOGITS)["logits"]
        np.testing.assert_array_equal(a, b)
    assert calls[-1]  # back on the program after the generic calls


def test_concurrent_call_is_refused_during_a_program_call(model):
    sess = _session(model)
    st = _steady(sess)
    stack = next(s.impl for s in sess.all_steps() if s.kind == "DecoderStack")
    real = stack.run_kernel
    seen = []

    def reenter(*args):
        for call in (lambda: st.run({"input_ids": _ids(1)}, outputs=LOGITS),
                     lambda: st.reset(olv_runtime.empty_cache(sess)), st.close):
            with pytest.raises(StateError, match="another call is in progress"):
                call()
            seen.append(1)
        return real(*args)
    stack.run_kernel = reenter
    try:
        st.run({"input_ids": _ids(TOKENS[3])}, outputs=LOGITS)
    finally:
        stack.run_kernel = real
    assert len(seen) == 3 and not st.closed


def test_calls_from_another_thread(model):
    """The compiled step's per-thread state: a call on another thread is not this thread's
    steady call; it runs generically and the results stay those of one thread."""
    sess, ref_sess = _session(model), _session(model, program=False)
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    ref = _generic(ref_sess)
    for s in (st, ref):
        s.run({"input_ids": _ids(*PROMPT)}, outputs=LOGITS)
    got = []
    for i, tok in enumerate(TOKENS):
        if i % 3 == 2:
            box = []
            th = threading.Thread(target=lambda: box.append(
                st.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"].copy()))
            th.start()
            th.join()
            got.append(box[0])
        else:
            got.append(st.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"].copy())
        want = ref.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"]
        np.testing.assert_array_equal(got[-1], want)
    for k, v in ref.values.items():
        np.testing.assert_array_equal(st.values[k], v)


def test_steady_tokens_allocate_nothing(model):
    sess = _session(model, quant=True)
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    st.run({"input_ids": _ids(*PROMPT)}, outputs=LOGITS)
    for tok in TOKENS[:3]:
        sess.recycle(st.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"])
    before = sess.counters.snapshot()
    for tok in TOKENS[3:]:
        sess.recycle(st.run({"input_ids": _ids(tok)}, outputs=LOGITS)["logits"])
        c = st.last_counters
        assert c["arrays_allocated"] == 0 and c["bytes_allocated"] == 0
        assert c["bytes_copied_state"] == 0 and c["kv_reallocations"] == 0
        assert c["runs"] == 1 and c["bytes_copied_kv_append"] == 2 * 2 * 2 * 16 * 4
    after = sess.counters.snapshot()
    assert after["arrays_allocated"] == before["arrays_allocated"]
    assert after["runs"] - before["runs"] == len(TOKENS) - 3
    # not recycling: each call's logits come from a new pool buffer, counted per call
    out = st.run({"input_ids": _ids(1)}, outputs=LOGITS)
    st.run({"input_ids": _ids(2)}, outputs=LOGITS)
    assert st.last_counters["arrays_allocated"] == 1
    assert st.last_counters["bytes_allocated"] == out["logits"].nbytes


def test_outputs_argument_of_the_generic_path(model):
    sess = olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(compiled_decode=False))
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    out = st.run({"input_ids": _ids(*PROMPT)}, outputs=["present_key.1", "logits"])
    assert list(out) == ["present_key.1", "logits"]
    assert out["present_key.1"] is st.values["past_key.1"]
    full = st.run({"input_ids": _ids(3)})
    assert set(full) == set(sess._output_names)


def test_replaced_step_functions_send_calls_to_the_executor(model, monkeypatch):
    """Tests and benchmarks replace a step's ``fn``: the program then leaves every call to the
    executor (which calls the replacement), and takes them again once it is restored."""
    calls = _program_calls(monkeypatch)
    sess = _session(model)
    st = _steady(sess)
    assert calls[-1]
    gather = sess._steps[0]
    seen = []

    def wrapped(*args, _fn=gather.fn):
        seen.append(1)
        return _fn(*args)
    gather.fn = wrapped
    try:
        for tok in TOKENS[3:6]:
            st.run({"input_ids": _ids(tok)}, outputs=LOGITS)
    finally:
        gather.fn = gather.impl
    assert len(seen) == 3 and calls[-3:] == [False] * 3
    for tok in TOKENS[6:9]:
        st.run({"input_ids": _ids(tok)}, outputs=LOGITS)
    assert calls[-1]
