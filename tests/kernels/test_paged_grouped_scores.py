"""The AVX2 grouped block scores of the paged kernel (:func:`~olv_runtime.kernels.paged_ir._qkg_i8`,
:func:`~olv_runtime.kernels.paged_ir._qkg_f16`): 8 query heads in the lanes of one vector per
load of a key row.

Oracles: INT8 keys against int8 queries -- the per-head integer scores of
:func:`~olv_runtime.kernels.paged_ir._qk16_i8` (the previous AVX2 path), bitwise: the same exact
int32 sums and the same float epilogue; the running max bitwise too. float16 keys against float32
queries -- a float64 dot product of the decoded keys times the scale, rtol 1e-5 (float32
rounding of a 64-term sum in another order). Groups of 1, 7, 8, 9, 14 and 16 heads (one and two
8-lane passes, spare lanes), 1..16 valid rows (the second 8 keys only when more than 8), D 64,
128 and 256.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from olv_runtime.kernels.attention import SLACK
from olv_runtime.kernels.paged_attention import paged_attention
from olv_runtime.kernels.paged_ir import _qk16_i8, _qkg_f16, _qkg_i8


@njit
def _old_i8(qi, qmul, qsum, ng, kaddr, nrows, rb, rmul, sc, off, mx):
    for hh in range(ng):
        bm = _qk16_i8(qi[hh], kaddr, 0, nrows, rb, qsum[hh], qmul[hh], rmul, sc[hh], off, False)
        if bm > mx[hh]:
            mx[hh] = bm


@njit
def _new_i8(qi, qmul, ng, kaddr, nrows, rb, rmul, sc, off, mx):
    _qkg_i8(qi, ng, kaddr, nrows, rb, qmul, rmul, sc, off, mx)


@njit
def _new_f16(q, ng, kaddr, nrows, rb, mult, sc, off, mx):
    _qkg_f16(q, ng, kaddr, nrows, rb, mult, mult, sc, off, mx)


GROUPS = [1, 7, 8, 9, 14, 16]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("ng", GROUPS)
def test_grouped_int8_scores_bitwise_equal_to_per_head(d, ng):
    rng = np.random.default_rng(d * 31 + ng)
    for nrows in (1, 5, 8, 9, 16):
        codes = rng.integers(-128, 128, (16, d)).astype(np.int8)  # -128 too (sealed codes clip)
        qi = rng.integers(-127, 128, (ng, d)).astype(np.int8)
        qi[0, :] = 127  # extreme sums
        codes[0, :] = -128
        qmul = (rng.random(ng) * 0.01).astype(np.float32)
        qsum = qi.astype(np.int32).sum(1).astype(np.int32)
        rmul = np.zeros(32, np.float32)
        rmul[:nrows] = rng.random(nrows).astype(np.float32) * 0.03
        off = 5
        mx0 = rng.standard_normal(ng).astype(np.float32) * 50
        mx0[0] = -np.inf
        sc_old = np.full((ng, 64 + SLACK), np.nan, np.float32)
        sc_new = sc_old.copy()
        mx_old, mx_new = mx0.copy(), mx0.copy()
        _old_i8(qi, qmul, qsum, ng, codes.ctypes.data, nrows, d, rmul, sc_old, off, mx_old)
        _new_i8(qi, qmul, ng, codes.ctypes.data, nrows, d, rmul, sc_new, off, mx_new)
        np.testing.assert_array_equal(sc_new[:, off:off + nrows], sc_old[:, off:off + nrows])
        np.testing.assert_array_equal(mx_new, mx_old)
        assert np.isnan(sc_new[:, :off]).all()  # nothing written before ``off``


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("ng", GROUPS)
def test_grouped_f16_scores_against_float64(d, ng):
    rng = np.random.default_rng(d * 17 + ng)
    for nrows in (1, 7, 8, 12, 16):
        keys = rng.standard_normal((16, d)).astype(np.float16)
        q = rng.standard_normal((ng, d)).astype(np.float32)
        mult = np.zeros(32, np.float32)
        mult[0] = 0.125
        sc = np.full((ng, 64 + SLACK), np.nan, np.float32)
        mx = np.full(ng, -np.inf, np.float32)
        _new_f16(q, ng, keys.ctypes.data, nrows, 2 * d, mult, sc, 3, mx)
        ref = q.astype(np.float64) @ keys[:nrows].astype(np.float64).T * 0.125
        np.testing.assert_allclose(sc[:, 3:3 + nrows], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(mx, sc[:, 3:3 + nrows].max(1))


def _f16_cache(ctx, kvh, d, seed):
    rng = np.random.default_rng(seed)
    nb = (ctx + 15) // 16
    kc = rng.standard_normal((nb, kvh, 16, d)).astype(np.float16)
    vc = rng.standard_normal((nb, kvh, 16, d)).astype(np.float16)
    rows = np.array([(1, kc[b].ctypes.data, 0, 0, 1, vc[b].ctypes.data, 0, 0, 16 * b,
                      min(16, ctx - 16 * b)) for b in range(nb)], np.int64)
    keys = kc.transpose(1, 0, 2, 3).reshape(kvh, nb * 16, d)[:, :ctx]
    vals = vc.transpose(1, 0, 2, 3).reshape(kvh, nb * 16, d)[:, :ctx]
    return rows, (kc, vc), keys, vals


@pytest.mark.parametrize("ctx,kvh,h,d", [(1000, 2, 14, 64), (77, 1, 9, 128), (300, 2, 2, 64)])
def test_paged_f16_attention_against_float64(ctx, kvh, h, d):
    rows, keep, keys, vals = _f16_cache(ctx, kvh, d, ctx + h)
    q = np.random.default_rng(h).standard_normal((1, h, d)).astype(np.float32) * 2
    out = np.empty_like(q)
    paged_attention(q, rows, rows.shape[0], ctx - 1, 0.125, True, kvh, 16, out)
    grp = h // kvh
    for hh in range(h):
        sc = keys[hh // grp].astype(np.float64) @ q[0, hh].astype(np.float64) * 0.125
        p = np.exp(sc - sc.max())
        ref = (p / p.sum()) @ vals[hh // grp].astype(np.float64)
        np.testing.assert_allclose(out[0, hh], ref, rtol=1e-5, atol=1e-6)
    del keep
