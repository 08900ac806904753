"""Persistent state (seed 000 PR04a/PR04b): binding validation, State API error paths, atomic
publication after failed/cancelled calls, concurrency, zero-copy pointer identity (numpy and
torch via DLPack), If/local-function transport, counters and the model-serialization guard.

Small hand-built graphs; a test-only operator ``test.state::Probe`` (registered here) passes its
input through and can fail, raise KeyboardInterrupt, block on an event, or return a strided view
on demand. The converted-Qwen acceptance tests are in ``test_state_qwen.py``.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.counters import PROCESS, Counters, recording
from olv_runtime.errors import BindingError, InvalidArgument, StateError, ValidationError
from olv_runtime.proto.helper import make_node, make_tensor, make_tensor_value_info
from olv_runtime.io import Model
from olv_runtime.ops.registry import Op, register
from olv_runtime.state import make_state, resolve_bindings

F, I64 = pb.TensorProto.FLOAT, pb.TensorProto.INT64


# -- the test-only operator ---------------------------------------------------------------------
class Control:
    """What the next Probe call does: None (pass through), "error", "interrupt", "block",
    "strided"."""

    mode = None
    seen: list = []  # data pointers of Probe's inputs
    entered = threading.Event()
    release = threading.Event()


@register("Probe", 1, domain="test.state")
class Probe(Op):
    def run(self, x):
        Control.seen.append(ptr(x))
        mode = Control.mode
        if mode == "error":
            raise RuntimeError("injected kernel fault")
        if mode == "interrupt":
            raise KeyboardInterrupt
        if mode == "block":
            Control.entered.set()
            assert Control.release.wait(10), "test never released the blocked Probe"
        if mode == "strided":
            return (np.repeat(x, 2)[::2],)  # same values, not contiguous
        return (x,)


@pytest.fixture(autouse=True)
def _reset_control():
    Control.mode = None
    Control.entered.clear()
    Control.release.clear()
    yield
    Control.mode = None
    Control.release.set()


# -- model builders -------------------------------------------------------------------------------
OPSETS = (("", 23), ("test.state", 1), ("local.fn", 1))


def _model(nodes, inputs, outputs, bindings=(), inits=(), functions=(), struct_types=()):
    m = pb.ModelProto(ir_version=10)
    for d, v in OPSETS:
        m.opset_import.add(domain=d, version=v)
    g = m.graph
    g.node.extend(nodes)
    g.input.extend(inputs)
    g.output.extend(outputs)
    g.initializer.extend(inits)
    for i, o in bindings:
        g.persistent_bindings.add(input_name=i, output_name=o)
    m.functions.extend(functions)
    m.struct_types.extend(struct_types)
    return m


def _vi(name, elem=F, shape=(4,)):
    return make_tensor_value_info(name, elem, list(shape))


def accumulator():
    """acc_next = Probe(acc + x); y = acc * 2; binding acc <- acc_next."""
    nodes = [make_node("Add", ["acc", "x"], ["sum"], name="add"),
             make_node("Probe", ["sum"], ["acc_next"], name="probe", domain="test.state"),
             make_node("Add", ["acc", "acc"], ["y"], name="double")]
    return _model(nodes, [_vi("x"), _vi("acc")], [_vi("y"), _vi("acc_next")],
                  [("acc", "acc_next")])


def feedback():
    """acc_next = Probe(acc) + x; binding acc <- acc_next."""
    nodes = [make_node("Probe", ["acc"], ["a"], name="probe", domain="test.state"),
             make_node("Add", ["a", "x"], ["acc_next"], name="add")]
    return _model(nodes, [_vi("x"), _vi("acc")], [_vi("acc_next")], [("acc", "acc_next")])


def passthrough():
    """keep_out = Identity(keep); y = keep + x; binding keep <- keep_out."""
    nodes = [make_node("Identity", ["keep"], ["keep_out"], name="id"),
             make_node("Add", ["keep", "x"], ["y"], name="add")]
    return _model(nodes, [_vi("x"), _vi("keep")], [_vi("y"), _vi("keep_out")],
                  [("keep", "keep_out")])


def ptr(a) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return a.data_ptr()


X = np.arange(4, dtype=np.float32)


def _state(model=None, initial=None):
    model = accumulator() if model is None else model
    init = {"acc": np.zeros(4, np.float32)} if initial is None else initial
    return make_state(model, init)


def assert_unchanged_and_working(state, before: dict, snapshot: dict):
    """Values are the very same arrays with the same contents, and the state still runs."""
    now = state.values
    assert set(now) == set(before)
    for k in before:
        assert now[k] is before[k]
        np.testing.assert_array_equal(now[k], snapshot[k])
    out = state.run({"x": X})
    return out


# == 1. binding validation ==========================================================================
def _bound(inputs, outputs, bindings, nodes=(), **kw):
    return Model(_model(list(nodes), inputs, outputs, bindings, **kw))


def test_dots_and_backslashes_are_literal():
    ins = [_vi("cache"), _vi("cache.keys"), _vi("a\\b")]
    outs = [_vi("next.keys"), _vi("c\\d")]
    m = _bound(ins, outs, [("cache.keys", "next.keys"), ("a\\b", "c\\d")])
    assert resolve_bindings(m) == [("cache.keys", "next.keys"), ("a\\b", "c\\d")]
    # "cache.keys" is not a field path into "cache": without an exact input it is unknown
    m2 = _bound([_vi("cache")], [_vi("next")], [("cache.keys", "next")])
    with pytest.raises(BindingError, match=r"'cache.keys' is not an input.*literal"):
        resolve_bindings(m2)
    m3 = _bound([_vi("a/b")], [_vi("c")], [("a\\b", "c")])
    with pytest.raises(BindingError, match="is not an input"):
        resolve_bindings(m3)


def _string_struct_catalogue():
    """type 7: struct {keys: FLOAT[4], label: STRING[1]}; type 8: struct {inner: ref 7, n: INT64}"""
    t7 = pb.StructTypeProto(type_id=7, name="WithString")
    f = t7.structure.field.add(name="keys")
    f.type.tensor_type.elem_type = F
    f = t7.structure.field.add(name="label")
    f.type.tensor_type.elem_type = pb.TensorProto.STRING
    t8 = pb.StructTypeProto(type_id=8, name="Outer")
    f = t8.structure.field.add(name="inner")
    f.type.struct_type.type_ref = 7
    f = t8.structure.field.add(name="n")
    f.type.tensor_type.elem_type = I64
    t9 = pb.StructTypeProto(type_id=9, name="ConstString")
    f = t9.structure.field.add(name="keys")
    f.type.tensor_type.elem_type = F
    f = t9.structure.field.add(name="tag")
    f.constant.data_type = pb.TensorProto.STRING
    f.constant.string_data.append(b"x")
    t10 = pb.StructTypeProto(type_id=10, name="Cache")
    f = t10.structure.field.add(name="keys")
    f.type.tensor_type.elem_type = F
    f = t10.structure.field.add(name="length")
    f.type.tensor_type.elem_type = I64
    t11 = pb.StructTypeProto(type_id=11, name="Other")
    f = t11.structure.field.add(name="keys")
    f.type.tensor_type.elem_type = F
    return [t7, t8, t9, t10, t11]


def _struct_vi(name, type_id):
    vi = pb.ValueInfoProto(name=name)
    vi.type.struct_type.type_ref = type_id
    return vi


def _seq_vi(name, elem):
    vi = pb.ValueInfoProto(name=name)
    vi.type.sequence_type.elem_type.tensor_type.elem_type = elem
    return vi


BAD_BINDINGS = {
    "unknown input": ([_vi("a")], [_vi("b")], [("nope", "b")], "'nope' is not an input"),
    "unknown output": ([_vi("a")], [_vi("b")], [("a", "nope")], "'nope' is not an output"),
    "duplicate input": ([_vi("a")], [_vi("b"), _vi("c")], [("a", "b"), ("a", "c")],
                        "input 'a' is already selected"),
    "duplicate output": ([_vi("a"), _vi("d")], [_vi("b")], [("a", "b"), ("d", "b")],
                         "output 'b' is already selected"),
    "string tensor": ([_vi("a", pb.TensorProto.STRING)], [_vi("b", pb.TensorProto.STRING)],
                      [("a", "b")], "string tensor"),
    "element type": ([_vi("a", F)], [_vi("b", I64)], [("a", "b")], "element types differ"),
    "rank": ([_vi("a", F, (4,))], [_vi("b", F, (4, 1))], [("a", "b")], "ranks differ"),
    "fixed dim": ([_vi("a", F, (4,))], [_vi("b", F, (5,))], [("a", "b")], "dimension 0 differs"),
    "kind": ([_vi("a")], [_seq_vi("b", F)], [("a", "b")], "input is tensor_type, output is sequence_type"),
    "string sequence": ([_seq_vi("a", pb.TensorProto.STRING)], [_seq_vi("b", pb.TensorProto.STRING)],
                        [("a", "b")], r"a\[\] is a string tensor"),
    "nested string field via type_ref": (
        [_struct_vi("a", 8)], [_struct_vi("b", 8)], [("a", "b")], r"a.inner.label is a string"),
    "string constant field": (
        [_struct_vi("a", 9)], [_struct_vi("b", 9)], [("a", "b")], r"a.tag \(constant\)"),
    "struct types differ": (
        [_struct_vi("a", 10)], [_struct_vi("b", 11)], [("a", "b")], "struct types differ"),
}


@pytest.mark.parametrize("case", sorted(BAD_BINDINGS))
def test_invalid_bindings(case):
    ins, outs, bindings, msg = BAD_BINDINGS[case]
    m = _bound(ins, outs, bindings, struct_types=_string_struct_catalogue())
    with pytest.raises(BindingError, match=msg):
        resolve_bindings(m)


def test_initializer_input_cannot_be_bound():
    m = _bound([_vi("a")], [_vi("b")], [("a", "b")],
               inits=[make_tensor("a", np.zeros(4, np.float32))])
    with pytest.raises(BindingError, match="is an initializer"):
        resolve_bindings(m)


def test_struct_binding_and_shared_type_with_different_bindings():
    """Two values of one struct type: one bound, the other not (no persistent flag on types)."""
    m = _bound([_struct_vi("cache", 10), _struct_vi("scratch", 10)],
               [_struct_vi("next_cache", 10), _struct_vi("scratch_out", 10)],
               [("cache", "next_cache")], struct_types=_string_struct_catalogue())
    assert resolve_bindings(m) == [("cache", "next_cache")]


def _if_node(name, then_g, else_g, cond="cond", outputs=("r",)):
    node = make_node("If", [cond], list(outputs), name=name)
    a = node.attribute.add(name="then_branch", type=pb.AttributeProto.GRAPH)
    a.g.CopyFrom(then_g)
    a = node.attribute.add(name="else_branch", type=pb.AttributeProto.GRAPH)
    a.g.CopyFrom(else_g)
    return node


def _branch(name, nodes, outputs, bindings=()):
    g = pb.GraphProto(name=name)
    g.node.extend(nodes)
    g.output.extend(outputs)
    for i, o in bindings:
        g.persistent_bindings.add(input_name=i, output_name=o)
    return g


def test_bindings_in_control_flow_subgraph_rejected():
    bad = _branch("then", [make_node("Identity", ["keep"], ["t"])], [_vi("t")], [("keep", "t")])
    good = _branch("else", [make_node("Identity", ["keep"], ["e"])], [_vi("e")])
    m = _bound([_vi("keep"), _vi("cond", pb.TensorProto.BOOL, ())], [_vi("r")], [],
               nodes=[_if_node("if0", bad, good)])
    with pytest.raises(BindingError, match="inside a control-flow subgraph"):
        resolve_bindings(m)
    with pytest.raises(BindingError, match="inside a control-flow subgraph"):
        olv_runtime.InferenceSession(m)  # also at session creation
    # inside a local function's If
    fn = pb.FunctionProto(name="F", domain="local.fn", input=["keep", "cond"], output=["r"])
    fn.node.append(_if_node("inner", bad, good))
    m2 = _bound([_vi("keep"), _vi("cond", pb.TensorProto.BOOL, ())], [_vi("r")], [],
                nodes=[make_node("F", ["keep", "cond"], ["r"], domain="local.fn")],
                functions=[fn])
    with pytest.raises(BindingError, match="function local.fn::F node 'inner'"):
        resolve_bindings(m2)


# == 2. State API and error paths ==================================================================
def test_run_matches_manual_loop_and_reset_restores():
    state = _state()
    acc = np.zeros(4, np.float32)
    for step in range(3):
        out = state.run({"x": X})
        np.testing.assert_array_equal(out["y"], 2 * acc)
        acc = acc + X
        np.testing.assert_array_equal(out["acc_next"], acc)
        assert out["acc_next"] is state.values["acc"]
    init = {"acc": np.full(4, 5, np.float32)}
    state.reset(init)
    assert ptr(state.values["acc"]) == ptr(init["acc"])
    np.testing.assert_array_equal(state.run({"x": X})["acc_next"], 5 + X)


def test_missing_and_unbound_initial_values():
    with pytest.raises(StateError, match="missing initial value for persistent input 'acc'"):
        make_state(accumulator(), {})
    with pytest.raises(InvalidArgument, match="'x' is not a persistently bound input"):
        make_state(accumulator(), {"acc": np.zeros(4, np.float32), "x": X})
    with pytest.raises(InvalidArgument, match="initial must be a dict"):
        make_state(accumulator(), [np.zeros(4, np.float32)])
    state = _state()
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    with pytest.raises(StateError, match="missing reset value"):
        state.reset({})
    with pytest.raises(InvalidArgument, match="expected element type FLOAT"):
        state.reset({"acc": np.zeros(4, np.float64)})
    with pytest.raises(InvalidArgument, match="dimension 0 must be 4"):
        state.reset({"acc": np.zeros(5, np.float32)})
    assert_unchanged_and_working(state, before, snap)


def test_feed_overriding_retained_input_and_unknown_feed():
    state = _state()
    state.run({"x": X})
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    with pytest.raises(StateError, match="would override the retained persistent input 'acc'"):
        state.run({"x": X, "acc": np.ones(4, np.float32)})
    assert_unchanged_and_working(state, before, snap)
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    with pytest.raises(InvalidArgument, match="unknown input 'bogus'"):
        state.run({"x": X, "bogus": X})
    with pytest.raises(InvalidArgument, match="missing input 'x'"):
        state.run({})
    with pytest.raises(InvalidArgument, match="feeds must be a dict"):
        state.run([X])
    assert_unchanged_and_working(state, before, snap)


def test_after_close():
    state = _state()
    out = state.run({"x": X})
    kept = out["acc_next"]
    with state:
        pass  # context manager closes
    assert state.closed
    for call in (lambda: state.run({"x": X}), lambda: state.values,
                 lambda: state.reset({"acc": np.zeros(4, np.float32)})):
        with pytest.raises(StateError, match="closed"):
            call()
    state.close()  # idempotent
    np.testing.assert_array_equal(kept, X)  # outstanding view still valid after close


@pytest.mark.parametrize("mode,exc", [("error", InvalidArgument), ("interrupt", KeyboardInterrupt)])
def test_failed_or_cancelled_run_publishes_nothing(mode, exc):
    state = _state()
    state.run({"x": X})
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    Control.mode = mode
    with pytest.raises(exc):
        state.run({"x": X})
    Control.mode = None
    out = assert_unchanged_and_working(state, before, snap)
    np.testing.assert_array_equal(out["acc_next"], 2 * X)  # exactly one successful call after
    assert state.last_counters["runs"] == 1


def test_kernel_exception_publishes_nothing():
    state = _state()
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    with pytest.raises(InvalidArgument, match="node 'add'.*do not broadcast|dimension 0 must be 4"):
        state.run({"x": np.zeros(3, np.float32)})
    assert_unchanged_and_working(state, before, snap)


def test_output_that_cannot_be_retained_is_rejected_not_copied():
    state = _state()
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    Control.mode = "strided"
    with pytest.raises(InvalidArgument, match="output 'acc_next' retained as next value.*not C-contiguous"):
        state.run({"x": X})
    Control.mode = None
    assert state.counters["bytes_copied_state"] == 0
    assert_unchanged_and_working(state, before, snap)


def test_concurrent_run_reset_close_raise_at_once():
    state = _state()
    state.run({"x": X})
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    Control.mode = "block"
    errors = []

    def slow():
        try:
            errors.append(state.run({"x": X}))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=slow)
    t.start()
    assert Control.entered.wait(10)
    t0 = time.monotonic()
    with pytest.raises(StateError, match="State.run: another call is in progress"):
        state.run({"x": X})
    with pytest.raises(StateError, match="State.reset: another call is in progress"):
        state.reset({"acc": np.zeros(4, np.float32)})
    with pytest.raises(StateError, match="State.close: another call is in progress"):
        state.close()
    assert time.monotonic() - t0 < 2.0  # raised at once, no waiting on the blocked call
    # values during the call: the previous ones
    assert state.values["acc"] is before["acc"]
    Control.mode = None
    Control.release.set()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(errors[0], dict)
    np.testing.assert_array_equal(state.values["acc"], snap["acc"] + X)
    state.run({"x": X})
    np.testing.assert_array_equal(state.values["acc"], snap["acc"] + 2 * X)
    state.close()


def test_independent_states_in_threads_count_separately():
    sess = olv_runtime.InferenceSession(accumulator())
    states = [make_state(sess, {"acc": np.zeros(4, np.float32)}) for _ in range(2)]
    n = 50

    def work(st):
        for _ in range(n):
            st.run({"x": X})

    threads = [threading.Thread(target=work, args=(s,)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for st in states:
        np.testing.assert_array_equal(st.values["acc"], n * X)
        assert st.counters["runs"] == n
        assert st.counters["retained_state_bytes"] == 16
    assert sess.counters["runs"] == 2 * n
    assert sess.counters["retained_state_bytes"] == 32  # sum over the open states
    states[0].close()
    assert sess.counters["retained_state_bytes"] == 16


# == 3. zero copy ===================================================================================
def test_pointer_identity_numpy_through_calls_values_and_reset():
    init = np.arange(4, dtype=np.float32)
    state = make_state(passthrough(), {"keep": init})
    p = ptr(init)
    assert ptr(state.values["keep"]) == p
    for _ in range(3):
        out = state.run({"x": X})
        assert ptr(out["keep_out"]) == p and ptr(state.values["keep"]) == p
        assert out["keep_out"] is state.values["keep"]
    init2 = np.ones(4, np.float32)
    state.reset({"keep": init2})
    assert ptr(state.values["keep"]) == ptr(init2)
    assert ptr(state.run({"x": X})["keep_out"]) == ptr(init2)
    assert state.counters["bytes_copied_state"] == 0
    # a computed output is retained itself and is the next call's input
    acc = _state()
    out = acc.run({"x": X})
    assert ptr(acc.values["acc"]) == ptr(out["acc_next"])
    # the next call reads the retained output array itself
    fb = make_state(feedback(), {"acc": np.zeros(4, np.float32)})
    outs = []
    for _ in range(3):
        Control.seen.clear()
        outs.append(fb.run({"x": X})["acc_next"])
        if len(outs) > 1:
            assert Control.seen == [ptr(outs[-2])]


def test_values_are_readonly_shared_views():
    state = _state()
    out = state.run({"x": X})
    v = state.values["acc"]
    assert not v.flags.writeable and not out["acc_next"].flags.writeable
    with pytest.raises(ValueError):
        v[0] = 1
    with pytest.raises(TypeError):
        state.values["acc"] = v  # the mapping is read-only too


def test_returned_views_stay_valid_after_reset_close_and_later_runs():
    state = _state()
    views = [state.run({"x": X})["acc_next"] for _ in range(3)]
    snaps = [np.array(v) for v in views]
    state.run({"x": X})
    state.reset({"acc": np.zeros(4, np.float32)})
    state.run({"x": X})
    state.close()
    del state
    for v, s in zip(views, snaps):
        np.testing.assert_array_equal(v, s)


def test_layouts_rejected_not_copied():
    bs = np.zeros(4, np.dtype(">f4"))
    with pytest.raises(InvalidArgument, match="byte-swapped.*no silent copy"):
        make_state(accumulator(), {"acc": bs})
    strided = np.zeros(8, np.float32)[::2]
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        make_state(accumulator(), {"acc": strided})
    state = _state()
    before, snap = dict(state.values), {k: np.array(v) for k, v in state.values.items()}
    with pytest.raises(InvalidArgument, match="reset value for persistent input 'acc'.*byte-swapped"):
        state.reset({"acc": bs})
    with pytest.raises(InvalidArgument, match="input 'x'.*not C-contiguous"):
        state.run({"x": np.zeros(8, np.float32)[::2]})
    assert_unchanged_and_working(state, before, snap)


import torch  # noqa: E402  (test extra: torch==2.13.0)


def test_torch_entry_points_share_memory():
    t = torch.arange(4, dtype=torch.float32)
    state = make_state(passthrough(), {"keep": t})
    assert ptr(state.values["keep"]) == t.data_ptr()
    out = state.run({"x": torch.ones(4)})
    assert ptr(out["keep_out"]) == t.data_ptr()
    np.testing.assert_array_equal(out["y"], np.arange(4) + 1)
    t2 = torch.full((4,), 3.0)
    state.reset({"keep": t2})
    assert ptr(state.values["keep"]) == t2.data_ptr()
    # a retained output exported back to torch shares memory too
    acc = make_state(accumulator(), {"acc": torch.zeros(4)})
    acc.run({"x": torch.ones(4)})
    back = torch.from_dlpack(acc.values["acc"])
    assert back.data_ptr() == ptr(acc.values["acc"])
    assert state.counters["bytes_copied_state"] == acc.counters["bytes_copied_state"] == 0


def test_torch_unsupported_layouts_rejected():
    nc = torch.zeros(4, 2).t()[0]  # non-contiguous view
    assert not nc.is_contiguous()
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        make_state(accumulator(), {"acc": nc})
    g = torch.zeros(4, requires_grad=True)
    with pytest.raises(InvalidArgument, match="cannot be viewed without a copy"):
        make_state(accumulator(), {"acc": g})


# == If branches and local functions transport buffers ==========================================
def transport_model():
    """f = local.fn::Pass(keep); r = If(cond) then Identity(f) else f (outer value directly);
    keep <- r. The If branches also read ``keep`` (an outer value used earlier explicitly)."""
    fn = pb.FunctionProto(name="Pass", domain="local.fn", input=["a"], output=["b"])
    fn.opset_import.add(domain="", version=23)
    fn.node.append(make_node("Identity", ["a"], ["b"]))
    then_g = _branch("then", [make_node("Identity", ["f"], ["t"]),
                              make_node("Add", ["keep", "keep"], ["t2"])],
                     [_vi("t"), _vi("t2")])
    else_g = _branch("else", [make_node("Sub", ["keep", "keep"], ["e2"])], [_vi("f"), _vi("e2")])
    nodes = [make_node("Pass", ["keep"], ["f"], name="call", domain="local.fn"),
             make_node("Add", ["keep", "x"], ["y"], name="add"),
             _if_node("if0", then_g, else_g, outputs=("r", "r2"))]
    return _model(nodes, [_vi("x"), _vi("keep"), _vi("cond", pb.TensorProto.BOOL, ())],
                  [_vi("y"), _vi("r"), _vi("r2")], [("keep", "r")], functions=[fn])


@pytest.mark.parametrize("cond", [True, False])
def test_if_and_local_function_keep_buffers(cond):
    init = np.arange(4, dtype=np.float32)
    state = make_state(transport_model(), {"keep": init})
    for _ in range(3):
        out = state.run({"x": X, "cond": np.array(cond)})
        assert ptr(out["r"]) == ptr(init) == ptr(state.values["keep"])
        np.testing.assert_array_equal(out["r2"], init * 2 if cond else init * 0)
        np.testing.assert_array_equal(out["y"], init + X)
    assert ("If", "if0") in olv_runtime.InferenceSession(transport_model()).plan()
    assert state.counters["bytes_copied_state"] == 0
    assert state.counters["model_serializations"] == 0


def test_local_function_attribute_reference_and_errors():
    fn = pb.FunctionProto(name="Twice", domain="local.fn", input=["a"], output=["b"],
                          attribute=["how"])
    fn.opset_import.add(domain="", version=23)
    n = make_node("Cast", ["a"], ["c"])
    n.attribute.add(name="to", ref_attr_name="how", type=pb.AttributeProto.INT)
    fn.node.extend([n, make_node("Add", ["c", "c"], ["b"])])
    call = make_node("Twice", ["x"], ["y"], name="call", domain="local.fn", how=I64)
    m = _model([call], [_vi("x")], [_vi("y", I64)], functions=[fn])
    sess = olv_runtime.InferenceSession(m)
    (y,) = sess.run(None, {"x": np.array([1.5, 2, 3, 4], np.float32)})
    np.testing.assert_array_equal(y, [2, 4, 6, 8])
    bad = pb.FunctionProto(name="Bad", domain="local.fn", input=["a"], output=["b"])
    bad.node.append(make_node("Identity", ["nowhere"], ["b"]))
    m2 = _model([make_node("Bad", ["x"], ["y"], domain="local.fn")], [_vi("x")], [_vi("y")],
                functions=[bad])
    with pytest.raises(ValidationError, match="reads 'nowhere'"):
        olv_runtime.InferenceSession(m2)
    rec = pb.FunctionProto(name="Rec", domain="local.fn", input=["a"], output=["b"])
    rec.node.append(make_node("Rec", ["a"], ["b"], domain="local.fn"))
    m3 = _model([make_node("Rec", ["x"], ["y"], domain="local.fn")], [_vi("x")], [_vi("y")],
                functions=[rec])
    with pytest.raises(ValidationError, match="calls itself"):
        olv_runtime.InferenceSession(m3)


# == 4. counters ===================================================================================
def test_allocation_and_workspace_counters():
    state = make_state(passthrough(), {"keep": np.zeros(4, np.float32)})
    state.run({"x": X})
    c = state.last_counters
    assert c["runs"] == 1
    assert c["arrays_allocated"] == 1 and c["bytes_allocated"] == 16  # y = keep + x only
    assert c["workspace_peak"] == 16
    assert c["bytes_copied_state"] == 0 and c["model_serializations"] == 0
    assert c["retained_state_bytes"] == 16 and c["retained_state_buffer_bytes"] == 16
    acc = _state()
    for _ in range(4):
        acc.run({"x": X})
    assert acc.last_counters["arrays_allocated"] == 2  # sum (then Probe passes it) and y
    assert acc.counters["arrays_allocated"] == 8
    assert acc.counters["runs"] == 4
    assert acc.session.counters["runs"] == 4
    assert acc.construction_counters["runs"] == 0


def test_per_call_counters_sum_to_cumulative():
    state = _state()
    total = Counters()
    total.merge(state.construction_counters)
    for _ in range(5):
        state.run({"x": X})
        total.merge(state.last_counters)
    state.reset({"acc": np.zeros(4, np.float32)})
    total.merge(state.last_counters)
    assert total.snapshot() == state.counters.snapshot()


def test_recording_scopes_nest_and_are_per_thread():
    c = Counters()
    with recording() as outer:
        c.add("bytes_copied_other", 3)
        with recording() as inner:
            c.add("bytes_copied_other", 4)
        t = threading.Thread(target=lambda: c.add("bytes_copied_other", 100))
        t.start()
        t.join()
    assert inner["bytes_copied_other"] == 4 and outer["bytes_copied_other"] == 7
    assert c["bytes_copied_other"] == 107
    with pytest.raises(KeyError, match="unknown counter"):
        c.add("nope", 1)


def test_model_serialization_guard_counts_save_not_state(tmp_path, monkeypatch):
    model = olv_runtime.load(_save(passthrough(), tmp_path / "a.onnx"))
    before = PROCESS["model_serializations"]
    olv_runtime.save(model, tmp_path / "b.onnx")
    assert PROCESS["model_serializations"] > before  # explicit save is counted
    before = PROCESS["model_serializations"]

    def forbidden(*a, **k):
        raise AssertionError("the model was serialized/cloned/compared on the state path")

    for cls in (pb.ModelProto, pb.GraphProto, pb.FunctionProto):
        for meth in ("SerializeToString", "SerializePartialToString", "CopyFrom", "MergeFrom",
                     "__deepcopy__", "__copy__", "__reduce__", "__eq__"):
            monkeypatch.setattr(cls, meth, forbidden, raising=False)
    state = make_state(model, {"keep": np.zeros(4, np.float32)})
    for _ in range(10):
        state.run({"x": X})
    state.reset({"keep": np.ones(4, np.float32)})
    monkeypatch.undo()
    assert PROCESS["model_serializations"] == before
    assert state.counters["model_serializations"] == 0
    assert state.construction_counters["model_serializations"] == 0


def _save(model_proto, path):
    olv_runtime.save(Model(model_proto), path)
    return path


def test_one_check_per_value_per_call(monkeypatch):
    """A call checks each feed and each value it retains once: the retained inputs, checked
    when they were retained, enter the next call without a second per-binding check."""
    import olv_runtime.executor.session as session_mod
    import olv_runtime.state.state as state_mod

    state = _state()
    state.run({"x": X})
    calls = []
    real = session_mod.check_tensor

    def counting(name, *a, **k):
        calls.append(name)
        return real(name, *a, **k)
    real_group = state_mod._TensorGroup.check

    def counting_group(self, values):  # the retained outputs of a binding group, checked at once
        calls.extend(b.input for b in self.bindings)
        return real_group(self, values)
    monkeypatch.setattr(session_mod, "check_tensor", counting)
    monkeypatch.setattr(state_mod, "check_tensor", counting)
    monkeypatch.setattr(state_mod._TensorGroup, "check", counting_group)
    before = ptr(state.values["acc"])
    out = state.run({"x": X})
    assert sorted(calls) == ["acc", "x"]  # x as a feed, acc_next retained as acc
    assert out["acc_next"] is state.values["acc"] and ptr(out["acc_next"]) != before
    assert not state.values["acc"].flags.writeable
