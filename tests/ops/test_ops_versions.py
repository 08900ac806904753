"""Operator version ranges of the registry (issue 12 item 1): lookups inside a range, outside
it (clear UnsupportedOperatorError naming the ranges), and overlapping registrations."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from olv_runtime.errors import UnsupportedOperatorError
from olv_runtime.ops.registry import MAX_OPSET, Op, lookup, register, registered_ranges
from olv_runtime.executor.session import InferenceSession


def _model(nodes, inputs, outputs, opset):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset", [11, 13, 17, 18, 20, 23])
def test_reduce_sum_axes_attribute_and_input(opset):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    yo = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if opset < 13:
        nodes = [helper.make_node("ReduceSum", ["x"], ["y"], axes=[1], keepdims=0)]
    else:
        axes = helper.make_node("Constant", [], ["a"], value=helper.make_tensor(
            "a", TensorProto.INT64, [1], [1]))
        nodes = [axes, helper.make_node("ReduceSum", ["x", "a"], ["y"], keepdims=0)]
    (y,) = InferenceSession(_model(nodes, [xi], [yo], opset)).run(None, {"x": x})
    np.testing.assert_array_equal(y, x.sum(axis=1))


def test_opset_newer_than_checked_is_rejected():
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    yo = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [xi], [yo], MAX_OPSET)
    InferenceSession(m)
    m.opset_import[0].version = MAX_OPSET + 1
    with pytest.raises(UnsupportedOperatorError, match=rf"Neg at opset {MAX_OPSET + 1}.*6-{MAX_OPSET}"):
        InferenceSession(m)


def test_opset_older_than_implemented_is_rejected():
    with pytest.raises(UnsupportedOperatorError, match=r"Gelu at opset 19.*20-"):
        lookup("", "Gelu", 19)


def test_ranges_cover_opsets_13_to_23_for_every_standard_op():
    """Each standard operator registered at or before opset 13 resolves at every opset up to
    23 (models exported at opset 13-20 run)."""
    by_op: dict[str, list] = {}
    for domain, op, lo, hi in registered_ranges():
        if domain == "":
            by_op.setdefault(op, []).append((lo, hi))
    for op, ranges in by_op.items():
        first = min(lo for lo, _ in ranges)
        for v in range(max(first, 13), 24):
            assert any(lo <= v <= hi for lo, hi in ranges), (op, v, ranges)
            lookup("", op, v)


def test_overlapping_registration_is_refused():
    with pytest.raises(ValueError, match="overlap"):
        @register("Neg", 13)
        class _Again(Op):  # noqa: F811
            pass


def test_flatten_negative_axis():
    x = np.zeros((2, 3, 4, 5), np.float32)
    xi = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])
    yo = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    for axis, shape in ((-1, (24, 5)), (-2, (6, 20)), (-4, (1, 120)), (0, (1, 120)), (4, (120, 1))):
        m = _model([helper.make_node("Flatten", ["x"], ["y"], axis=axis)], [xi], [yo], 13)
        (y,) = InferenceSession(m).run(None, {"x": x})
        assert y.shape == shape, (axis, y.shape)


def test_constant_at_old_opsets():
    for opset in (9, 11, 13, 17):
        t = helper.make_tensor("c", TensorProto.FLOAT, [2], [1.5, -2.0])
        yo = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
        m = _model([helper.make_node("Constant", [], ["y"], value=t)], [], [yo], opset)
        (y,) = InferenceSession(m).run(None, {})
        np.testing.assert_array_equal(y, [1.5, -2.0])


def test_operator_docs_are_generated_from_the_registry():
    """docs/operators.md is what scripts/gen_operator_docs.py writes (checked in a fresh process:
    other tests register operators of their own)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "scripts" / "gen_operator_docs.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, (
        f"docs/operators.md is stale: run python scripts/gen_operator_docs.py ({res.stderr[-500:]})")


def test_output_count_table_matches_onnx_defs_for_every_op_and_opset():
    # the session checks node output counts from this table instead of importing onnx.defs
    import onnx.defs

    from olv_runtime.ops.schema_outputs import OUTPUTS, output_range, table_from_onnx

    assert OUTPUTS == table_from_onnx()
    names = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == ""}
    assert names == set(OUTPUTS)
    for name in sorted(names):
        for version in range(1, MAX_OPSET + 1):
            try:
                schema = onnx.defs.get_schema(name, version, "")
                want = (schema.min_output, schema.max_output)
            except onnx.defs.SchemaError:
                want = None
            assert output_range(name, version) == want, (name, version)



def test_lazy_operator_modules_register_exactly_what_they_declare():
    # operator families imported on first lookup: each declaration must name every operator its
    # module registers (else a model using an undeclared one would fail to find it)
    import importlib

    from olv_runtime.ops import LAZY_MODULES
    from olv_runtime.ops.registry import _REGISTRY

    registered_ranges()  # imports every declared module
    for module, ops in LAZY_MODULES.items():
        importlib.import_module(module)
        got = {key for key, versions in _REGISTRY.items()
               if any(cls.__module__ == module for _, _, cls in versions)}
        assert got == set(ops), module
