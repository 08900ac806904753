"""The SiluMul step (executor/steps.py): bitwise the unfused numpy graph
``Mul(Mul(g, Sigmoid(g)), u)`` with ``Sigmoid(x) = 1 / (1 + exp(-x))``, on the strided halves of
a merged gate|up output and on contiguous arrays, one row chunk and many."""
from __future__ import annotations

import numpy as np
import pytest

from olv_runtime.errors import InvalidArgument
from olv_runtime.executor.steps import SiluMul


def _unfused(g, u):
    with np.errstate(over="ignore"):
        sig = np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
    return (g * sig) * u


@pytest.mark.parametrize("shape", [(3, 7), (1, 1, 4864), (1, 64, 4864), (512, 4864), (5,)])
@pytest.mark.parametrize("halves", [True, False])
def test_silu_mul_bitwise(shape, halves):
    rng = np.random.default_rng(sum(shape))
    n = shape[-1]
    gu = (rng.standard_normal(shape[:-1] + (2 * n,)) * 6).astype(np.float32)
    gu.reshape(-1)[:4] = [-100.0, 100.0, 0.0, -0.0]  # exp overflow to inf, signed zeros
    g, u = gu[..., :n], gu[..., n:]
    if not halves:
        g, u = np.ascontiguousarray(g), np.ascontiguousarray(u)
    (out,) = SiluMul("m")(g, u)
    assert out.shape == g.shape and out.dtype == np.float32
    ref = _unfused(g, u)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_silu_mul_rejects_mismatch():
    g = np.zeros((2, 8), np.float32)
    with pytest.raises(InvalidArgument, match="SiluMul"):
        SiluMul("m")(g, np.zeros((2, 9), np.float32))
    with pytest.raises(InvalidArgument, match="float32"):
        SiluMul("m")(g, np.zeros((2, 8), np.float64))
