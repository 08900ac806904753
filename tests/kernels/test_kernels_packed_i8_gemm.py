"""Tests of olv_runtime.kernels.packed_i8_gemm (the register-blocked VNNI GEMM of prefill).

Oracles: the numpy model of tests/reference.py (``linear_int4_int8``: same activation quantization, exact
integer block sums, block float math in order) and the AVX2 fallback forced with set_isa: all
three bitwise equal (integer sums are exact; the float operations per row and block are the
same). Shapes cover odd group counts (an unpaired last group), a partly filled last group pair
(masked store), K not a multiple of 32, and M % 8 != 0 (rows left to the 4/2/1-row kernels).
"""
from __future__ import annotations

import numpy as np
import pytest

from olv_runtime.kernels import get_num_threads, packed_i8, set_num_threads
from olv_runtime.kernels.packed_i8 import SERIAL_MAX_WORK, prepack_int4_i8
from olv_runtime.kernels.packed_i8_gemm import linear_packed_i8

from reference import linear_int4_int8 as _model
from test_kernels_packed_i8 import _weight

CASES = [(64, 512, 8), (90, 1000, 40), (136, 1000, 23), (100, 256, 17), (1152, 96, 9),
         (48, 4864, 12)]


def _run(x, p, isa):
    try:
        packed_i8.set_isa(isa)
        return linear_packed_i8(x, p)
    finally:
        packed_i8.set_isa(None)


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,k,m", CASES)
def test_tile_gemm_bitwise_equals_model_and_avx2(n, k, m, scale_dtype):
    kp = 32 * -(-k // 32)
    assert m >= 8 and m * n * kp >= SERIAL_MAX_WORK  # the tile GEMM's domain
    rng = np.random.default_rng(n + 7 * k + 131 * m)
    q, payload, scale = _weight(n, k, rng)
    scale = scale.astype(scale_dtype)
    p = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, size=(m, 1))).astype(np.float32)
    y = _run(x, p, None)
    ref = _model(x, q, scale.astype(np.float32))
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()  # the stated tolerance ...
    np.testing.assert_array_equal(y, ref)                    # ... and in fact bitwise
    np.testing.assert_array_equal(y, _run(x, p, "avx2"))     # the fallback path, forced


def test_rows_independent_of_m_and_threads():
    n, k = 272, 640
    rng = np.random.default_rng(5)
    _, payload, scale = _weight(n, k, rng)
    p = prepack_int4_i8(payload, scale.astype(np.float16), None, n, k, 32)
    x = rng.standard_normal((37, k)).astype(np.float32)
    y = linear_packed_i8(x, p)
    np.testing.assert_array_equal(linear_packed_i8(x[:9], p), y[:9])
    np.testing.assert_array_equal(linear_packed_i8(x[5:21], p), y[5:21])
    nt = get_num_threads()
    try:
        set_num_threads(1)
        np.testing.assert_array_equal(linear_packed_i8(x, p), y)
    finally:
        set_num_threads(nt)


def test_tile_kernel_emits_zmm_vpdpbusd_where_the_cpu_has_it():
    if not packed_i8.HOST_VNNI:
        pytest.skip("no AVX-512 VNNI on this CPU: the tile GEMM is never used (AVX2 fallback "
                    "tested above)")
    from numba import njit

    from olv_runtime.kernels import packed_i8_gemm

    fresh = njit(packed_i8_gemm._pair_tile.py_func)  # cached code cannot be inspected
    codes = np.zeros((2, 1, 128), np.uint8)
    scale = np.zeros((2, 1, 8), np.uint16)
    xq = np.zeros((8, 32), np.int8)
    xd = np.zeros((8, 1), np.float32)
    xs8 = np.zeros((8, 1), np.int32)
    out = np.full((8, 16), 1.0, np.float32)
    fresh(codes, scale, 0, xq, xd, xs8, 0, 16, out)
    np.testing.assert_array_equal(out, 0.0)
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert "vpdpbusd" in asm and "zmm" in asm
