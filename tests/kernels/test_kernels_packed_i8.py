"""Tests of olv_runtime.kernels.packed_i8 (int8-dot INT4 linear with explicit AVX2 intrinsics).

Oracle: tests/reference.py's numpy model of the same activation quantization and block math
(``linear_int4_int8``, independent of the numba code), bitwise.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import get_num_threads, set_num_threads
from olv_runtime.kernels.ggml_packed import GGMLPacked
from olv_runtime.kernels.packed_i8 import (
    GROUP_ROWS, PackedI8Workspace, PackedInt4I8, make_workspace_i8, prepack_int4_i8,
)
from olv_runtime.kernels.packed_i8_gemm import linear_packed_i8


def _weight(n, k, rng, q=None):
    """Random symmetric INT4 weight: signed codes q [n, k], payload (row-major, low nibble
    first), scale [n, ceil(k/32)]."""
    if q is None:
        q = rng.integers(-8, 8, size=(n, k))
    payload, scale, _ = reference.int4_weight(q, rng)
    return q, payload, scale


#: numpy model: int8 per-32-block activation quantization (d = max|x|/127, rint, half to even),
#: exact integer block sums, y = sum_b float32(S_b) * (scale_b * d_b) in block order
_model = reference.linear_int4_int8


def _other_packed(n, k):
    """A packed weight of another format (ggml Q8_0 records) of the same [n, k]."""
    return GGMLPacked(8, np.zeros((-(-n // 8), k // 32, 272), np.uint8), n, k)


SHAPES = [(8, 32), (64, 64), (100, 40), (70, 80), (13, 33), (1, 32), (3, 7), (200, 256),
          (130, 100), (24, 1000)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9])
def test_matches_numpy_model(n, k, m):
    rng = np.random.default_rng(n * 1000 + k * 10 + m)
    q, payload, scale = _weight(n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    pk8 = prepack_int4_i8(payload, scale, None, n, k, 32)
    y = linear_packed_i8(x, pk8)
    assert y.shape == (m, n) and y.dtype == np.float32
    ref = _model(x, q, scale)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    # integer sums are exact and the float ops per block are the same: bitwise equal
    np.testing.assert_array_equal(y, ref)


@pytest.mark.parametrize("m", [1, 4, 6])
def test_qwen_shape_parallel_matches(m):
    n, k = 1152, 896
    rng = np.random.default_rng(7 + m)
    q, payload, scale = _weight(n, k, rng)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    y = linear_packed_i8(x, prepack_int4_i8(payload, scale, None, n, k, 32))
    ref = _model(x, q, scale)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    np.testing.assert_array_equal(y, ref)


def test_int16_worst_case_no_overflow():
    """All codes +7 (u = 15) or -8 (u = 0) against xq = +-127: the int16 block partial sums reach
    16*15*127 = 30480 and the exact block sums +-8*127*32."""
    rng = np.random.default_rng(3)
    n, k = 16, 96
    q = np.full((n, k), 7, np.int64)
    q[8:] = -8
    q[4, :] = np.where(np.arange(k) % 2, 7, -8)
    _, payload, scale = _weight(n, k, rng, q=q)
    x = np.ones((3, k), np.float32)
    x[1] = -1.0
    x[2, ::2] = -2.0
    pk8 = prepack_int4_i8(payload, scale, None, n, k, 32)
    y = linear_packed_i8(x, pk8)
    np.testing.assert_array_equal(y, _model(x, q, scale))
    s = scale.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(y[0, :4], 7 * 127 * 32 * s[:4] / 127, rtol=1e-6)


def test_zero_and_tiny_blocks():
    rng = np.random.default_rng(5)
    n, k = 40, 100
    q, payload, scale = _weight(n, k, rng)
    x = rng.standard_normal((2, k)).astype(np.float32)
    x[0, :32] = 0.0           # amax = 0 block
    x[1, 32:64] = 1e-30       # subnormal-ish scale
    x[1, 96:] = 0.0           # partial last block all zero
    y = linear_packed_i8(x, prepack_int4_i8(payload, scale, None, n, k, 32))
    np.testing.assert_array_equal(y, _model(x, q, scale))
    assert np.all(np.isfinite(y))


def test_layout():
    rng = np.random.default_rng(11)
    n, k = 11, 70
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    ng, kb = 2, 3
    assert isinstance(pk, PackedInt4I8)
    assert pk.codes.shape == (ng, kb, 128) and pk.codes.dtype == np.uint8
    assert pk.scale.shape == (ng, kb, GROUP_ROWS) and pk.scale.dtype == np.float32
    assert pk.codes.ctypes.data % 64 == 0 and pk.scale.ctypes.data % 64 == 0
    assert pk.nbytes == pk.codes.nbytes + pk.scale.nbytes
    u = np.full((ng * 8, kb * 32), 8, np.int64)
    u[:n, :k] = q + 8
    for g in range(ng):
        for b in range(kb):
            for c in range(4):
                for r in range(8):
                    for j in range(4):
                        row, kk = 8 * g + r, 32 * b + 4 * c + j
                        assert pk.codes[g, b, 32 * c + 4 * r + j] == u[row, kk] | (u[row, kk + 16] << 4)
    np.testing.assert_array_equal(pk.scale[0, :, :].T, scale[:8])
    np.testing.assert_array_equal(pk.scale[1, :, :3].T, scale[8:])
    assert np.all(pk.scale[1, :, 3:] == 0)


def test_out_and_workspace_reuse():
    rng = np.random.default_rng(2)
    n, k = 300, 200
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    ws = make_workspace_i8(8, 1000, n_tasks=4)
    assert isinstance(ws, PackedI8Workspace) and ws.nbytes > 0
    for m in (1, 4, 8, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)
        r = linear_packed_i8(x, pk, out=out, workspace=ws)
        assert r is out
        np.testing.assert_array_equal(out, linear_packed_i8(x, pk))
        np.testing.assert_array_equal(out, _model(x, q, scale))


def test_rows_independent_of_m_and_threads():
    rng = np.random.default_rng(9)
    n, k = 4864 // 4, 896
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((7, k)).astype(np.float32)
    y = linear_packed_i8(x, pk)
    for i in range(7):
        np.testing.assert_array_equal(linear_packed_i8(x[i:i + 1].copy(), pk)[0], y[i])
    nt = get_num_threads()
    try:
        set_num_threads(1)
        np.testing.assert_array_equal(linear_packed_i8(x, pk), y)
    finally:
        set_num_threads(nt)


def test_invalid_arguments():
    rng = np.random.default_rng(1)
    n, k = 16, 64
    q, payload, scale = _weight(n, k, rng)
    zp = np.zeros((n, 2), np.int8)
    with pytest.raises(InvalidArgument, match="zero_point"):
        prepack_int4_i8(payload, scale, zp, n, k, 32)
    with pytest.raises(InvalidArgument, match="block_size"):
        prepack_int4_i8(payload, scale, None, n, k, 64)
    with pytest.raises(InvalidArgument, match="payload"):
        prepack_int4_i8(payload[:-1], scale, None, n, k, 32)
    with pytest.raises(InvalidArgument, match="scale"):
        prepack_int4_i8(payload, scale.astype(np.float64), None, n, k, 32)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    with pytest.raises(InvalidArgument, match="x"):
        linear_packed_i8(x[:, :-1].copy(), pk)
    with pytest.raises(InvalidArgument, match="x"):
        linear_packed_i8(x.astype(np.float64), pk)
    with pytest.raises(InvalidArgument, match="packed"):
        linear_packed_i8(x, _other_packed(n, k))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed_i8(x, pk, workspace=make_workspace_i8(1, k))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed_i8(x, pk, workspace=make_workspace_i8(2, 32))
    with pytest.raises(InvalidArgument, match="out"):
        linear_packed_i8(x, pk, out=np.empty((2, n + 1), np.float32))
    assert linear_packed_i8(np.empty((0, k), np.float32), pk).shape == (0, n)


@pytest.mark.parametrize("exact", [False, True])
def test_all_arguments_given_still_checked(exact):
    """With out and workspace given the wrappers take a fast path (fast_call_rows); every
    argument it does not accept goes through the full checks, which raise as before, and an
    accepted call gives the bytes of the fully checked one (out=None, workspace=None)."""
    from olv_runtime.kernels.packed_f32 import linear_packed_i8_exact, make_workspace_f32

    fn, mkws = ((linear_packed_i8_exact, make_workspace_f32) if exact
                else (linear_packed_i8, make_workspace_i8))
    other_ws = make_workspace_i8 if exact else make_workspace_f32
    rng = np.random.default_rng(5)
    n, k = 24, 96
    _, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    ws = mkws(2, k)
    out = np.empty((2, n), np.float32)
    np.testing.assert_array_equal(fn(x, pk, out, workspace=ws), fn(x, pk))
    ro = np.empty((2, n), np.float32)
    ro.flags.writeable = False
    wide = np.empty((2, 2 * k), np.float32)
    cases = [
        ("x", dict(x=x.astype(np.float64))),
        ("x", dict(x=wide[:, ::2])),                       # not C-contiguous
        ("x", dict(x=x[:, :-1].copy())),
        ("x", dict(x=x.astype(">f4"))),                     # non-native byte order
        ("out", dict(out=ro)),
        ("out", dict(out=np.empty((2, 2 * n), np.float32)[:, ::2])),
        ("out", dict(out=np.empty((2, n), np.float64))),
        ("out", dict(out=np.empty((3, n), np.float32))),
        ("workspace", dict(workspace=mkws(1, k))),
        ("workspace", dict(workspace=mkws(2, k - 32))),
        ("workspace", dict(workspace=other_ws(2, k))),
        ("packed", dict(packed=_other_packed(n, k))),
    ]
    for name, kw in cases:
        args = dict(x=x, packed=pk, out=out, workspace=ws)
        args.update(kw)
        with pytest.raises(InvalidArgument, match=name):
            fn(args["x"], args["packed"], args["out"], workspace=args["workspace"])


def test_wide_dynamic_range_activations():
    """Vectorised full-block quantization = the scalar one (values over 1e-40 .. 1e6, ties)."""
    rng = np.random.default_rng(13)
    n, k, m = 72, 160, 5
    q, payload, scale = _weight(n, k, rng)
    x = (rng.standard_normal((m, k)) * 10.0 ** rng.integers(-6, 7, (m, k))).astype(np.float32)
    x[1, 32:64] = 1e-40
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5   # halves: round half to even
    x[3, 64:96] = -3.0
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    y = linear_packed_i8(x, pk)
    np.testing.assert_array_equal(y, _model(x, q, scale))


@pytest.mark.parametrize("n,k,m", [(8, 32, 1), (100, 40, 3), (24, 1000, 5), (130, 100, 9)])
def test_float16_scales_stay_float16_and_equal_the_widened_float32(n, k, m):
    """float16 block scales (the converter default) are kept as their bits in the packed layout
    (half the scale bytes) and give bitwise the results of the same scales widened to float32,
    in both activation modes; the int8 mode also matches the numpy model."""
    from olv_runtime.kernels.packed_f32 import linear_packed_i8_exact

    rng = np.random.default_rng(n + k + m)
    q, payload, scale = _weight(n, k, rng)
    s16 = scale.astype(np.float16)
    s32 = s16.astype(np.float32)  # exact widening
    p16 = prepack_int4_i8(payload, s16, None, n, k, 32)
    p32 = prepack_int4_i8(payload, s32, None, n, k, 32)
    assert p16.scale.dtype == np.uint16 and p32.scale.dtype == np.float32
    assert p16.nbytes == p32.nbytes - p16.scale.nbytes
    x = rng.standard_normal((m, k)).astype(np.float32)
    y16 = linear_packed_i8(x, p16)
    np.testing.assert_array_equal(y16, linear_packed_i8(x, p32))
    np.testing.assert_array_equal(y16, _model(x, q, s32))
    np.testing.assert_array_equal(linear_packed_i8_exact(x, p16), linear_packed_i8_exact(x, p32))


@pytest.mark.parametrize("n,k,m", [(8, 32, 1), (130, 100, 3), (200, 256, 4), (24, 1000, 7),
                                   (130, 100, 1), (200, 4864, 1), (4864, 896, 1)])
def test_vnni_and_avx2_paths_bitwise_equal(n, k, m):
    """The int8 dot products are chosen at run time from the CPU's features (isa()); forcing the
    AVX2 fallback gives bitwise the results of the VNNI path (both exact integer sums) and of the
    numpy model."""
    from olv_runtime.kernels import packed_i8

    rng = np.random.default_rng(n * k + m)
    q, payload, scale = _weight(n, k, rng)
    p = prepack_int4_i8(payload, scale.astype(np.float16), None, n, k, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    try:
        packed_i8.set_isa("avx2")
        assert packed_i8.isa() == "avx2"
        y_avx2 = linear_packed_i8(x, p)
        packed_i8.set_isa(None)
        y_auto = linear_packed_i8(x, p)
    finally:
        packed_i8.set_isa(None)
    np.testing.assert_array_equal(y_avx2, y_auto)
    np.testing.assert_array_equal(y_avx2, _model(x, q, scale.astype(np.float16).astype(np.float32)))
    assert packed_i8.isa() == ("avx512vnni" if packed_i8.HOST_VNNI else "avx2")


def test_isa_selection_and_errors():
    from olv_runtime.kernels import packed_i8

    with pytest.raises(InvalidArgument, match="isa: expected None, 'avx2' or 'avx512vnni'"):
        packed_i8.set_isa("sse2")
    if not packed_i8.HOST_VNNI:
        with pytest.raises(InvalidArgument, match="no AVX-512 VNNI"):
            packed_i8.set_isa("avx512vnni")


def test_vnni_instruction_is_emitted_where_the_cpu_has_it():
    from numba import njit

    from olv_runtime.kernels import packed_i8

    fresh = njit(packed_i8.group_r1.py_func)  # cached code cannot be inspected
    codes = np.zeros((1, 1, 128), np.uint8)
    scale = np.zeros((1, 1, 8), np.float32)
    xq = np.zeros((1, 32), np.int8)
    xd = np.zeros((1, 1), np.float32)
    xs8 = np.zeros((1, 1), np.int32)
    out = np.zeros((1, 8), np.float32)
    fresh(codes, scale, 0, xq, xd, xs8, 0, 8, out, np.zeros((1, 8), np.float32), True)
    asm = fresh.inspect_asm(fresh.signatures[0])
    assert "vpmaddubsw" in asm  # the AVX2 path is always compiled
    assert ("vpdpbusd" in asm) == packed_i8.HOST_VNNI


@pytest.mark.parametrize("n,k", [(13, 33), (200, 256), (70, 80)])
def test_prepack_serial_and_parallel_drivers_bitwise_equal(n, k, monkeypatch):
    """Small weights are repacked by the serial driver (no parallel region, and a model of only
    small weights never compiles the parallel one); forcing the parallel driver gives the same
    bytes."""
    from olv_runtime.kernels import packed_i8

    rng = np.random.default_rng(n * 1000 + k)
    _, payload, scale = _weight(n, k, rng)
    assert n * k < packed_i8.PREPACK_SERIAL_MAX
    ser = prepack_int4_i8(payload, scale, None, n, k, 32)
    monkeypatch.setattr(packed_i8, "PREPACK_SERIAL_MAX", 0)
    par = prepack_int4_i8(payload, scale, None, n, k, 32)
    np.testing.assert_array_equal(ser.codes, par.codes)
    np.testing.assert_array_equal(ser.scale, par.scale)
