"""Tests of olv_runtime.kernels.packed (tiled INT4 linear) against a float64 numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import linear_int4, set_num_threads, get_num_threads
from olv_runtime.kernels.packed import (
    TILE_ROWS, PackedInt4, linear_packed, make_workspace, prepack_int4,
)


def _weight(n, k, rng, zp=False):
    """Random blocked INT4 weight: payload (row-major, low nibble first), scale, zp, and the
    float32 dequantized W exactly as DequantizeLinear gives it."""
    kb = -(-k // 32)
    q = rng.integers(-8, 8, size=n * k)
    u = (q & 15).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    payload = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    scale = (rng.random((n, kb), dtype=np.float32) * 0.05 + 1e-3).astype(np.float32)
    z = None
    if zp:
        z = rng.integers(-8, 8, size=(n, kb)).astype(np.int8)
        z[0, 0], z[-1, -1] = -8, 7
    zf = np.repeat(z.astype(np.int32), 32, axis=1)[:, :k] if zp else 0
    w = (q.reshape(n, k) - zf).astype(np.float32) * np.repeat(scale, 32, axis=1)[:, :k]
    return payload, scale, z, w


def _exact_bound(x, w):
    return 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-6


SHAPES = [(64, 64), (100, 40), (70, 80), (130, 100), (1, 32), (65, 33), (200, 256)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_exact_mode_matches_reference(n, k, zp, m):
    rng = np.random.default_rng(n * 1000 + k * 10 + m + zp)
    payload, scale, z, w = _weight(n, k, rng, zp)
    pk = prepack_int4(payload, scale, z, n, k, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    y = linear_packed(x, pk)
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= _exact_bound(x, w))
    # row results do not depend on M (same kernel order per row)
    y0 = linear_packed(x[:1].copy(), pk)
    if m < 16:
        np.testing.assert_array_equal(y0[0], y[0])


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("zp", [False, True])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_quantized_mode_close_to_exact(n, k, zp, m):
    rng = np.random.default_rng(7 + n * 1000 + k * 10 + m + zp)
    payload, scale, z, w = _weight(n, k, rng, zp)
    pk = prepack_int4(payload, scale, z, n, k, 32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, : min(k, 5)] = 0.0  # a partly zero block
    ye = linear_packed(x, pk)
    yq = linear_packed(x, pk, quantize_activations=True)
    # rigorous: each quantized activation is off by at most d_b / 2 = max|x_block| / 254
    kb = -(-k // 32)
    xmax = np.zeros((m, kb * 32))
    for b in range(kb):
        xmax[:, 32 * b: 32 * b + 32] = np.abs(x[:, 32 * b: 32 * b + 32]).max(axis=1)[:, None]
    bound = (xmax[:, :k] / 254.0) @ np.abs(w.astype(np.float64)).T + 2 * _exact_bound(x, w)
    assert np.all(np.abs(yq - ye) <= bound)
    # typical (random data, enough terms): within 2 % of the output range
    if n >= 64 and k >= 64:
        assert np.abs(yq - ye).max() <= 0.02 * np.abs(ye).max()
    # and exactly what a numpy model of the quantized arithmetic gives
    np.testing.assert_allclose(yq, _quantized_reference(x, w, scale, z, k), rtol=1e-5,
                               atol=1e-5 * np.abs(ye).max())


def _quantized_reference(x, w, scale, z, k):
    """x quantized per 32-block (d = max|x|/127, rint(x/d)), then float64 products."""
    m = x.shape[0]
    kb = -(-k // 32)
    xd = np.zeros_like(x, dtype=np.float64)
    for b in range(kb):
        blk = x[:, 32 * b: 32 * b + 32]
        d = (np.abs(blk).max(axis=1) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            qx = np.where(d[:, None] > 0, np.clip(np.rint(blk / d[:, None]), -127, 127), 0)
        xd[:, 32 * b: 32 * b + 32] = qx * d[:, None].astype(np.float64)
    return (xd @ w.astype(np.float64).T).astype(np.float32).reshape(m, -1)


def test_extreme_codes_no_int16_overflow():
    # all codes -8 and activations at +-max: |block sum| = 8*127*32 = 32512 (the int16 bound)
    n, k = 70, 96
    payload = np.full((n * k + 1) // 2, 0x88, dtype=np.uint8)  # q = -8 everywhere
    scale = np.ones((n, 3), dtype=np.float32)
    pk = prepack_int4(payload, scale, None, n, k, 32)
    for sign in (1.0, -1.0):
        x = np.full((2, k), sign, dtype=np.float32)
        yq = linear_packed(x, pk, quantize_activations=True)
        np.testing.assert_allclose(yq, -8.0 * sign * k, rtol=1e-6)
    zp = np.full((n, 3), 7, dtype=np.int8)  # q - zp = -15
    pk = prepack_int4(payload, scale, zp, n, k, 32)
    x = np.full((1, k), -1.0, dtype=np.float32)
    np.testing.assert_allclose(linear_packed(x, pk, quantize_activations=True), 15.0 * k,
                               rtol=1e-6)
    np.testing.assert_allclose(linear_packed(x, pk), 15.0 * k, rtol=1e-6)


def test_matches_row_major_kernel_and_layout():
    rng = np.random.default_rng(3)
    n, k = 2 * TILE_ROWS + 5, 4 * 32 + 7
    payload, scale, z, w = _weight(n, k, rng, zp=True)
    pk = prepack_int4(payload, scale, z, n, k, 32)
    assert isinstance(pk, PackedInt4)
    assert (pk.n, pk.k, pk.k_padded, pk.k_blocks, pk.n_tiles) == (n, k, 160, 5, 3)
    assert pk.codes.shape == (3, 5, 8, TILE_ROWS) and pk.codes.dtype == np.uint16
    assert pk.nbytes == pk.codes.nbytes + pk.scale.nbytes + pk.zero_point.nbytes
    x = rng.standard_normal((5, k)).astype(np.float32)
    y_old = linear_int4(x, payload, scale, z, n, k, 32)
    assert np.all(np.abs(linear_packed(x, pk) - y_old) <= 2 * _exact_bound(x, w))


def test_out_workspace_and_threads():
    rng = np.random.default_rng(5)
    n, k = 300, 200
    payload, scale, z, w = _weight(n, k, rng)
    pk = prepack_int4(payload, scale, z, n, k, 32)
    ws = make_workspace(64, 256)
    x = rng.standard_normal((20, k)).astype(np.float32)
    out = np.empty((20, n), np.float32)
    for qa in (False, True):
        r = linear_packed(x, pk, out, quantize_activations=qa, workspace=ws)
        assert r is out
        ref = linear_packed(x, pk, quantize_activations=qa)
        np.testing.assert_array_equal(out, ref)
        old = get_num_threads()
        try:
            set_num_threads(1)
            np.testing.assert_array_equal(linear_packed(x, pk, quantize_activations=qa,
                                                        workspace=ws), ref)
        finally:
            set_num_threads(old)
    assert linear_packed(np.zeros((0, k), np.float32), pk).shape == (0, n)


def test_invalid_arguments():
    rng = np.random.default_rng(9)
    n, k = 8, 64
    payload, scale, z, _ = _weight(n, k, rng)
    with pytest.raises(InvalidArgument, match="block_size: expected 32.*got 64"):
        prepack_int4(payload, scale[:, :1].copy(), None, n, k, 64)
    with pytest.raises(InvalidArgument, match="block_size"):
        prepack_int4(payload, scale, None, n, k, 16)
    with pytest.raises(InvalidArgument, match="payload"):
        prepack_int4(payload[:10], scale, None, n, k, 32)
    with pytest.raises(InvalidArgument, match="scale"):
        prepack_int4(payload, scale[:, :1].copy(), None, n, k, 32)
    with pytest.raises(InvalidArgument, match="scale"):
        prepack_int4(payload, scale.astype(np.float64), None, n, k, 32)
    with pytest.raises(InvalidArgument, match="zero_point"):
        prepack_int4(payload, scale, np.zeros((n, 2), np.int32), n, k, 32)
    with pytest.raises(InvalidArgument, match="n"):
        prepack_int4(payload, scale, None, 0, k, 32)
    pk = prepack_int4(payload, scale, None, n, k, 32)
    with pytest.raises(InvalidArgument, match="x"):
        linear_packed(np.zeros((1, k + 1), np.float32), pk)
    with pytest.raises(InvalidArgument, match="x"):
        linear_packed(np.zeros((1, k), np.float64), pk)
    with pytest.raises(InvalidArgument, match="out"):
        linear_packed(np.zeros((2, k), np.float32), pk, np.zeros((2, n + 1), np.float32))
    with pytest.raises(InvalidArgument, match="packed"):
        linear_packed(np.zeros((1, k), np.float32), (payload, scale))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed(np.zeros((3, k), np.float32), pk, workspace=make_workspace(2, k))
    with pytest.raises(InvalidArgument, match="workspace"):
        linear_packed(np.zeros((1, k), np.float32), pk, workspace=make_workspace(1, 32))
