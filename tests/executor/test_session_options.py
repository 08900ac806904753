"""SessionOptions validates every field's type and range at construction (a specific
InvalidArgument naming the field and the value), not later at run time."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime.errors import InvalidArgument


@pytest.mark.parametrize("field", ["enable_fusion", "prepack", "quantize_activations",
                                   "compiled_decode", "use_compiled"])
@pytest.mark.parametrize("value", ["no", 0, 1, None, 1.0])
def test_flags_must_be_bool(field, value):
    with pytest.raises(InvalidArgument, match=rf"SessionOptions.{field} must be a bool.*{value!r}"):
        olv_runtime.SessionOptions(**{field: value})


@pytest.mark.parametrize("field", ["enable_fusion", "prepack", "compiled_decode"])
def test_flags_accept_bools(field):
    for v in (True, False, np.bool_(True)):
        olv_runtime.SessionOptions(**{field: v})


@pytest.mark.parametrize("growth", [1e300, 17.0, 1e6, True, "2", np.float32(np.nan)])
def test_kv_growth_range_and_type(growth):
    with pytest.raises(InvalidArgument, match=r"SessionOptions.kv_growth must be a finite number "
                                              r"in \(1, 16\]"):
        olv_runtime.SessionOptions(kv_growth=growth)


def test_kv_growth_accepted():
    for g in (1.5, 2, 16.0, np.float32(3.0)):
        olv_runtime.SessionOptions(kv_growth=g)


@pytest.mark.parametrize("cap", [-1, 1 << 40, 2.5, 256.0, "256", True, None])
def test_kv_initial_capacity(cap):
    with pytest.raises(InvalidArgument, match="SessionOptions.kv_initial_capacity must be"):
        olv_runtime.SessionOptions(kv_initial_capacity=cap)


@pytest.mark.parametrize("n", [0, -1, 1 << 20, 1.0, "2", True])
def test_num_threads(n):
    with pytest.raises(InvalidArgument, match="SessionOptions.num_threads must be"):
        olv_runtime.SessionOptions(num_threads=n)


def test_growth_1e300_refused_before_any_run():
    # the tester's case: accepted, then "Maximum allowed dimension exceeded" inside a node
    with pytest.raises(InvalidArgument, match="kv_growth.*1e\\+300"):
        olv_runtime.SessionOptions(kv_growth=1e300)
