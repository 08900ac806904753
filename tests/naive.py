"""Slow, obvious numpy references for olv_runtime.kernels (no numba).

Each function follows the ONNX operator definition directly (loops and plain numpy), so it can
serve as an oracle independent of the kernels' layout tricks.
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

