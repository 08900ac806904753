"""Slow, obvious numpy references for olv_runtime.kernels (no numba): the kernel tests' oracles.

Each function follows the operator definition directly (ONNX operators, the ggml block formats,
the packed INT4 kernels' documented arithmetic) with loops and plain numpy, so it serves as an
oracle independent of the kernels' layout tricks. ``tests/naive.py`` re-exports this module
under its old name.

Contents: bit packing (``pack_codes``, ``unpack_codes``), DequantizeLinear (``expand_param``,
``dequantize``), ``linear``, ``rms_norm``, ``rotary_embedding``, ``attention``, ``append_kv``,
the ggml group records (``ggml_records``), the blocked INT4 linears (``int4_weight``,
``dequantize_int4``, ``quantize_int8_blocks``, ``linear_int4_int8``, ``linear_int4_exact``,
``exact_bound``), int8 activations against any float weight (``linear_int8_float64``: the ggml
kernels) and from ggml blocks bitwise (``linear_ggml_int8``), and the exact-mode VNNI path's
activation digits and error term
(``activation_digits``, ``fixed_point_term``).
"""
from __future__ import annotations

import numpy as np


def pack_codes(codes, bits: int) -> np.ndarray:
    """Pack integer codes (any signedness) LSB-first into a uint8 payload."""
    codes = np.asarray(codes).reshape(-1).astype(np.int64)
    mask = (1 << bits) - 1
    nbytes = (codes.size * bits + 7) // 8
    out = np.zeros(nbytes, dtype=np.uint8)
    for i, c in enumerate(codes):
        bitpos = i * bits
        out[bitpos // 8] |= np.uint8((int(c) & mask) << (bitpos % 8))
    return out


def unpack_codes(payload, bits: int, signed: bool, count: int) -> np.ndarray:
    """Unpack LSB-first codes one by one (int64 result)."""
    out = np.empty(count, dtype=np.int64)
    mask = (1 << bits) - 1
    for i in range(count):
        bitpos = i * bits
        v = (int(payload[bitpos // 8]) >> (bitpos % 8)) & mask
        if signed and v >= 1 << (bits - 1):
            v -= 1 << bits
        out[i] = v
    return out


def expand_param(p, shape, axis, block_size):
    """Broadcast a per-tensor / per-axis / blocked scale or zero point to ``shape``."""
    p = np.asarray(p)
    if p.size == 1 and not block_size:
        return np.broadcast_to(p.reshape(()), shape)
    if not block_size:
        dims = [1] * len(shape)
        dims[axis] = p.size
        return np.broadcast_to(p.reshape(dims), shape)
    rep = np.repeat(p, block_size, axis=axis)
    return np.take(rep, np.arange(shape[axis]), axis=axis)


def dequantize(codes, scale, zero_point, axis, block_size):
    """DequantizeLinear: float32(q) - float32(zp), times scale, in float32 (ONNX reference order)."""
    codes = np.asarray(codes)
    dx = codes.astype(np.float32)
    if zero_point is not None:
        dx = dx - expand_param(zero_point, codes.shape, axis, block_size).astype(np.float32)
    return (dx * expand_param(scale, codes.shape, axis, block_size).astype(np.float32)).astype(
        np.float32)


def linear(x, w):
    """x @ w.T in float64 (exact enough to judge float32 kernels)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def rms_norm(x, weight, epsilon):
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        ms = np.float32(np.mean(np.float64(x[r]) ** 2))
        rr = np.float32(1) / np.sqrt(ms + np.float32(epsilon))
        out[r] = (x[r] * rr) * weight
    return out


def rotary_embedding(x, cos, sin, interleaved, rotary_dim):
    """x [B, S, NH, D], cos/sin [B, S, R/2]."""
    out = x.copy()
    b_n, s_n, nh, d = x.shape
    half = rotary_dim // 2
    for b in range(b_n):
        for s in range(s_n):
            for h in range(nh):
                for i in range(half):
                    i1, i2 = (2 * i, 2 * i + 1) if interleaved else (i, half + i)
                    x1, x2 = x[b, s, h, i1], x[b, s, h, i2]
                    c, sn = cos[b, s, i], sin[b, s, i]
                    out[b, s, h, i1] = c * x1 - sn * x2
                    out[b, s, h, i2] = sn * x1 + c * x2
    return out


def attention(q, k_cache, v_cache, past_len, scale, is_causal):
    """q [B, S, H, D]; caches [B, KVH, T, D]; float64 softmax attention."""
    b_n, s_n, h_n, d = q.shape
    kvh = k_cache.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for b in range(b_n):
        for h in range(h_n):
            g = h // (h_n // kvh)
            for s in range(s_n):
                nk = past_len + s + 1 if is_causal else past_len + s_n
                if nk <= 0:
                    continue
                sc = np.array([float(np.dot(np.float64(q[b, s, h]), np.float64(k_cache[b, g, j])))
                               * scale for j in range(nk)])
                p = np.exp(sc - sc.max())
                p /= p.sum()
                out[b, s, h] = p @ np.float64(v_cache[b, g, :nk])
    return out


def append_kv(past, new):
    b, kvh, p, d = past.shape
    s = new.shape[1]
    return np.concatenate([past, new.reshape(b, s, kvh, d).transpose(0, 2, 1, 3)], axis=2)



# ------------------------------------------------------------------------------------------------
# ggml block repacking (olv_runtime.kernels.ggml_packed records), as array reshapes
# ------------------------------------------------------------------------------------------------
def _f16bits(blocks, off):
    return np.ascontiguousarray(blocks[..., off:off + 2]).view(np.uint16)[..., 0]


def _nib_chunks(u):
    """u uint8 [ng, 8, nb, 32] codes (< 16) -> nibble bytes [ng, nb, 128]."""
    ng, _, nb, _ = u.shape
    lo = u[..., 0:16].reshape(ng, 8, nb, 4, 4)
    hi = u[..., 16:32].reshape(ng, 8, nb, 4, 4)
    b = (lo & 15) | ((hi & 15) << 4)
    return b.transpose(0, 2, 3, 1, 4).reshape(ng, nb, 128)


def _high_bits(h, bits):
    """h uint8 [ng, 8, nb, 32] high parts (< 2**bits) -> [ng, nb, 32 * bits] bytes."""
    ng, _, nb, _ = h.shape
    per = 8 // bits
    hv = h.reshape(ng, 8, nb, bits, per, 4).astype(np.uint8)   # t = per * v + p
    sh = (np.arange(per, dtype=np.uint8) * bits).reshape(1, 1, 1, 1, per, 1)
    byte = np.bitwise_or.reduce(hv << sh, axis=4)               # [ng, 8, nb, v, 4]
    return byte.transpose(0, 2, 3, 1, 4).reshape(ng, nb, 32 * bits)


def _per_row(a):
    """[ng, 8, nb, ...] per-row values -> [ng, nb, ..., 8] (row innermost)."""
    return np.ascontiguousarray(np.moveaxis(a, 1, a.ndim - 1))


def ggml_records(kind, blocks):
    """olv_runtime.kernels.ggml_packed group records, plain numpy (the layout definition):
    blocks uint8 [ng, 8, nb, type_size] -> records [ng, nb, RECORD_BYTES]."""
    ng, _, nb, _ = blocks.shape
    d = _per_row(_f16bits(blocks, 0 if kind != 14 else 208)).view(np.uint8).reshape(ng, nb, 16)
    if kind == 8:
        q = blocks[..., 2:34].reshape(ng, 8, nb, 8, 4) ^ np.uint8(0x80)   # u = q + 128
        codes = q.transpose(0, 2, 3, 1, 4).reshape(ng, nb, 256)
        return np.concatenate([d, codes], axis=-1)
    if kind == 6:
        qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]
        h = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = blocks[..., 6:22]
        lo = np.concatenate([qs & 15, qs >> 4], axis=-1)
        return np.concatenate([d, _high_bits(h, 1), _nib_chunks(lo)], axis=-1)
    if kind in (3, 7):  # d | m | [Q5_1: high bits] | nibbles
        mm = _per_row(_f16bits(blocks, 2)).view(np.uint8).reshape(ng, nb, 16)
        qs = blocks[..., 4:20] if kind == 3 else blocks[..., 8:24]
        lo = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if kind == 3:
            return np.concatenate([d, mm, _nib_chunks(lo)], axis=-1)
        qh = np.ascontiguousarray(blocks[..., 4:8]).view("<u4")[..., 0]
        h = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        return np.concatenate([d, mm, _high_bits(h, 1), _nib_chunks(lo)], axis=-1)
    if kind in (12, 13):
        dmin = _per_row(_f16bits(blocks, 2)).view(np.uint8).reshape(ng, nb, 16)
        sc = _per_row(blocks[..., 4:16]).reshape(ng, nb, 96)       # byte 8j + r
        q0 = 16 if kind == 12 else 48
        qs = blocks[..., q0:q0 + 128].reshape(ng, 8, nb, 4, 1, 32) >> np.array(
            [0, 4], np.uint8).reshape(1, 1, 1, 1, 2, 1)
        q = (qs & 15).reshape(ng, 8, nb * 8, 32)
        nib = _nib_chunks(q).reshape(ng, nb, 8, 128)
        if kind == 12:
            return np.concatenate([d, dmin, sc, nib.reshape(ng, nb, 1024)], axis=-1)
        # Q5_K: element l of sub-block s has bit s of qh[l]; per sub-block nibbles | high bits
        qh = blocks[..., 16:48].reshape(ng, 8, nb, 1, 32) >> np.arange(
            8, dtype=np.uint8).reshape(1, 1, 1, 8, 1)
        h = (qh & 1).reshape(ng, 8, nb * 8, 32)
        subs = np.concatenate([nib, _high_bits(h, 1).reshape(ng, nb, 8, 32)], axis=-1)
        return np.concatenate([d, dmin, sc, subs.reshape(ng, nb, 1280)], axis=-1)
    # Q6_K
    ql = blocks[..., 0:128].reshape(ng, 8, nb, 2, 1, 64) >> np.array(
        [0, 4], np.uint8).reshape(1, 1, 1, 1, 2, 1)
    lo = (ql & 15).reshape(ng, 8, nb * 8, 32)
    qh = blocks[..., 128:192].reshape(ng, 8, nb, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 1, 4, 1)
    hi = (qh & 3).reshape(ng, 8, nb * 8, 32)
    sc = _per_row(blocks[..., 192:208]).reshape(ng, nb, 128)
    subs = np.concatenate([_nib_chunks(lo).reshape(ng, nb, 8, 128),
                           _high_bits(hi, 2).reshape(ng, nb, 8, 64)], axis=-1)
    return np.concatenate([d, sc, subs.reshape(ng, nb, 1536)], axis=-1)


# ------------------------------------------------------------------------------------------------
# blocked INT4 linears (block 32): the packed kernels' arithmetic (kernels/packed_i8.py,
# packed_f32.py, packed_zp.py, linear.py module docstrings)
# ------------------------------------------------------------------------------------------------
def int4_weight(q, rng=None, scale=None, zero_point=False):
    """A blocked signed-INT4 ``[N, K]`` weight from its codes.

    Parameters
    ----------
    q : ndarray of int, shape [N, K]
        Signed codes in ``[-8, 7]``.
    rng : numpy Generator, optional
        Draws the scales (``U[1e-3, 0.051)`` float32) and, with ``zero_point``, the zero points.
    scale : ndarray of float32 or float16, shape [N, ceil(K/32)], optional
        Given scales instead of random ones.
    zero_point : bool
        Also draw int8 zero points in ``[-8, 7]`` (the first and last set to -8 and 7).

    Returns
    -------
    payload : ndarray of uint8, shape [ceil(N*K/2)]
        Row-major codes, two per byte, low nibble first.
    scale : ndarray, shape [N, ceil(K/32)]
    zp : ndarray of int8, shape [N, ceil(K/32)], or None
    """
    q = np.asarray(q)
    n, k = q.shape
    kb = -(-k // 32)
    u = (q.reshape(-1) & 15).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    payload = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    if scale is None:
        scale = (rng.random((n, kb), dtype=np.float32) * 0.05 + 1e-3).astype(np.float32)
    zp = None
    if zero_point:
        zp = rng.integers(-8, 8, size=(n, kb)).astype(np.int8)
        zp[0, 0], zp[-1, -1] = -8, 7
    return payload, scale, zp


def dequantize_int4(q, scale, zp=None):
    """``W[n, k] = float32(q[n, k] - zp[n, k // 32]) * scale[n, k // 32]`` (float32 [N, K]):
    ``DequantizeLinear(axis=1, block_size=32)``'s values."""
    q = np.asarray(q, np.int64)
    k = q.shape[1]
    z = 0 if zp is None else np.repeat(np.asarray(zp, np.int64), 32, axis=1)[:, :k]
    s = np.repeat(np.asarray(scale).astype(np.float32), 32, axis=1)[:, :k]
    return (q - z).astype(np.float32) * s


def quantize_int8_blocks(x):
    """Symmetric int8 quantization of every 32-block of every row of ``x`` (zero padded).

    ``d = max|x_block| / 127`` (float32), ``xq = clip(rint(x / d), -127, 127)`` (round half to
    even; 0 when ``max|x| == 0``): the activation quantization of the int8 kernels.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K]

    Returns
    -------
    xq : ndarray of int64, shape [M, KB, 32]
    d : ndarray of float32, shape [M, KB]
    """
    m, k = x.shape
    kb = -(-k // 32)
    xp = np.zeros((m, 32 * kb), np.float32)
    xp[:, :k] = x
    xb = xp.reshape(m, kb, 32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.rint(xb / d[:, :, None])
    v = np.where(amax[:, :, None] > 0, np.clip(v, -127, 127), 0).astype(np.int64)
    return v, d


def linear_int4_int8(x, q, scale, zp=None):
    """``y = x @ W.T`` with int8-quantized activations, bitwise as the int8 kernels compute it.

    Per (row i, output n, block b): the exact integer ``S = sum_j (q - zp) xq`` and, blocks in
    order from 0.0, ``y += float32(S) * (float32(scale) * d)`` (float32, no FMA).

    Parameters
    ----------
    x : ndarray of float32, shape [M, K]
    q : ndarray of int, shape [N, K]
        Signed INT4 codes.
    scale : ndarray of float32 or float16, shape [N, ceil(K/32)]
    zp : ndarray of int8, shape [N, ceil(K/32)], optional

    Returns
    -------
    ndarray of float32, shape [M, N]
    """
    m, k = x.shape
    n = q.shape[0]
    kb = -(-k // 32)
    qp = np.zeros((n, 32 * kb), np.int64)
    qp[:, :k] = q
    qb = qp.reshape(n, kb, 32)
    v, d = quantize_int8_blocks(x)
    s = np.einsum("mbj,nbj->mnb", v, qb)  # exact int64 block sums
    if zp is not None:
        s = s - np.asarray(zp, np.int64)[None, :, :] * v.sum(axis=2)[:, None, :]
    sc = np.asarray(scale).astype(np.float32)
    y = np.zeros((m, n), np.float32)
    for b in range(kb):
        y += s[:, :, b].astype(np.float32) * (sc[None, :, b] * d[:, None, b])
    return y


def linear_int4_exact(x, q, scale, zp=None):
    """float64 ``x @ W.T`` of the dequantized weight (:func:`dequantize_int4`): the reference of
    the float32-activation (exact-mode) kernels, within :func:`exact_bound`."""
    w = dequantize_int4(q, scale, zp).astype(np.float64)
    return np.asarray(x, np.float64) @ w.T


def exact_bound(x, w):
    """The exact-mode tolerance ``1e-5 * sum_k |x_k W_nk| + 1e-6`` (float64 [M, N]) for ``x``
    [M, K] and the dequantized ``w`` [N, K]."""
    return 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T) + 1e-6


def linear_int8_float64(x, w):
    """float64 ``x_q @ W.T`` with ``x`` quantized per 32-block (:func:`quantize_int8_blocks`,
    ``x_q = xq * d``) and a float weight ``w`` [N, K] (K a multiple of 32): the int8-activation
    kernels of any weight format (ggml blocks) up to the float32 rounding of their per-block
    combination (their integer sums are exact)."""
    m, k = x.shape
    xq, d = quantize_int8_blocks(x)
    wb = np.asarray(w, np.float64).reshape(w.shape[0], k // 32, 32)
    return np.einsum("mbj,nbj,mb->mn", xq.astype(np.float64), wb, d.astype(np.float64))


def _ggml_codes(kind, blocks):
    """ggml blocks uint8 [N, nb, type_size] -> signed integer codes int64 [N, nb * block_size]
    (Q8_0 ``q``, Q5_0 ``u - 16``, Q4_1 / Q4_K ``q`` (0..15), Q5_1 / Q5_K ``q`` (0..31), Q6_K
    ``u - 32``) as gguf-py defines them."""
    n, nb, _ = blocks.shape
    if kind == 8:
        return blocks[..., 2:34].view(np.int8).astype(np.int64).reshape(n, -1)
    if kind == 6:
        qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]
        h = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)
        qs = blocks[..., 6:22].astype(np.int64)
        lo = np.concatenate([qs & 15, qs >> 4], axis=-1)
        return (lo | (h << 4)).reshape(n, -1) - 16
    if kind in (3, 7):
        qs = (blocks[..., 4:20] if kind == 3 else blocks[..., 8:24]).astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if kind == 7:
            qh = np.ascontiguousarray(blocks[..., 4:8]).view("<u4")[..., 0]
            q = q | (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)
                     << 4)
        return q.reshape(n, -1)
    if kind in (12, 13):
        q0 = 16 if kind == 12 else 48
        qs = blocks[..., q0:q0 + 128].reshape(n, nb, 4, 1, 32).astype(np.int64) >> np.array(
            [0, 4]).reshape(1, 1, 1, 2, 1)
        q = (qs & 15).reshape(n, nb, 8, 32)
        if kind == 13:  # element l of sub-block s: bit s of qh[l]
            qh = blocks[..., 16:48].reshape(n, nb, 1, 32).astype(np.int64) >> np.arange(
                8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1) << 4)
        return q.reshape(n, -1)
    ql = blocks[..., 0:128].reshape(n, nb, 2, 1, 64).astype(np.int64) >> np.array(
        [0, 4]).reshape(1, 1, 1, 2, 1)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32).astype(np.int64) >> np.array(
        [0, 2, 4, 6]).reshape(1, 1, 1, 4, 1)
    return ((ql & 15).reshape(n, nb, 8, 32) | ((qh & 3).reshape(n, nb, 8, 32) << 4)).reshape(
        n, -1) - 32


def linear_ggml_int8(kind, blocks, x):
    """``y = x @ W.T`` for ggml blocks (type id ``kind``: 8 Q8_0, 6 Q5_0, 3 Q4_1, 7 Q5_1, 12 Q4_K,
    13 Q5_K, 14 Q6_K) with
    int8-quantized activations (:func:`quantize_int8_blocks`), bitwise as
    kernels/ggml_packed.py's int8 kernels compute it (module docstring there): exact integer
    sums per 32-block (Q6_K per 16), then per 32-block ``b`` in order from 0.0, float32, no FMA:

    * Q8_0, Q5_0: ``y += float32(S) * (d * d_x)``
    * Q4_1, Q5_1: ``y += float32(S) * (d * d_x) + m * (d_x * float32(sum xq))``
    * Q4_K, Q5_K: ``y += ((d sc_b) float32(S) - (dmin m_b) float32(sum xq)) * d_x``
    * Q6_K: ``y += float32(sc_0 S_0 + sc_1 S_1) * (d * d_x)`` (``S_h`` over 16 codes)

    Parameters
    ----------
    kind : int
    blocks : ndarray of uint8, shape [N, K / block_size, type_size]
    x : ndarray of float32, shape [M, K]

    Returns
    -------
    ndarray of float32, shape [M, N]
    """
    n, nb, _ = blocks.shape
    m, k = x.shape
    xq, dx = quantize_int8_blocks(x)                      # [m, kb, 32], [m, kb]
    q = _ggml_codes(kind, blocks)                         # [n, k]

    def f16(off):
        return _f16bits(blocks, off).view(np.float16).astype(np.float32)  # [n, nb]
    y = np.zeros((m, n), np.float32)
    if kind in (6, 8):
        d = f16(0)
        s = np.einsum("mbj,nbj->mnb", xq, q.reshape(n, nb, 32))
        for b in range(nb):
            y += s[:, :, b].astype(np.float32) * (d[None, :, b] * dx[:, None, b])
        return y
    if kind in (3, 7):
        d, mm = f16(0), f16(2)
        s = np.einsum("mbj,nbj->mnb", xq, q.reshape(n, nb, 32))
        sx = xq.sum(axis=2).astype(np.float32)                                   # [m, kb]
        for b in range(nb):
            y += (s[:, :, b].astype(np.float32) * (d[None, :, b] * dx[:, None, b])
                  + mm[None, :, b] * (dx[:, b, None] * sx[:, b, None]))
        return y
    if kind in (12, 13):
        d, dmin = f16(0), f16(2)
        sb = blocks[..., 4:16].astype(np.int64)
        d_, m_, md = sb[..., 0:4], sb[..., 4:8], sb[..., 8:12]
        sc = np.concatenate([d_ & 63, (md & 15) | ((d_ >> 2) & 0x30)], axis=-1)  # [n, nb, 8]
        mn = np.concatenate([m_ & 63, (md >> 4) | ((m_ >> 2) & 0x30)], axis=-1)
        big_d = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)           # [n, kb]
        big_m = (dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
        s = np.einsum("mbj,nbj->mnb", xq, q.reshape(n, k // 32, 32))
        sx = xq.sum(axis=2).astype(np.float32)                                   # [m, kb]
        for b in range(k // 32):
            f = (big_d[None, :, b] * s[:, :, b].astype(np.float32)
                 - big_m[None, :, b] * sx[:, b, None])
            y += f * dx[:, b, None]
        return y
    d = f16(208)
    sc = blocks[..., 192:208].view(np.int8).astype(np.int64).reshape(n, -1)     # [n, k / 16]
    s16 = np.einsum("mhj,nhj->mnh", xq.reshape(m, k // 16, 16), q.reshape(n, k // 16, 16))
    tot = s16 * sc[None]
    for b in range(k // 32):
        t = (tot[:, :, 2 * b] + tot[:, :, 2 * b + 1]).astype(np.float32)
        y += t * (d[None, :, b // 8] * dx[:, b, None])
    return y


def fixed_point_term(x64, w64):
    """2^-30 * sum_b max_{k in b}|x_k| * sum_{k in b}|W_nk| (the VNNI path's representation
    error bound: activations in 31-bit fixed point relative to their block's largest)."""
    m, k = x64.shape
    kb = -(-k // 32)
    xm = np.zeros((m, kb))
    wa = np.zeros((w64.shape[0], kb))
    for b in range(kb):
        xm[:, b] = np.abs(x64[:, 32 * b:32 * b + 32]).max(axis=1)
        wa[:, b] = np.abs(w64[:, 32 * b:32 * b + 32]).sum(axis=1)
    return 2.0 ** -30 * (xm @ wa.T)


def activation_digits(x):
    """The exact-mode VNNI path's activation digits of one block (kernels/packed_f32_vnni.py
    module docstring), computed independently in float64 / int64.

    Parameters
    ----------
    x : ndarray of float32, shape [<= 32]
        One block (zero padded to 32).

    Returns
    -------
    D : ndarray of int64, shape [4, 32]
        The balanced base-256 digits ``D0..D3`` of ``X = rint(x * 2^(30 - E))``.
    xsc : float32 or None
        ``2^(E - 30)`` (None where it would underflow: ``e < 8``).
    """
    xb = np.zeros(32, np.float32)
    xb[:x.size] = x
    bits = xb.view(np.uint32) & 0x7FFFFFFF
    e = max(int(bits.max() >> 23), 1)
    big = 2.0 ** (30 - (e - 126))
    X = np.rint(xb.astype(np.float64) * big).astype(np.int64)
    D = []
    for _ in range(3):
        d = ((X + 128) & 255) - 128
        D.append(d)
        X = (X - d) >> 8
    D.append(X)
    return np.stack(D), np.float32(2.0 ** (e - 156)) if e >= 8 else None
