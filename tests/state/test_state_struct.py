"""A whole struct-typed cache input retained across calls, field by field (issue 4, seed 000
"Whole structured inputs"): fields the graph passes through keep their buffers."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import InvalidArgument
from olv_runtime.proto.helper import make_node, make_tensor
from olv_runtime.structs.build import declare, field, scalar, structure, tensor


def _cache_type():
    """type 10: Cache {keys: FLOAT[2, 3], values: FLOAT[2, 3], length: INT64}."""
    return declare(10, "Cache", structure(
        field("keys", tensor(pb.TensorProto.FLOAT, [2, 3])),
        field("values", tensor(pb.TensorProto.FLOAT, [2, 3])),
        field("length", scalar(pb.TensorProto.INT64)),
    ))


def _model():
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.struct_types.append(_cache_type())
    g = m.graph
    x = g.input.add(name="x")
    x.type.tensor_type.elem_type = pb.TensorProto.FLOAT
    for name in ("cache", "scratch"):  # one struct type, two inputs: only "cache" is bound
        g.input.add(name=name).type.struct_type.type_ref = 10
    g.initializer.append(make_tensor("one", np.array(1, np.int64)))
    g.node.extend([
        make_node("StructGet", ["cache"], ["keys", "values", "length"], name="get",
                  domain="olv", fields=["keys", "values", "length"]),
        make_node("Identity", ["keys"], ["keys_through"], name="id"),
        make_node("Add", ["length", "one"], ["next_length"], name="inc"),
        make_node("StructMake", ["keys_through", "values", "next_length"], ["next_cache"],
                  name="make", domain="olv", fields=["keys", "values", "length"]),
        make_node("Add", ["x", "values"], ["y"], name="use"),
        make_node("Identity", ["scratch"], ["scratch_out"], name="id_scratch"),
    ])
    y = g.output.add(name="y")
    y.type.tensor_type.elem_type = pb.TensorProto.FLOAT
    for name in ("next_cache", "scratch_out"):
        g.output.add(name=name).type.struct_type.type_ref = 10
    g.persistent_bindings.add(input_name="cache", output_name="next_cache")
    return m


def _ptr(a):
    return a.__array_interface__["data"][0]


def test_struct_cache_retained_whole_with_field_pointers_unchanged():
    keys = np.arange(6, dtype=np.float32).reshape(2, 3)
    values = np.ones((2, 3), np.float32)
    initial = olv_runtime.RuntimeStruct({"keys": keys, "values": values,
                                         "length": np.array(0, np.int64)})
    state = olv_runtime.make_state(_model(), {"cache": initial})
    assert state.bindings == [("cache", "next_cache")]
    assert state.construction_counters["bytes_copied_state"] == 0
    scratch = olv_runtime.RuntimeStruct({"keys": keys, "values": values,
                                         "length": np.array(7, np.int64)})
    x = np.full((2, 3), 2.0, np.float32)
    for step in range(1, 6):
        out = state.run({"x": x, "scratch": scratch})
        cache = state.values["cache"]
        assert out["next_cache"] is cache
        assert _ptr(cache["keys"]) == _ptr(keys)      # passed through StructGet + Identity
        assert _ptr(cache["values"]) == _ptr(values)  # passed through StructGet
        assert int(cache["length"]) == step           # computed
        assert not cache["keys"].flags.writeable      # retained views are read-only
        np.testing.assert_array_equal(out["y"], x + values)
        assert out["scratch_out"] is scratch          # unbound output of the same type
        assert state.last_counters["bytes_copied_state"] == 0
        assert state.last_counters["model_serializations"] == 0
    assert state.values["cache"]["length"] is not initial["length"]
    # reset restores the initial value (its own buffers)
    state.reset({"cache": initial})
    assert _ptr(state.values["cache"]["keys"]) == _ptr(keys)
    assert int(state.values["cache"]["length"]) == 0


def test_struct_field_buffers_from_the_pool_are_not_recycled():
    """The computed ``length`` field comes from the activation pool: once inside a retained
    struct it must never be reused by a later call."""
    initial = olv_runtime.RuntimeStruct({"keys": np.zeros((2, 3), np.float32),
                                         "values": np.zeros((2, 3), np.float32),
                                         "length": np.array(0, np.int64)})
    scratch = initial
    state = olv_runtime.make_state(_model(), {"cache": initial})
    seen = []
    for _ in range(4):
        state.run({"x": np.zeros((2, 3), np.float32), "scratch": scratch})
        seen.append(state.values["cache"])
    assert [int(c["length"]) for c in seen] == [1, 2, 3, 4]


def test_bad_struct_initial_values_are_rejected():
    with pytest.raises(InvalidArgument, match=r"cache.keys: expected shape \[2, 3\], got \[3, 2\]"):
        olv_runtime.make_state(_model(), {"cache": olv_runtime.RuntimeStruct({
            "keys": np.zeros((3, 2), np.float32), "values": np.zeros((2, 3), np.float32),
            "length": np.array(0, np.int64)})})
    with pytest.raises(InvalidArgument, match="unknown field"):
        olv_runtime.make_state(_model(), {"cache": olv_runtime.RuntimeStruct({
            "keys": np.zeros((2, 3), np.float32), "values": np.zeros((2, 3), np.float32),
            "length": np.array(0, np.int64), "extra": np.zeros(1)})})
    with pytest.raises(InvalidArgument, match="expected a struct value"):
        olv_runtime.make_state(_model(), {"cache": np.zeros((2, 3), np.float32)})
