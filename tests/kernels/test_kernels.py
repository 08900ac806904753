"""Tests of olv_runtime.kernels against tests/reference.py and onnx.reference (ONNX's own oracle)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import (
    append_kv, attention, config, dequantize_affine, gather_rows_int4, linear_f32, linear_int4,
    rms_norm, rotary_embedding, set_num_threads, threading_layer, unpack_codes,
)

try:
    from tests import reference
except ImportError:  # pragma: no cover - tests/ not importable as a package
    import reference


RNG = np.random.default_rng(1234)

_TENSOR_TYPE = {(8, True): TensorProto.INT8, (8, False): TensorProto.UINT8,
                (4, True): TensorProto.INT4, (4, False): TensorProto.UINT4,
                (2, True): TensorProto.INT2, (2, False): TensorProto.UINT2}


def _codes(shape, bits, signed, rng=RNG):
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    return rng.integers(lo, hi, size=shape, dtype=np.int64)


def _onnx_dequantize(codes, bits, signed, scale, zp, axis, block_size):
    """Run onnx.reference DequantizeLinear (opset 23) on constant initializers."""
    ttype = _TENSOR_TYPE[(bits, signed)]
    inits = [helper.make_tensor("x", ttype, list(codes.shape), codes.reshape(-1).tolist())]
    sdt = TensorProto.FLOAT if scale.dtype == np.float32 else TensorProto.FLOAT16
    inits.append(helper.make_tensor("s", sdt, list(scale.shape), scale.reshape(-1).tolist()))
    names = ["x", "s"]
    if zp is not None:
        inits.append(helper.make_tensor("z", ttype, list(zp.shape), zp.reshape(-1).tolist()))
        names.append("z")
    attrs = {"axis": axis}
    if block_size:
        attrs["block_size"] = block_size
    node = helper.make_node("DequantizeLinear", names, ["y"], **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", sdt, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    return ReferenceEvaluator(model).run(None, {})[0]


def _int4_matrix(n, k, bs, with_zp, rng=RNG):
    codes = _codes((n, k), 4, True, rng)
    kb = -(-k // bs)
    scale = (rng.random((n, kb), dtype=np.float32) + 0.05) * np.float32(0.1)
    zp = _codes((n, kb), 4, True, rng).astype(np.int8) if with_zp else None
    return codes, reference.pack_codes(codes, 4), scale, zp


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def test_config_flags_and_threading_layer():
    assert config.JIT == dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
    assert config.PJIT == dict(config.JIT, parallel=True)
    x = np.ones((3, 8), np.float32)
    rms_norm(x, np.ones(8, np.float32), 1e-6)  # runs a parallel region
    assert threading_layer() in ("omp", "tbb", "workqueue")
    assert threading_layer() == config.SELECTED_THREADING_LAYER
    n = config.get_num_threads()
    set_num_threads(1)
    assert config.get_num_threads() == 1
    set_num_threads(n)


# ------------------------------------------------------------------------------------------------
# unpack_codes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("count", [0, 1, 7, 33, 20001])
def test_unpack_codes(bits, signed, count):
    codes = _codes(count, bits, signed)
    payload = reference.pack_codes(codes, bits)
    got = unpack_codes(payload, bits, signed, count)
    assert got.dtype == (np.int8 if signed else np.uint8)
    np.testing.assert_array_equal(got.astype(np.int64), codes)
    np.testing.assert_array_equal(reference.unpack_codes(payload, bits, signed, count), codes)


def test_unpack_codes_sign_extension():
    payload = np.array([0x8F, 0x70], dtype=np.uint8)
    np.testing.assert_array_equal(unpack_codes(payload, 4, True, 4), [-1, -8, 0, 7])
    np.testing.assert_array_equal(unpack_codes(payload, 4, False, 4), [15, 8, 0, 7])
    np.testing.assert_array_equal(unpack_codes(np.array([0b11100100], np.uint8), 2, True, 4),
                                  [0, 1, -2, -1])
    np.testing.assert_array_equal(unpack_codes(np.array([200], np.uint8), 8, False, 1), [200])
    np.testing.assert_array_equal(unpack_codes(np.array([200], np.uint8), 8, True, 1), [-56])


def test_unpack_codes_errors():
    with pytest.raises(InvalidArgument, match="payload.*at least 3 bytes.*got 2"):
        unpack_codes(np.zeros(2, np.uint8), 4, True, 5)
    with pytest.raises(InvalidArgument, match="bits"):
        unpack_codes(np.zeros(2, np.uint8), 3, True, 1)
    with pytest.raises(InvalidArgument, match="payload.*dtype uint8.*int8"):
        unpack_codes(np.zeros(2, np.int8), 4, True, 1)
    with pytest.raises(InvalidArgument, match="payload.*C-contiguous"):
        unpack_codes(np.zeros(8, np.uint8)[::2], 4, True, 1)
    with pytest.raises(InvalidArgument, match="out"):
        unpack_codes(np.zeros(2, np.uint8), 4, True, 4, out=np.zeros(4, np.uint8))


# ------------------------------------------------------------------------------------------------
# dequantize_affine: bit-exact against onnx.reference DequantizeLinear
# ------------------------------------------------------------------------------------------------
_DQ_CASES = [
    # shape, axis, block_size, scale kind
    ((5, 7), 1, None, "tensor"),
    ((5, 7), 1, None, "axis"),
    ((5, 7), 0, None, "axis"),
    ((3, 4, 6), -2, None, "axis"),
    ((6, 37), 1, 8, "block"),   # partial last block, odd K
    ((6, 64), 1, 32, "block"),
    ((9, 5), 0, 4, "block"),    # blocked along axis 0
    ((2, 3, 10), 2, 3, "block"),
    ((2, 5, 3), 1, 2, "block"),
]


@pytest.mark.parametrize("shape,axis,block_size,kind", _DQ_CASES)
@pytest.mark.parametrize("bits,signed", [(8, True), (8, False), (4, True), (4, False),
                                         (2, True), (2, False)])
@pytest.mark.parametrize("with_zp", [False, True])
@pytest.mark.parametrize("sdtype", [np.float32, np.float16])
def test_dequantize_affine_matches_onnx(shape, axis, block_size, kind, bits, signed, with_zp,
                                        sdtype):
    rng = np.random.default_rng(hash((shape, axis, bits, signed, with_zp)) % 2**32)
    codes = _codes(shape, bits, signed, rng)
    ax = axis % len(shape)
    if kind == "tensor":
        sshape = ()
    elif kind == "axis":
        sshape = (shape[ax],)
    else:
        sshape = tuple(-(-d // block_size) if i == ax else d for i, d in enumerate(shape))
    scale = np.asarray(rng.standard_normal(sshape) * 0.3).astype(sdtype)
    zp = np.asarray(_codes(sshape, bits, signed, rng)) if with_zp else None
    payload = reference.pack_codes(codes, bits)
    got = dequantize_affine(payload, bits, signed, shape, scale,
                            None if zp is None else zp.astype(np.int8 if signed else np.uint8),
                            axis, block_size)
    assert got.dtype == np.float32 and got.shape == shape
    ref = _onnx_dequantize(codes, bits, signed, scale, zp, axis, block_size)
    np.testing.assert_array_equal(got.astype(ref.dtype), ref)  # bit-exact (NaN-free inputs)
    np.testing.assert_array_equal(got, reference.dequantize(codes, scale, zp, ax, block_size))


def test_dequantize_affine_out_and_large():
    shape = (40, 1000)
    codes = _codes(shape, 4, True)
    scale = RNG.random((40, 32), dtype=np.float32)
    out = np.full(shape, np.nan, np.float32)
    res = dequantize_affine(reference.pack_codes(codes, 4), 4, True, shape, scale, None, 1, 32, out=out)
    assert res is out
    np.testing.assert_array_equal(out, reference.dequantize(codes, scale, None, 1, 32))


def test_dequantize_affine_errors():
    p = np.zeros(16, np.uint8)
    s = np.ones((4, 1), np.float32)
    with pytest.raises(InvalidArgument, match="scale.*shape \\[4, 2\\].*got \\[4, 1\\]"):
        dequantize_affine(p, 4, True, (4, 8), s, None, 1, 4)
    with pytest.raises(InvalidArgument, match="scale.*dtype"):
        dequantize_affine(p, 4, True, (4, 8), np.ones(4, np.float64), None, 0, None)
    with pytest.raises(InvalidArgument, match="scale.*shape \\[8\\]"):
        dequantize_affine(p, 4, True, (4, 8), np.ones(4, np.float32), None, 1, None)
    with pytest.raises(InvalidArgument, match="zero_point.*shape"):
        dequantize_affine(p, 4, True, (4, 8), np.ones(4, np.float32), np.zeros(3, np.int8), 0)
    with pytest.raises(InvalidArgument, match="zero_point.*\\[-8, 7\\]"):
        dequantize_affine(p, 4, True, (4, 8), np.ones(4, np.float32), np.full(4, 9, np.int8), 0)
    with pytest.raises(InvalidArgument, match="payload"):
        dequantize_affine(p, 4, True, (5, 8), np.ones(1, np.float32))
    with pytest.raises(InvalidArgument, match="axis"):
        dequantize_affine(p, 4, True, (4, 8), np.ones(4, np.float32), None, 2)
    with pytest.raises(InvalidArgument, match="out.*shape"):
        dequantize_affine(p, 4, True, (4, 8), np.ones(1, np.float32), out=np.empty((8, 4), np.float32))


# ------------------------------------------------------------------------------------------------
# gather_rows_int4
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,bs", [(7, 32, 32), (9, 37, 16), (5, 31, 32), (6, 40, 32), (4, 9, 3)])
@pytest.mark.parametrize("with_zp", [False, True])
def test_gather_rows_int4(n, k, bs, with_zp):
    codes, payload, scale, zp = _int4_matrix(n, k, bs, with_zp)
    w = dequantize_affine(payload, 4, True, (n, k), scale, zp, 1, bs)
    np.testing.assert_array_equal(w, reference.dequantize(codes, scale, zp, 1, bs))
    ids = np.array([[0, n - 1, -1], [2, -n, 1]], dtype=np.int64)
    got = gather_rows_int4(payload, scale, zp, n, k, bs, ids)
    assert got.shape == (2, 3, k)
    np.testing.assert_array_equal(got, w[ids])
    got32 = gather_rows_int4(payload, scale, zp, n, k, bs, np.array([3], np.int32))
    np.testing.assert_array_equal(got32, w[[3]])


def test_gather_rows_int4_errors():
    codes, payload, scale, zp = _int4_matrix(4, 10, 4, True)
    for bad in (4, -5):
        with pytest.raises(InvalidArgument, match=f"ids.*\\[-4, 4\\).*got {bad}"):
            gather_rows_int4(payload, scale, zp, 4, 10, 4, np.array([0, bad]))
    with pytest.raises(InvalidArgument, match="ids.*dtype"):
        gather_rows_int4(payload, scale, zp, 4, 10, 4, np.array([0.0]))
    with pytest.raises(InvalidArgument, match="zero_point.*dtype int8"):
        gather_rows_int4(payload, scale, zp.astype(np.int32), 4, 10, 4, np.array([0]))
    with pytest.raises(InvalidArgument, match="scale.*shape \\[4, 3\\]"):
        gather_rows_int4(payload, scale[:, :2].copy(), zp, 4, 10, 4, np.array([0]))
    with pytest.raises(InvalidArgument, match="out"):
        gather_rows_int4(payload, scale, zp, 4, 10, 4, np.array([0]), out=np.empty((1, 9), np.float32))


# ------------------------------------------------------------------------------------------------
# linear_int4 / linear_f32
# ------------------------------------------------------------------------------------------------
def _assert_linear_close(got, x, w):
    ref = reference.linear(x, w)
    bound = np.abs(np.float64(x)) @ np.abs(np.float64(w)).T
    err = np.abs(got - ref)
    assert np.all(err <= 2e-6 * bound + 1e-30), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("n,k,bs", [
    (16, 64, 32),    # fast path, full blocks
    (13, 96, 32),
    (11, 80, 32),    # fast path, partial last block (80 = 2*32 + 16)
    (10, 50, 32),    # fast path, K not a multiple of bs
    (9, 37, 32),     # odd K: general path, rows start mid-byte
    (7, 45, 16),
    (6, 40, 5),      # odd block size: general path
    (3, 8, 64),      # single partial block
    (1, 2, 2),
])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("with_zp", [False, True])
def test_linear_int4(n, k, bs, m, with_zp):
    rng = np.random.default_rng(n * 1000 + k * 10 + m)
    codes, payload, scale, zp = _int4_matrix(n, k, bs, with_zp, rng)
    w = reference.dequantize(codes, scale, zp, 1, bs)
    x = rng.standard_normal((m, k), dtype=np.float32)
    got = linear_int4(x, payload, scale, zp, n, k, bs)
    assert got.shape == (m, n) and got.dtype == np.float32
    _assert_linear_close(got, x, w)
    out = np.full((m, n), np.nan, np.float32)
    assert linear_int4(x, payload, scale, zp, n, k, bs, out=out) is out
    np.testing.assert_array_equal(out, got)  # deterministic


def test_linear_int4_m128_and_thread_independence():
    n, k, bs = 40, 96, 32
    codes, payload, scale, zp = _int4_matrix(n, k, bs, False)
    x = RNG.standard_normal((128, k), dtype=np.float32)
    got = linear_int4(x, payload, scale, zp, n, k, bs)
    _assert_linear_close(got, x, reference.dequantize(codes, scale, None, 1, bs))
    nt = config.get_num_threads()
    set_num_threads(1)
    try:
        got1 = linear_int4(x, payload, scale, zp, n, k, bs)
    finally:
        set_num_threads(nt)
    np.testing.assert_array_equal(got1, got)  # fixed summation order, whatever the threads


def test_float16_scales_equal_widened_float32():
    """float16 block scales are read through their bits and widened exactly: the row-major
    linear and the row gather give bitwise the results of the float32-widened scales."""
    from olv_runtime.kernels import gather_rows_int4

    codes, payload, scale, zp = _int4_matrix(9, 70, 32, True)
    s16 = scale.astype(np.float16)
    s32 = s16.astype(np.float32)
    x = np.random.default_rng(3).standard_normal((3, 70)).astype(np.float32)
    np.testing.assert_array_equal(linear_int4(x, payload, s16, zp, 9, 70, 32),
                                  linear_int4(x, payload, s32, zp, 9, 70, 32))
    ids = np.array([[0, 8], [4, -1]])
    np.testing.assert_array_equal(gather_rows_int4(payload, s16, zp, 9, 70, 32, ids),
                                  gather_rows_int4(payload, s32, zp, 9, 70, 32, ids))


def test_linear_int4_errors():
    codes, payload, scale, zp = _int4_matrix(4, 64, 32, True)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(InvalidArgument, match="x.*shape \\[\\?, 64\\].*got \\[2, 63\\]"):
        linear_int4(np.zeros((2, 63), np.float32), payload, scale, zp, 4, 64, 32)
    with pytest.raises(InvalidArgument, match="x.*dtype float32.*float64"):
        linear_int4(x.astype(np.float64), payload, scale, zp, 4, 64, 32)
    with pytest.raises(InvalidArgument, match="x.*C-contiguous"):
        linear_int4(np.zeros((64, 2), np.float32).T, payload, scale, zp, 4, 64, 32)
    with pytest.raises(InvalidArgument, match="payload.*at least 128 bytes"):
        linear_int4(x, payload[:100], scale, zp, 4, 64, 32)
    with pytest.raises(InvalidArgument, match="scale.*float32 or float16.*float64"):
        linear_int4(x, payload, scale.astype(np.float64), zp, 4, 64, 32)
    with pytest.raises(InvalidArgument, match="out.*shape \\[2, 4\\]"):
        linear_int4(x, payload, scale, zp, 4, 64, 32, out=np.empty((4, 2), np.float32))
    with pytest.raises(InvalidArgument, match="block_size"):
        linear_int4(x, payload, scale, zp, 4, 64, 0)


@pytest.mark.parametrize("m,n,k", [(1, 5, 7), (3, 16, 64), (17, 9, 33)])
def test_linear_f32(m, n, k):
    x = RNG.standard_normal((m, k), dtype=np.float32)
    w = RNG.standard_normal((n, k), dtype=np.float32)
    _assert_linear_close(linear_f32(x, w), x, w)
    out = np.empty((m, n), np.float32)
    assert linear_f32(x, w, out=out) is out
    with pytest.raises(InvalidArgument, match="x.*shape"):
        linear_f32(np.zeros((m, k + 1), np.float32), w)
    with pytest.raises(InvalidArgument, match="w.*dtype"):
        linear_f32(x, w.astype(np.float64))


# ------------------------------------------------------------------------------------------------
# rms_norm vs onnx.reference RMSNormalization (opset 23)
# ------------------------------------------------------------------------------------------------
def _onnx_rms(x, w, eps):
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=-1, epsilon=eps)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    return ReferenceEvaluator(model).run(None, {"x": x, "w": w})[0]


@pytest.mark.parametrize("r,d", [(1, 64), (3, 896), (17, 33), (5, 1)])
def test_rms_norm(r, d):
    x = RNG.standard_normal((r, d), dtype=np.float32) * 3
    w = RNG.standard_normal(d, dtype=np.float32)
    eps = 1e-6
    got = rms_norm(x, w, eps)
    np.testing.assert_allclose(got, _onnx_rms(x, w, eps), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, reference.rms_norm(x, w, eps), rtol=1e-6, atol=1e-7)
    y = x.copy()
    assert rms_norm(y, w, eps, out=y) is y  # in place
    np.testing.assert_array_equal(y, got)
    with pytest.raises(InvalidArgument, match="weight.*shape"):
        rms_norm(x, w[:-1].copy() if d > 1 else np.ones(2, np.float32), eps)
    with pytest.raises(InvalidArgument, match="x.*rank 2"):
        rms_norm(x.reshape(-1), w, eps)
    with pytest.raises(InvalidArgument, match="epsilon"):
        rms_norm(x, w, -1.0)


# ------------------------------------------------------------------------------------------------
# rotary_embedding vs onnx.reference RotaryEmbedding (opset 23, 3-D input)
# ------------------------------------------------------------------------------------------------
def _onnx_rope(x, cos, sin, interleaved, rdim):
    b, s, nh, d = x.shape
    node = helper.make_node("RotaryEmbedding", ["x", "c", "s"], ["y"], interleaved=int(interleaved),
                            rotary_embedding_dim=rdim, num_heads=nh)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(nm, TensorProto.FLOAT, None) for nm in ("x", "c", "s")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    y = ReferenceEvaluator(model).run(None, {"x": x.reshape(b, s, nh * d), "c": cos, "s": sin})[0]
    return y.reshape(b, s, nh, d)


@pytest.mark.parametrize("b,s,nh,d,rdim", [(1, 1, 4, 16, 16), (2, 5, 3, 8, 8), (1, 3, 2, 16, 6),
                                           (1, 7, 14, 64, 64)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding(b, s, nh, d, rdim, interleaved):
    x = RNG.standard_normal((b, s, nh, d), dtype=np.float32)
    ang = RNG.random((b, s, rdim // 2), dtype=np.float32) * 6
    cos, sin = np.cos(ang), np.sin(ang)
    got = rotary_embedding(x, cos, sin, interleaved, rdim)
    np.testing.assert_array_equal(got, _onnx_rope(x, cos, sin, interleaved, rdim))
    np.testing.assert_array_equal(got, reference.rotary_embedding(x, cos, sin, interleaved, rdim))
    y = x.copy()
    rotary_embedding(y, cos, sin, interleaved, rdim, out=y)
    np.testing.assert_array_equal(y, got)


def test_rotary_embedding_errors():
    x = np.zeros((1, 2, 3, 8), np.float32)
    c = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(InvalidArgument, match="cos.*shape \\[1, 2, 2\\]"):
        rotary_embedding(x, c, c, False, 4)
    with pytest.raises(InvalidArgument, match="rotary_dim.*even"):
        rotary_embedding(x, c, c, False, 7)
    with pytest.raises(InvalidArgument, match="rotary_dim"):
        rotary_embedding(x, c, c, False, 10)
    with pytest.raises(InvalidArgument, match="x.*rank 4"):
        rotary_embedding(x[0], c, c, False, 8)
    with pytest.raises(InvalidArgument, match="sin.*dtype"):
        rotary_embedding(x, c, c.astype(np.float64), False, 8)


# ------------------------------------------------------------------------------------------------
# attention / append_kv vs onnx.reference Attention (opset 23)
# ------------------------------------------------------------------------------------------------
def _onnx_attention(q3, k3, v3, past_k, past_v, h, kvh, scale):
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "ck", "cv"],
                            is_causal=1, q_num_heads=h, kv_num_heads=kvh, scale=scale)
    names = ("q", "k", "v", "pk", "pv")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(nm, TensorProto.FLOAT, None) for nm in names],
        [helper.make_tensor_value_info(nm, TensorProto.FLOAT, None) for nm in ("y", "ck", "cv")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    return ReferenceEvaluator(model).run(None, dict(zip(names, (q3, k3, v3, past_k, past_v))))


@pytest.mark.parametrize("h,kvh", [(4, 2), (14, 2)])
@pytest.mark.parametrize("s", [1, 5])
@pytest.mark.parametrize("past", [0, 1, 17])
@pytest.mark.parametrize("b", [1, 2])
def test_attention_matches_onnx(h, kvh, s, past, b):
    d = 16
    rng = np.random.default_rng(h * 100 + s * 10 + past + b)
    q3 = rng.standard_normal((b, s, h * d), dtype=np.float32)
    k3 = rng.standard_normal((b, s, kvh * d), dtype=np.float32)
    v3 = rng.standard_normal((b, s, kvh * d), dtype=np.float32)
    pk = rng.standard_normal((b, kvh, past, d), dtype=np.float32)
    pv = rng.standard_normal((b, kvh, past, d), dtype=np.float32)
    scale = 1.0 / math.sqrt(d)
    y_ref, ck_ref, cv_ref = _onnx_attention(q3, k3, v3, pk, pv, h, kvh, scale)

    ck = np.empty((b, kvh, past + s, d), np.float32)
    cv = np.empty((b, kvh, past + s, d), np.float32)
    assert append_kv(pk, k3, ck) is ck
    append_kv(pv, v3, cv)
    np.testing.assert_array_equal(ck, ck_ref)
    np.testing.assert_array_equal(cv, cv_ref)
    np.testing.assert_array_equal(ck, reference.append_kv(pk, k3))

    y = attention(q3.reshape(b, s, h, d), ck, cv, past, scale, True)
    np.testing.assert_allclose(y.reshape(b, s, h * d), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, reference.attention(q3.reshape(b, s, h, d), ck, cv, past, scale, True),
                               rtol=1e-5, atol=1e-5)


def test_attention_capacity_buffer_and_noncausal():
    b, s, h, kvh, d, past, cap = 1, 3, 4, 2, 8, 4, 12
    q = RNG.standard_normal((b, s, h, d), dtype=np.float32)
    k = RNG.standard_normal((b, kvh, cap, d), dtype=np.float32)
    v = RNG.standard_normal((b, kvh, cap, d), dtype=np.float32)
    k[:, :, past + s:] = np.nan  # beyond the valid length: never read
    v[:, :, past + s:] = np.nan
    for causal in (True, False):
        got = attention(q, k, v, past, 0.3, causal)
        ref = reference.attention(q, k, v, past, 0.3, causal)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    out = np.empty_like(q)
    assert attention(q, k, v, past, 0.3, True, out=out) is out


def test_attention_errors():
    q = np.zeros((1, 2, 6, 8), np.float32)
    k = np.zeros((1, 4, 5, 8), np.float32)
    with pytest.raises(InvalidArgument, match="kv head count dividing the 6 query heads, got 4"):
        attention(q, k, k, 3, 1.0, True)
    k = np.zeros((1, 3, 5, 8), np.float32)
    with pytest.raises(InvalidArgument, match="past_len"):
        attention(q, k, k, 4, 1.0, True)
    with pytest.raises(InvalidArgument, match="v_cache.*shape"):
        attention(q, k, np.zeros((1, 3, 4, 8), np.float32), 3, 1.0, True)
    with pytest.raises(InvalidArgument, match="k_cache.*shape"):
        attention(q, np.zeros((1, 3, 5, 4), np.float32), k, 3, 1.0, True)
    with pytest.raises(InvalidArgument, match="q.*dtype"):
        attention(q.astype(np.float64), k, k, 3, 1.0, True)


def test_append_kv_errors():
    past = np.zeros((1, 2, 3, 4), np.float32)
    new = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(InvalidArgument, match="out.*shape \\[1, 2, 5, 4\\]"):
        append_kv(past, new, np.empty((1, 2, 4, 4), np.float32))
    with pytest.raises(InvalidArgument, match="new.*shape \\[1, \\?, 8\\]"):
        append_kv(past, np.zeros((1, 2, 6), np.float32), np.empty((1, 2, 5, 4), np.float32))
    with pytest.raises(InvalidArgument, match="out"):
        append_kv(past, new, None)
    buf = np.zeros(200, np.float32)
    with pytest.raises(InvalidArgument, match="overlapping"):
        append_kv(buf[:24].reshape(1, 2, 3, 4), new, buf[:40].reshape(1, 2, 5, 4))
