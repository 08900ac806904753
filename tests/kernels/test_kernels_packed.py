"""The packed INT4 linears as the executor runs them (:func:`olv_runtime.kernels.dispatch.dispatch`:
8-row groups, symmetric or with zero points, int8 or float32 activations) against the references
of tests/reference.py: float64 ``x @ W.T`` of the dequantized weight (exact mode, bound
``1e-5 * sum_k |x_k W_nk| + 1e-6``) and the int8-activation arithmetic (bitwise).

These assertions tested the 64-row tiled kernel of kernels/packed.py until it was removed (nothing
chose it); they now hold the live kernels to the same references and bounds. The exact-mode bound
is that of the float path, so the tests run with the AVX2 path forced (the VNNI digit path adds a
fixed-point term: tests/test_kernels_packed_f32.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import get_num_threads, linear_int4, packed_i8, set_num_threads
from olv_runtime.kernels.dispatch import LinearMode, WeightFormat, dispatch
from olv_runtime.kernels.packed_i8 import prepack_int4_i8
from olv_runtime.kernels.packed_zp import prepack_int4_i8_zp


@pytest.fixture(autouse=True)
def _avx2():
    packed_i8.set_isa("avx2")
    try:
        yield
    finally:
        packed_i8.set_isa(None)


def _weight(n, k, rng, zp=False):
    """Random blocked INT4 weight: codes q, payload, scale, zp and the float32 dequantized W."""
    q = rng.integers(-8, 8, size=n * k).reshape(n, k)
    payload, scale, z = reference.int4_weight(q, rng, zero_point=zp)
    return q, payload, scale, z, reference.dequantize_int4(q, scale, z)


def _packed(payload, scale, z, n, k):
    if z is None:
        return prepack_int4_i8(payload, scale, None, n, k, 32)
    return prepack_int4_i8_zp(payload, scale, z, n, k, 32)


def _kernel(mode, z):
    return dispatch(packed_i8.isa(), mode, WeightFormat.INT4 if z is None else WeightFormat.INT4_ZP)


SHAPES = [(64, 64), (100, 40), (70, 80), (130, 100), (1, 32), (65, 33), (200, 256)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_exact_mode_matches_reference(n, k, zp, m):
    rng = np.random.default_rng(n * 1000 + k * 10 + m + zp)
    q, payload, scale, z, w = _weight(n, k, rng, zp)
    pk = _packed(payload, scale, z, n, k)
    fn = _kernel(LinearMode.EXACT, z).fn
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = reference.linear_int4_exact(x, q, scale, z)
    y = fn(x, pk)
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= reference.exact_bound(x, w))
    # row results do not depend on M (same kernel order per row)
    y0 = fn(x[:1].copy(), pk)
    np.testing.assert_array_equal(y0[0], y[0])


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_quantized_mode_close_to_exact(n, k, zp, m):
    rng = np.random.default_rng(7 + n * 1000 + k * 10 + m + zp)
    q, payload, scale, z, w = _weight(n, k, rng, zp)
    pk = _packed(payload, scale, z, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, : min(k, 5)] = 0.0  # a partly zero block
    ye = _kernel(LinearMode.EXACT, z).fn(x, pk)
    yq = _kernel(LinearMode.INT8, z).fn(x, pk)
    # rigorous: each quantized activation is off by at most d_b / 2 = max|x_block| / 254
    kb = -(-k // 32)
    xmax = np.zeros((m, kb * 32))
    for b in range(kb):
        xmax[:, 32 * b: 32 * b + 32] = np.abs(x[:, 32 * b: 32 * b + 32]).max(axis=1)[:, None]
    bound = (xmax[:, :k] / 254.0) @ np.abs(w.astype(np.float64)).T + 2 * reference.exact_bound(x, w)
    assert np.all(np.abs(yq - ye) <= bound)
    # typical (random data, enough terms): within 2 % of the output range
    if n >= 64 and k >= 64:
        assert np.abs(yq - ye).max() <= 0.02 * np.abs(ye).max()
    # and exactly what the numpy model of the quantized arithmetic gives
    np.testing.assert_array_equal(yq, reference.linear_int4_int8(x, q, scale, z))


def test_extreme_codes_no_int16_overflow():
    # all codes -8 and activations at +-max: |block sum| = 8*127*32 = 32512
    n, k = 70, 96
    payload = np.full((n * k + 1) // 2, 0x88, dtype=np.uint8)  # q = -8 everywhere
    scale = np.ones((n, 3), dtype=np.float32)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    for sign in (1.0, -1.0):
        x = np.full((2, k), sign, dtype=np.float32)
        yq = _kernel(LinearMode.INT8, None).fn(x, pk)
        np.testing.assert_allclose(yq, -8.0 * sign * k, rtol=1e-6)
    zp = np.full((n, 3), 7, dtype=np.int8)  # q - zp = -15
    pk = prepack_int4_i8_zp(payload, scale, zp, n, k, 32)
    x = np.full((1, k), -1.0, dtype=np.float32)
    np.testing.assert_allclose(_kernel(LinearMode.INT8, zp).fn(x, pk), 15.0 * k, rtol=1e-6)
    np.testing.assert_allclose(_kernel(LinearMode.EXACT, zp).fn(x, pk), 15.0 * k, rtol=1e-6)


@pytest.mark.parametrize("zp", [False, True])
def test_matches_row_major_kernel(zp):
    rng = np.random.default_rng(3)
    n, k = 2 * 64 + 5, 4 * 32 + 7
    q, payload, scale, z, w = _weight(n, k, rng, zp=zp)
    pk = _packed(payload, scale, z, n, k)
    assert (pk.n, pk.k, pk.k_padded, pk.k_blocks, pk.n_groups) == (n, k, 160, 5, 17)
    x = rng.standard_normal((5, k)).astype(np.float32)
    y_old = linear_int4(x, payload, scale, z, n, k, 32)
    y = _kernel(LinearMode.EXACT, z).fn(x, pk)
    assert np.all(np.abs(y - y_old) <= 2 * reference.exact_bound(x, w))


@pytest.mark.parametrize("zp", [False, True])
def test_out_workspace_and_threads(zp):
    rng = np.random.default_rng(5)
    n, k = 300, 200
    q, payload, scale, z, w = _weight(n, k, rng, zp)
    pk = _packed(payload, scale, z, n, k)
    x = rng.standard_normal((20, k)).astype(np.float32)
    out = np.empty((20, n), np.float32)
    for mode in (LinearMode.EXACT, LinearMode.INT8):
        entry = _kernel(mode, z)
        ws = entry.make_workspace(64, 256)
        r = entry.fn(x, pk, out, workspace=ws)
        assert r is out
        ref = entry.fn(x, pk)
        np.testing.assert_array_equal(out, ref)
        old = get_num_threads()
        try:
            set_num_threads(1)
            np.testing.assert_array_equal(entry.fn(x, pk, workspace=ws), ref)
        finally:
            set_num_threads(old)
        assert entry.fn(np.zeros((0, k), np.float32), pk).shape == (0, n)


@pytest.mark.parametrize("zp", [False, True])
def test_invalid_arguments(zp):
    rng = np.random.default_rng(9)
    n, k = 8, 64
    q, payload, scale, z, _ = _weight(n, k, rng, zp)
    z_arg = z if zp else None

    def prepack(payload, scale, zero_point, n, k, bs):
        if zp:
            return prepack_int4_i8_zp(payload, scale, zero_point, n, k, bs)
        return prepack_int4_i8(payload, scale, zero_point, n, k, bs)

    with pytest.raises(InvalidArgument, match="block_size: expected 32.*got 64"):
        prepack(payload, scale[:, :1].copy(), z_arg if z_arg is None else z_arg[:, :1].copy(),
                n, k, 64)
    with pytest.raises(InvalidArgument, match="block_size"):
        prepack(payload, scale, z_arg, n, k, 16)
    with pytest.raises(InvalidArgument, match="payload"):
        prepack(payload[:10], scale, z_arg, n, k, 32)
    with pytest.raises(InvalidArgument, match="scale"):
        prepack(payload, scale[:, :1].copy(), z_arg, n, k, 32)
    with pytest.raises(InvalidArgument, match="scale"):
        prepack(payload, scale.astype(np.float64), z_arg, n, k, 32)
    with pytest.raises(InvalidArgument, match="zero_point"):
        prepack(payload, scale, np.zeros((n, 2), np.int32), n, k, 32)
    with pytest.raises(InvalidArgument, match="n"):
        prepack(payload, scale, z_arg, 0, k, 32)
    pk = prepack(payload, scale, z_arg, n, k, 32)
    for mode in (LinearMode.EXACT, LinearMode.INT8):
        entry = _kernel(mode, z_arg)
        with pytest.raises(InvalidArgument, match="x"):
            entry.fn(np.zeros((1, k + 1), np.float32), pk)
        with pytest.raises(InvalidArgument, match="x"):
            entry.fn(np.zeros((1, k), np.float64), pk)
        with pytest.raises(InvalidArgument, match="out"):
            entry.fn(np.zeros((2, k), np.float32), pk, np.zeros((2, n + 1), np.float32))
        with pytest.raises(InvalidArgument, match="packed"):
            entry.fn(np.zeros((1, k), np.float32), (payload, scale))
        with pytest.raises(InvalidArgument, match="workspace"):
            entry.fn(np.zeros((3, k), np.float32), pk, workspace=entry.make_workspace(2, k))
        with pytest.raises(InvalidArgument, match="workspace"):
            entry.fn(np.zeros((1, k), np.float32), pk, workspace=entry.make_workspace(1, 32))
