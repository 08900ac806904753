"""onnx's backend node tests for every registered standard operator (issue 12 item 2, issue 11).

``onnx.backend.test.case.node.collect_testcases()`` builds each case's model, inputs and
expected outputs in memory (no data files). A case is run here when every operator of its graph
is registered in :mod:`olv_runtime.ops` (so the function-expanded ``*_expanded`` variants run as
soon as all the operators of their bodies are registered). Each case either

* passes: same output count, shapes and dtypes, values within the case's ``rtol``/``atol``
  (exact for integers and bools), or
* is listed in :data:`REJECTIONS` and raises a ``ValidationError`` or
  ``UnsupportedOperatorError`` whose message contains the listed text (the unsupported dtype,
  attribute or operator) — at session creation or at the first run.

A listed case that starts passing fails :func:`test_rejection_table_is_exact` so the table only
ever shrinks honestly. Run ``python tests/ops/test_onnx_conformance.py`` for the pass/total table
per operator.
"""
from __future__ import annotations

import collections
import fnmatch
import re
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from olv_runtime.errors import OlvError, UnsupportedOperatorError, ValidationError
from olv_runtime.ops import registered
from olv_runtime.executor.session import InferenceSession

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the case generators overflow on purpose (Cast cases)
    from onnx.backend.test.case.node import collect_testcases

    _ALL = collect_testcases()

_REGISTERED = {op for domain, op, _ in registered() if domain == ""}
_BY_NAME = {c.name: c for c in _ALL}


def _ops(case) -> set[str]:
    return {n.op_type for n in case.model.graph.node if n.domain in ("", "ai.onnx")} | {
        f"{n.domain}::{n.op_type}" for n in case.model.graph.node if n.domain not in ("", "ai.onnx")}


def _subgraph_ops(case) -> set[str]:
    out = set()
    for n in case.model.graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                out |= {m.op_type for m in a.g.node}
    return out


def base_operator(case) -> str:
    """The operator a case tests: the single node's op, or the op whose function the
    ``*_expanded`` graph expands."""
    if "_expanded" in case.name:
        base = _BY_NAME.get(re.sub(r"_expanded.*$", "", case.name))
        if base is not None:
            return base.model.graph.node[0].op_type
    return case.model.graph.node[0].op_type


CASES = {c.name: c for c in _ALL if _ops(c) <= _REGISTERED}

#: Expected rejections: (case-name pattern, text the error message must contain, reason).
REJECTIONS: list[tuple[str, str, str]] = [
    ("test_*bfloat16*", "BFLOAT16", "bfloat16 tensors: numpy has no bfloat16 dtype"),
    ("test_*bf16*", "BFLOAT16", "bfloat16 tensors: numpy has no bfloat16 dtype"),
    ("test_*BFLOAT16*", "BFLOAT16", "bfloat16 tensors: numpy has no bfloat16 dtype"),
    ("test_cast*FLOAT8E*", "FLOAT8E", "float8 tensors are not supported"),
    ("test_cast*FLOAT4E2M1*", "FLOAT4E2M1", "float4 tensors are not supported"),
    ("test_cast*_to_INT4*", "INT4", "Cast to a sub-byte integer type"),
    ("test_cast*_to_UINT4*", "UINT4", "Cast to a sub-byte integer type"),
    ("test_cast*_to_INT2*", "INT2", "Cast to a sub-byte integer type"),
    ("test_cast*_to_UINT2*", "UINT2", "Cast to a sub-byte integer type"),
    ("test_cast*_INT4_to_*", "INT4", "sub-byte integer graph inputs"),
    ("test_cast*_UINT4_to_*", "UINT4", "sub-byte integer graph inputs"),
    ("test_cast*_INT2_to_*", "INT2", "sub-byte integer graph inputs"),
    ("test_cast*_UINT2_to_*", "UINT2", "sub-byte integer graph inputs"),
    ("test_equal_string*", "STRING", "string tensors"),
    ("test_identity_sequence", "sequence_type", "sequence values"),
    ("test_identity_opt", "optional_type", "optional values"),
    ("test_if_seq", "SequenceConstruct", "sequence operators"),
    ("test_if_opt", "Optional", "optional operators"),
    ("test_*quantizelinear_e4m3fn*", "FLOAT8E4M3FN", "float8 graph inputs"),
    ("test_*quantizelinear_e5m2*", "FLOAT8E5M2", "float8 graph inputs"),
    ("test_*quantizelinear_float4e2m1*", "FLOAT4E2M1", "float4 graph inputs"),
    ("test_*quantizelinear_int4*", "INT4", "sub-byte graph inputs (INT4 initializers run)"),
    ("test_*quantizelinear_uint4*", "UINT4", "sub-byte graph inputs (UINT4 initializers run)"),
    ("test_*quantizelinear_int2*", "INT2", "sub-byte graph inputs (INT2 initializers run)"),
    ("test_*quantizelinear_uint2*", "UINT2", "sub-byte graph inputs (UINT2 initializers run)"),
    ("test_bitshift_*", "BitShift at opset 28", "BitShift-28 (signed types) is not implemented"),
]


def expected_rejection(name: str) -> tuple[str, str] | None:
    for pattern, text, reason in REJECTIONS:
        if fnmatch.fnmatchcase(name, pattern):
            return text, reason
    return None


def _feed(x):
    return onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x)


def run_case(case) -> str:
    """'pass', or raises: AssertionError for a wrong value, OlvError for a rejection."""
    model = case.model
    inputs, expected = case.data_sets[0]
    sess = InferenceSession(model)
    names = [vi.name for vi in model.graph.input]
    got = sess.run(None, {n: _feed(x) for n, x in zip(names, inputs)})
    assert len(got) == len(expected), f"{len(got)} outputs, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        e = _feed(e)
        g = np.asarray(g)
        assert g.shape == e.shape, f"output {i}: shape {g.shape}, expected {e.shape}"
        assert g.dtype == e.dtype, f"output {i}: dtype {g.dtype}, expected {e.dtype}"
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(g, e, rtol=case.rtol, atol=case.atol, equal_nan=True,
                                       err_msg=f"output {i}")
        else:
            np.testing.assert_array_equal(g, e, err_msg=f"output {i}")
    return "pass"


def outcome(case) -> tuple[str, str]:
    """('pass' | 'reject' | 'wrong' | 'raw', detail) for the summary table."""
    try:
        run_case(case)
        return "pass", ""
    except AssertionError as exc:
        return "wrong", str(exc).splitlines()[0]
    except (ValidationError, UnsupportedOperatorError) as exc:
        return "reject", str(exc)
    except Exception as exc:  # OlvError of another kind, or a raw Python error
        return "raw", f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_backend_node_case(name):
    case = CASES[name]
    rejection = expected_rejection(name)
    if rejection is None:
        run_case(case)
        return
    text, reason = rejection
    with pytest.raises((ValidationError, UnsupportedOperatorError)) as info:
        run_case(case)
    assert text in str(info.value), (
        f"{name} ({reason}): rejection message {str(info.value)!r} does not name {text!r}")


def test_rejection_table_is_exact():
    """Every table entry matches at least one collected case (no stale entries)."""
    for pattern, _, reason in REJECTIONS:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in CASES), (pattern, reason)


def test_every_registered_operator_has_cases_or_is_known():
    """The suite exercises the registered standard operators (those onnx has cases for)."""
    tested = {base_operator(c) for c in CASES.values()} | {
        op for c in CASES.values() for op in _ops(c)}
    with_cases = {c.model.graph.node[0].op_type for c in _ALL}
    missing = sorted((_REGISTERED & with_cases) - tested)
    assert not missing, f"registered operators whose onnx cases are not run: {missing}"


def summary() -> dict[str, collections.Counter]:
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name in sorted(CASES):
        kind, _ = outcome(CASES[name])
        table[base_operator(CASES[name])][kind] += 1
    return table


if __name__ == "__main__":  # pass/total per operator, for the closing note
    table = summary()
    total = collections.Counter()
    print(f"{'operator':24s} pass/total  rejected  wrong  raw")
    for op in sorted(table):
        c = table[op]
        total.update(c)
        print(f"{op:24s} {c['pass']:4d}/{sum(c.values()):<5d} {c['reject']:8d} {c['wrong']:6d} "
              f"{c['raw']:4d}")
    print(f"{'TOTAL':24s} {total['pass']:4d}/{sum(total.values()):<5d} {total['reject']:8d} "
          f"{total['wrong']:6d} {total['raw']:4d}")
    matched = sum(1 for n in CASES if expected_rejection(n))
    print(f"rejection table: {len(REJECTIONS)} entries matching {matched} cases")
