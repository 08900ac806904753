"""``o += p @ V`` of the attention kernels (kernels/attention.py ``_accum_rows``): the register
path (``_pv16``, head dims that are a multiple of 16, unit strides along D) and the
four-keys-per-pass loop (other head dims, or a stride along D) against a float64 reference and
against each other, with the edges: no key, one key, a tile plus a remainder, strided output
rows and value rows, offsets into the probability rows."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from numba import njit

att = importlib.import_module("olv_runtime.kernels.attention")


@njit(cache=False)
def _call(p, c0, ng, v, j0, nt, o, vmult):
    att._accum_rows(p, c0, ng, v, j0, nt, o, vmult)


def _ref(p, c0, ng, v, j0, nt, o, vmult):
    pm = p[:ng, c0:c0 + nt].astype(np.float64) * np.float64(vmult)
    return o[:ng].astype(np.float64) + pm @ v[j0:j0 + nt].astype(np.float64)


@pytest.mark.parametrize("d", [16, 64, 80, 128, 40])
@pytest.mark.parametrize("ng,nt,c0,j0", [(1, 0, 0, 0), (1, 1, 0, 3), (7, 64, 0, 0),
                                          (7, 37, 5, 11), (4, 130, 2, 7), (8, 3, 0, 0)])
@pytest.mark.parametrize("strided", [False, True])
def test_accum_rows_against_float64(d, ng, nt, c0, j0, strided):
    rng = np.random.default_rng(d * 1000 + ng * 100 + nt)
    t = j0 + nt + 2
    p = rng.random((ng, c0 + nt + 16)).astype(np.float32)
    v = rng.standard_normal((t, d)).astype(np.float32)
    o = rng.standard_normal((ng, d)).astype(np.float32)
    if strided:  # output rows and value rows inside wider arrays (rows strided, D contiguous)
        ob = np.zeros((ng, d + 16), np.float32)
        ob[:, :d] = o
        o = ob[:, :d]
        vb = np.zeros((t, d + 32), np.float32)
        vb[:, 8:8 + d] = v
        v = vb[:, 8:8 + d]
    ref = _ref(p, c0, ng, v, j0, nt, o, np.float32(0.5))
    _call(p, c0, ng, v, j0, nt, o, np.float32(0.5))
    scale = (np.abs(p[:, c0:c0 + nt]).astype(np.float64) @ np.abs(v[j0:j0 + nt]).astype(
        np.float64) * 0.5 + np.abs(ref))
    err = np.abs(o - ref)
    assert np.all(err <= 2e-6 * scale + 1e-30), np.max(err / (scale + 1e-30))


@pytest.mark.parametrize("d", [16, 64, 128])
def test_register_path_agrees_with_the_loop(d):
    """The same inputs through both paths: unit strides (register path) and every D element two
    apart (the loop); within float32 rounding of each other."""
    rng = np.random.default_rng(d)
    ng, nt = 7, 130
    p = rng.random((ng, nt + 16)).astype(np.float32)
    v = rng.standard_normal((nt, d)).astype(np.float32)
    o = rng.standard_normal((ng, d)).astype(np.float32)
    v2 = np.zeros((nt, 2 * d), np.float32)
    v2[:, ::2] = v
    o2 = np.zeros((ng, 2 * d), np.float32)
    o2[:, ::2] = o
    fast, loop = o.copy(), o2[:, ::2]
    _call(p, 0, ng, v, 0, nt, fast, np.float32(1.0))
    _call(p, 0, ng, v2[:, ::2], 0, nt, loop, np.float32(1.0))
    scale = p[:, :nt].astype(np.float64) @ np.abs(v).astype(np.float64) + np.abs(o)
    assert not np.array_equal(fast, o)  # both paths wrote
    assert np.all(np.abs(fast - loop) <= 4e-6 * scale)


def test_accum_rows_nonfinite_propagates():
    p = np.ones((2, 32), np.float32)
    v = np.ones((4, 64), np.float32)
    v[2, 5] = np.nan
    v[1, 7] = np.inf
    o = np.zeros((2, 64), np.float32)
    _call(p, 0, 2, v, 0, 4, o, np.float32(1.0))
    assert np.isnan(o[:, 5]).all() and np.isinf(o[:, 7]).all()
    assert np.array_equal(o[:, 0], [4.0, 4.0])
