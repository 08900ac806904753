"""Tests of olv_runtime.kernels.packed_f32 (exact-mode INT4 linear on the packed_i8 layout).

Oracles: float64 ``x @ W.T`` of the dequantized weight (bound
``1e-5 * sum_k |x_k W_nk| + 1e-6``, the bound of the existing exact path, plus on the VNNI path
(olv_runtime.kernels.packed_f32_vnni, 31-bit block fixed-point activations) the fixed-point term
``2^-30 * sum_b max_{k in b}|x_k| * sum_{k in b}|W_nk|``); the int8 mode on the same packed
copy: tests/reference.py's ``linear_int4_int8`` (bitwise). Every test runs on
the instruction path the CPU chooses; ``isa`` parametrised tests also force the float fallback.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import reference
from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import get_num_threads, set_num_threads
from olv_runtime.kernels.ggml_packed import GGMLPacked
from olv_runtime.kernels.packed_f32 import (
    PackedF32Workspace, linear_packed_i8_exact, make_workspace_f32,
)
from olv_runtime.kernels.packed_i8 import HOST_VNNI, prepack_int4_i8, set_isa, use_vnni
from olv_runtime.kernels.packed_i8_gemm import linear_packed_i8

ISAS = ["avx2", "avx512vnni"] if HOST_VNNI else ["avx2"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test on each instruction path this CPU has (the float fallback forced)."""
    set_isa(request.param)
    try:
        yield request.param
    finally:
        set_isa(None)


def _weight(n, k, rng, q=None):
    """Random symmetric INT4 weight: signed codes q [n, k], payload (row-major, low nibble
    first), scale [n, ceil(k/32)]."""
    if q is None:
        q = rng.integers(-8, 8, size=(n, k))
    payload, scale, _ = reference.int4_weight(q, rng)
    return q, payload, scale


def _dequant64(q, scale):
    k = q.shape[1]
    return q.astype(np.float64) * np.repeat(scale.astype(np.float64), 32, axis=1)[:, :k]


_fixed_point_term = reference.fixed_point_term


def _bound(x64, w64, fixed_point=None):
    """The stated bound of the path in use (``fixed_point``: the VNNI term; default: whether
    the VNNI path is the one running)."""
    if fixed_point is None:
        fixed_point = use_vnni()
    b = 1e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-6
    if fixed_point:
        b = b + _fixed_point_term(x64, w64)
    return b


def _check_bound(y, x, w64, what="", fixed_point=None):
    x64 = x.astype(np.float64)
    ref = x64 @ w64.T
    bound = _bound(x64, w64, fixed_point)
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= bound), f"{what}: max err/bound {np.max(err / bound):.3g}"


SHAPES = [(8, 32), (64, 64), (100, 40), (70, 80), (13, 33), (1, 32), (3, 7), (200, 256),
          (130, 100), (24, 1000), (40, 160)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 13, 17])
def test_matches_float64(n, k, m, isa):
    rng = np.random.default_rng(n * 1000 + k * 10 + m)
    q, payload, scale = _weight(n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    pk8 = prepack_int4_i8(payload, scale, None, n, k, 32)
    y = linear_packed_i8_exact(x, pk8)
    assert y.shape == (m, n) and y.dtype == np.float32
    w64 = _dequant64(q, scale)
    _check_bound(y, x, w64, "vs float64")


@pytest.mark.parametrize("n,k", [(4864 // 4, 896), (160, 4864), (1152, 896)])
@pytest.mark.parametrize("m", [1, 4, 6, 16, 33])
def test_qwen_shapes_parallel(n, k, m, isa):
    rng = np.random.default_rng(7 + m + n)
    q, payload, scale = _weight(n, k, rng)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    y = linear_packed_i8_exact(x, prepack_int4_i8(payload, scale, None, n, k, 32))
    w64 = _dequant64(q, scale)
    _check_bound(y, x, w64)


def test_decode_exact_every_code(isa):
    """One-hot activations pick single weights: y[i, n] = float32(q[n, i]) * scale[n, i // 32]
    bitwise (one exact product per block, fma(s, scale, 0)), for every code -8..7 at every
    nibble position of the layout."""
    rng = np.random.default_rng(4)
    n, k = 24, 96
    q = (np.arange(n * k).reshape(n, k) * 7 + np.arange(n)[:, None]) % 16 - 8
    _, payload, scale = _weight(n, k, rng, q=q)
    pk8 = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = np.eye(k, dtype=np.float32)
    y = linear_packed_i8_exact(x, pk8)
    w32 = q.astype(np.float32) * np.repeat(scale, 32, axis=1)[:, :k]
    np.testing.assert_array_equal(y, w32.T)
    # extreme codes against large activations
    q2 = np.full((16, 64), 7)
    q2[8:] = -8
    _, payload2, scale2 = _weight(16, 64, rng, q=q2)
    x2 = np.full((2, 64), 1000.0, np.float32)
    x2[1, ::2] = -1000.0
    y2 = linear_packed_i8_exact(x2, prepack_int4_i8(payload2, scale2, None, 16, 64, 32))
    _check_bound(y2, x2, _dequant64(q2, scale2))


def test_zero_tiny_and_special_activations(isa):
    rng = np.random.default_rng(5)
    n, k = 40, 100
    q, payload, scale = _weight(n, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = 1e-30
    x[1, 96:] = 0.0
    x[2, 5] = 3e30
    y = linear_packed_i8_exact(x, prepack_int4_i8(payload, scale, None, n, k, 32))
    assert np.all(np.isfinite(y))
    _check_bound(y, x, _dequant64(q, scale))
    x[0, 3] = np.nan
    y = linear_packed_i8_exact(x, prepack_int4_i8(payload, scale, None, n, k, 32))
    assert np.all(np.isnan(y[0])) and np.all(np.isfinite(y[1:]))


def test_one_packed_copy_serves_both_modes():
    rng = np.random.default_rng(8)
    n, k = 96, 200
    q, payload, scale = _weight(n, k, rng)
    pk8 = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    ye = linear_packed_i8_exact(x, pk8)
    yq = linear_packed_i8(x, pk8)
    np.testing.assert_array_equal(yq, reference.linear_int4_int8(x, q, scale))
    _check_bound(ye, x, _dequant64(q, scale))
    assert np.abs(yq - ye).max() <= 0.02 * np.abs(ye).max()


def test_out_and_workspace_reuse(isa):
    rng = np.random.default_rng(2)
    n, k = 300, 200
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    ws = make_workspace_f32(20, 1000, n_tasks=4)
    assert isinstance(ws, PackedF32Workspace) and ws.nbytes > 0
    for m in (1, 4, 8, 3, 20):
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.full((m, n), np.nan, np.float32)
        r = linear_packed_i8_exact(x, pk, out=out, workspace=ws)
        assert r is out
        np.testing.assert_array_equal(out, linear_packed_i8_exact(x, pk))
        _check_bound(out, x, _dequant64(q, scale))


@pytest.mark.parametrize("n,k,m", [(300, 200, 3), (1152, 896, 1), (1152, 896, 9)])
def test_no_allocations_with_out_and_workspace(n, k, m, isa):
    rng = np.random.default_rng(12)
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    ws = make_workspace_f32(m, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = np.empty((m, n), np.float32)
    linear_packed_i8_exact(x, pk, out=out, workspace=ws)  # compile / warm up
    tracemalloc.start()
    try:
        linear_packed_i8_exact(x, pk, out=out, workspace=ws)
        snap0 = tracemalloc.take_snapshot()
        for _ in range(3):
            linear_packed_i8_exact(x, pk, out=out, workspace=ws)
        _, peak = tracemalloc.get_traced_memory()
        snap1 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename") if s.size_diff > 0)
    assert grown < 1024
    assert peak < 2048  # no array data allocated during the calls (out alone is >= 3.6 KB)


def test_rows_independent_of_m_and_threads(isa):
    rng = np.random.default_rng(9)
    n, k = 4864 // 4, 896
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((23, k)).astype(np.float32)
    y = linear_packed_i8_exact(x, pk)
    for i in range(23):
        np.testing.assert_array_equal(linear_packed_i8_exact(x[i:i + 1].copy(), pk)[0], y[i])
    for a, b in ((0, 4), (3, 5), (8, 23), (1, 17)):
        np.testing.assert_array_equal(linear_packed_i8_exact(x[a:b].copy(), pk), y[a:b])
    nt = get_num_threads()
    try:
        set_num_threads(1)
        np.testing.assert_array_equal(linear_packed_i8_exact(x, pk), y)
    finally:
        set_num_threads(nt)


def test_invalid_arguments():
    rng = np.random.default_rng(1)
    n, k = 16, 64
    q, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    with pytest.raises(InvalidArgument, match="packed"):
        linear_packed_i8_exact(x, GGMLPacked(8, np.zeros((2, 2, 272), np.uint8), n, k))
    with pytest.raises(InvalidArgument, match="x"):
        linear_packed_i8_exact(x[:, :-1].copy(), pk)
    with pytest.raises(InvalidArgument, match="x"):
        linear_packed_i8_exact(x.astype(np.float64), pk)
    with pytest.raises(InvalidArgument, match="out"):
        linear_packed_i8_exact(x, pk, out=np.empty((2, n + 1), np.float32))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed_i8_exact(x, pk, workspace=make_workspace_f32(1, k))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed_i8_exact(x, pk, workspace=make_workspace_f32(2, k - 32))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed_i8_exact(x, pk, workspace=object())
    assert linear_packed_i8_exact(np.empty((0, k), np.float32), pk).shape == (0, n)


@pytest.mark.parametrize("n,k", [(8, 32), (100, 96), (13, 160), (64, 416)])
def test_one_row_group_kernel_bitwise_equals_groups_small(n, k):
    """The compiled decode step's one-row kernel (_groups_m1: only the 1-row block kernels)
    gives the bytes of _groups_small with m = 1, over any range of groups."""
    from olv_runtime.kernels import packed_f32

    rng = np.random.default_rng(n + k)
    _, payload, scale = _weight(n, k, rng)
    p = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    ng = p.codes.shape[0]
    for g0, g1 in ((0, ng), (ng // 2, ng)):
        a = np.zeros((1, n), np.float32)
        b = np.zeros((1, n), np.float32)
        facc = np.zeros(64, np.float32)
        packed_f32._groups_small(p.codes, p.scale, g0, g1, x, 0, 1, n, a, facc)
        packed_f32.groups_m1(p.codes, p.scale, g0, g1, x, n, b, facc)
        np.testing.assert_array_equal(a, b)
        assert np.abs(a[0, 8 * g0:]).sum() > 0


# ------------------------------------------------------------------------------------------------
# the VNNI path (packed_f32_vnni): block fixed-point activation digits, integer dot products
# ------------------------------------------------------------------------------------------------
needs_vnni = pytest.mark.skipif(not HOST_VNNI, reason="the CPU has no AVX-512 VNNI: the float "
                                "path is the only path (tested above)")


def test_fixed_point_term_bounds_the_vnni_path(isa):
    """A block whose largest activation sits on zero weights while the weights see elements
    2^40 smaller: the VNNI path represents those at 2^-30 of the block's largest (its stated
    bound), the float path stays within the float bound."""
    rng = np.random.default_rng(21)
    n, k = 16, 64
    q = rng.integers(-8, 8, size=(n, k))
    q[:, 5] = 0  # the big element multiplies zero weights only
    _, payload, scale = _weight(n, k, rng, q=q)
    x = rng.standard_normal((2, k)).astype(np.float32)
    x[0, 5] = 2.0 ** 40
    x[1, 40] = 1e-3  # and a block with a small but ordinary range
    y = linear_packed_i8_exact(x, prepack_int4_i8(payload, scale, None, n, k, 32))
    w64 = _dequant64(q, scale)
    _check_bound(y, x, w64)
    if isa == "avx2":
        _check_bound(y, x, w64, fixed_point=False)


#: the digits of packed_f32_vnni's module docstring, computed independently
_digits_numpy = reference.activation_digits


@needs_vnni
def test_activation_digits_known_answers():
    from olv_runtime.kernels import packed_f32_vnni as pv

    rng = np.random.default_rng(3)
    k = 32 * 6 + 7  # a partial last block
    x = (rng.standard_normal((4, k)) * np.exp(rng.uniform(-30, 30, size=(4, k)))).astype(np.float32)
    x[1, :32] = 0.0
    x[1, 32:64] = rng.standard_normal(32) * 1e-41  # subnormals
    x[2, 64:96] = np.float32(2.0) ** 127 * 1.5     # the largest binade
    x[3, 96] = -(2.0 ** 29)
    dg, bz, xsc = pv.digit_buffers(4, 8)
    assert pv.digits_rows(x, 4, k, dg, bz, xsc) == 0
    for i in range(4):
        for b in range(-(-k // 32)):
            blk = x[i, 32 * b:32 * b + 32]
            D, xs = _digits_numpy(blk)
            got = dg[i, 128 * b:128 * b + 128].reshape(4, 32).astype(np.int64)
            np.testing.assert_array_equal(got, D)
            assert np.all(np.abs(D[:3]) <= 128) and np.all(np.abs(D[3]) <= 65)
            np.testing.assert_array_equal(bz[i, 4 * b:4 * b + 4], -8 * D.sum(axis=1))
            if xs is not None:
                assert xsc[i, b] == xs
            # the fixed-point value is x to 2^-30 of the block's largest, exact within 7 binades
            e = max(int((blk.view(np.uint32) & 0x7FFFFFFF).max() >> 23), 1)
            val = (D * (256.0 ** np.arange(4))[:, None]).sum(axis=0)[:blk.size] * 2.0 ** (e - 156)
            big = np.abs(blk).max()
            assert np.all(np.abs(val - blk) <= 2.0 ** -30 * big + 2.0 ** -150)
            near = np.abs(blk) >= 2.0 ** (e - 133)
            np.testing.assert_array_equal(val[near], blk[near].astype(np.float64))
    # a non-finite block: reported, NaN multiplier
    x[0, 40] = np.inf
    x[2, 3] = np.nan
    assert pv.digits_rows(x, 4, k, dg, bz, xsc) == 2
    assert np.isnan(xsc[0, 1]) and np.isnan(xsc[2, 0]) and np.isfinite(xsc[0, 0])


@needs_vnni
def test_nonfinite_rows_get_the_float_path_results():
    rng = np.random.default_rng(6)
    n, k = 40, 100
    _, payload, scale = _weight(n, k, rng)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, 3] = np.inf
    x[2, 70] = -np.inf
    y = linear_packed_i8_exact(x, pk)
    set_isa("avx2")
    try:
        yf = linear_packed_i8_exact(x, pk)
    finally:
        set_isa(None)
    np.testing.assert_array_equal(y[[0, 2]], yf[[0, 2]])
    assert np.isinf(y[0]).any()
    np.testing.assert_array_equal(y[1], linear_packed_i8_exact(x[1:2].copy(), pk)[0])


@needs_vnni
@pytest.mark.parametrize("n,k", [(8, 32), (100, 96), (13, 160), (200, 2048), (72, 2080), (40, 4864),
                                 (32776, 64)])
def test_vnni_variants_bitwise_equal(n, k):
    """The M = 1 loops (4 groups per pass for long rows, else 1) and the multi-row
    loop give the same bytes over any range of groups: a row's result does not depend on the
    variant."""
    from olv_runtime.kernels import packed_f32_vnni as pv

    rng = np.random.default_rng(n + k)
    _, payload, scale = _weight(n, k, rng)
    p = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    dg, bz, xsc = pv.digit_buffers(1, p.k_blocks)
    pv.digits_rows(x, 1, k, dg, bz, xsc)
    ng = p.codes.shape[0]
    facc = np.zeros(64, np.float32)
    for g0, g1 in ((0, ng), (ng // 2, ng), (1, min(ng, 6))):
        if g0 >= g1:
            continue
        a = np.zeros((1, n), np.float32)
        b = np.zeros((1, n), np.float32)
        pv.groups_rows(p.codes, p.scale, g0, g1, 1, dg, bz, xsc, n, a, facc)
        pv.groups_m1(p.codes, p.scale, g0, g1, dg, bz, xsc, n, b, facc)
        np.testing.assert_array_equal(a, b)
        assert np.abs(a[0, 8 * g0:]).sum() > 0


@needs_vnni
@pytest.mark.parametrize("n,k,m", [(100, 96, 7), (13 * 8 - 3, 160, 5), (72, 2080, 4), (40, 64, 2)])
def test_vnni_group_pairs_bitwise_equal_one_row_groups(n, k, m):
    """The many-row loop (two groups per pass in 512-bit lanes, then a last single group; 4, 2,
    1 rows per pass) gives every row the bytes of the M = 1 one-group loop, over even and odd
    group ranges and a partial last group."""
    from olv_runtime.kernels import packed_f32_vnni as pv

    assert pv.PAIR_GROUPS
    rng = np.random.default_rng(n * k + m)
    _, payload, scale = _weight(n, k, rng)
    p = prepack_int4_i8(payload, scale, None, n, k, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] *= 1e-30  # a block of tiny values: the fixed-point scale differs per block
    dg, bz, xsc = pv.digit_buffers(m, p.k_blocks)
    pv.digits_rows(x, m, k, dg, bz, xsc)
    ng = p.codes.shape[0]
    facc = np.zeros(64, np.float32)
    for g0, g1 in ((0, ng), (1, ng), (0, ng - 1), (2, min(ng, 5))):
        a = np.zeros((m, n), np.float32)
        pv.groups_rows(p.codes, p.scale, g0, g1, m, dg, bz, xsc, n, a, facc)
        for i in range(m):
            d1, b1, s1 = pv.digit_buffers(1, p.k_blocks)
            d1[0], b1[0], s1[0] = dg[i], bz[i], xsc[i]
            r = np.zeros((1, n), np.float32)
            pv.groups_m1(p.codes, p.scale, g0, g1, d1, b1, s1, n, r, facc)
            np.testing.assert_array_equal(a[i], r[0])
        assert np.abs(a[:, 8 * g0:min(n, 8 * g1)]).min(axis=1).max() > 0
        assert not a[:, :8 * g0].any() and not a[:, 8 * g1:].any()
