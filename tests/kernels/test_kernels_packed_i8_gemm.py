"""Tests of olv_runtime.kernels.packed_i8_gemm (the register-blocked GEMM of prefill: VNNI zmm
tiles of 8 activation rows, AVX2 ymm tiles of 4).

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
        pytest.skip("no AVX-512 VNNI on this CPU: the zmm tile is never used (the AVX2 tile is "
                    "tested above)")
    from numba import njit

    from olv_runtime.kernels import packed_i8_gemm

    fresh = njit(packed_i8_gemm._pairs_tiles.py_func)  # cached code cannot be inspected
    codes = np.zeros((2, 1, 128), np.uint8)
    scale = np.zeros((2, 1, 8), np.uint16)
    xq = np.zeros((8, 32), np.int8)
    xd = np.zeros((8, 1), np.float32)
    xs8 = np.zeros((8, 1), np.int32)
    out = np.full((8, 16), 1.0, np.float32)
    fresh(codes, scale, 0, 2, xq, xd, xs8, 0, 8, 16, out)
    np.testing.assert_array_equal(out, 0.0)
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert "vpdpbusd" in asm and "zmm" in asm


AVX2_CASES = [(64, 512, 4), (90, 1000, 5), (136, 1000, 7), (1152, 96, 8), (48, 4864, 13),
              (24, 64, 6)]


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,k,m", AVX2_CASES)
def test_avx2_tile_gemm_bitwise_equals_group_kernels_and_model(n, k, m, scale_dtype):
    """The AVX2 tile (4 activation rows x 2 groups) from 4 rows on: bitwise the one-group
    kernels of packed_i8 (linear_ser: 4/2/1 rows per decoded group) and the numpy model."""
    from olv_runtime.kernels import packed_i8_gemm

    kp = 32 * -(-k // 32)
    rng = np.random.default_rng(n + 3 * k + 17 * m)
    q, payload, scale = _weight(n, k, rng)
    scale = scale.astype(scale_dtype)
    p = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, size=(m, 1))).astype(np.float32)
    y = _run(x, p, "avx2")
    ws = packed_i8.make_workspace_i8(m, k, 1)
    groups = np.empty((m, n), np.float32)
    packed_i8.linear_ser(x, m, k, p.codes, p.scale, n, groups, ws.xq, ws.xd, ws.xs8, ws.facc[0],
                         False)
    np.testing.assert_array_equal(y, groups)
    np.testing.assert_array_equal(y, _model(x, q, scale.astype(np.float32)))
    if m * n * kp >= SERIAL_MAX_WORK:  # linear_packed_i8 took the tile GEMM
        assert m >= packed_i8_gemm.min_rows(False)
    # groups_tiles over a range starting at an odd group (pairs (1, 2), (3, 4), ...), as the
    # engine's claimed chunks do: the same outputs
    tiles = groups.copy()
    tiles[:, 8:] = 0.0
    packed_i8_gemm.groups_tiles(p.codes, p.scale, np.int64(1), p.n_groups, ws.xq, ws.xd, ws.xs8,
                                m, n, tiles, ws.facc[0], False)
    np.testing.assert_array_equal(tiles, groups)


def test_avx2_tile_shares_each_broadcast_between_two_groups():
    """The AVX2 tile's point: one vpbroadcastd of 4 activation bytes feeds two vpmaddubsw (one
    per group), where the one-group kernels use one per vpmaddubsw."""
    from numba import njit

    from olv_runtime.kernels import packed_i8_gemm

    fresh = njit(packed_i8_gemm._pair_tiles2.py_func)  # cached code cannot be inspected
    codes = np.zeros((2, 1, 128), np.uint8)
    scale = np.zeros((2, 1, 8), np.uint16)
    xq = np.zeros((4, 32), np.int8)
    xd = np.zeros((4, 1), np.float32)
    xs8 = np.zeros((4, 1), np.int32)
    out = np.full((4, 16), 1.0, np.float32)
    facc = np.zeros((1, 8), np.float32)
    fresh(codes, scale, 0, xq, xd, xs8, 0, 4, 16, out, facc)
    np.testing.assert_array_equal(out, 0.0)
    asm = fresh.inspect_asm(fresh.signatures[0])
    maddubs = asm.count("vpmaddubsw")
    bcast = asm.count("vpbroadcastd")
    assert maddubs == 4 * 2 * 8  # per block: 4 rows x 2 groups x 8 (chunk, nibble) pairs
    # 32 activation broadcasts per block (one per two vpmaddubsw) + each row's sum(xq) splat
    assert bcast <= maddubs // 2 + 4, (bcast, maddubs)


VNNI_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 21, 24]


@pytest.mark.parametrize("vnni", [False] + ([True] if packed_i8.HOST_VNNI else []))
@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n,k", [(136, 96), (200, 64), (20, 160), (16, 32), (40, 2112)])
def test_groups_tiles_bitwise_equals_group_kernels(n, k, scale_dtype, vnni):
    """The engine's rows-step GEMM on every path the host has (VNNI: 16 x 8 tiles per group
    pair, the rest of the rows by 16 x 4 / 2 / 1 tiles or the one-group kernels; AVX2: 8 x 4
    tiles, the rest by the one-group kernels): bitwise packed_i8.groups (4/2/1 rows per group)
    for every row count, over group ranges starting at an even or odd group, odd group counts
    and a partial last pair (n not a multiple of 16); K = 2112 (groups longer than
    PAIR_STREAM_BYTES: 1..3 rows by the one-group kernels on VNNI)."""
    from olv_runtime.kernels import packed_i8_gemm

    rng = np.random.default_rng(n + k)
    _, payload, scale = _weight(n, k, rng)
    p = prepack_int4_i8(payload, scale.astype(scale_dtype), None, n, k, 32)
    mmax = max(VNNI_ROWS)
    x = (rng.standard_normal((mmax, k)) * rng.uniform(0.1, 10, size=(mmax, 1))).astype(
        np.float32)
    ws = packed_i8.make_workspace_i8(mmax, k, 1)
    packed_i8.quantize_rows_i8(x, mmax, k, k // 32, ws.xq, ws.xd, ws.xs8)
    ng = p.n_groups
    for m in VNNI_ROWS:
        ref = np.full((m, n), np.nan, np.float32)
        packed_i8.groups(p.codes, p.scale, np.int64(0), ng, ws.xq, ws.xd, ws.xs8, m, n, ref,
                         ws.facc[0], vnni)
        for g0, g1 in ((0, ng), (1, ng), (0, ng - 1), (1, ng - 1)):
            if g1 <= g0:
                continue
            y = np.full((m, n), np.nan, np.float32)
            packed_i8_gemm.groups_tiles(p.codes, p.scale, np.int64(g0), np.int64(g1), ws.xq,
                                        ws.xd, ws.xs8, m, n, y, ws.facc[0], vnni)
            c0, c1 = 8 * g0, min(n, 8 * g1)
            np.testing.assert_array_equal(y[:, c0:c1], ref[:, c0:c1], err_msg=f"m={m} g={g0},{g1}")
            assert np.isnan(y[:, :c0]).all() and np.isnan(y[:, c1:]).all()  # nothing else written
