"""Linear layers ``y = x @ W.T`` with a float32 or a blocked INT4 weight ``W`` of shape [N, K].

Source: ONNX ``MatMul(x, Transpose(DequantizeLinear(W, scale, zero_point, axis=1,
block_size)))`` — the fused pattern of docs/qwen_graph.md. The INT4 weight is read in its stored
row-major layout (two codes per byte, low nibble first) and never materialised.

INT4 kernel design
------------------
* Parallel over output features ``N``: the rows are split into contiguous row ranges, one
  ``prange`` task each; every task owns a slice of a per-call workspace (no allocation in loops).
* For each weight row and each ``block_size`` block, the block is decoded once into the task's
  workspace, ``w = float32(q - zp) * scale`` (exactly the values of
  :func:`~olv_runtime.kernels.affine.dequantize_affine`), and reused for all ``M`` activation rows.
* Accumulation uses one float32 accumulator *per position inside a block* (``acc[m, p]``), summed
  in a fixed order at the end of the row. These are vertical (element-wise) updates, so LLVM
  vectorises them without ``fastmath`` reassociation, and the result is deterministic and
  independent of the thread count.
* Fast path (``K`` and ``block_size`` even): rows and blocks start on byte boundaries; low and
  high nibbles are kept apart and paired with de-interleaved activations (``x[:, 0::2]`` and
  ``x[:, 1::2]``, prepared once per call) so all loads are contiguous. General path otherwise
  (rows may start mid-byte): element-wise code extraction.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numpy.lib.stride_tricks import as_strided

from .affine import check_int4_matrix
from .config import JIT, PJIT, check_array, check_out
from .half import scale_bits, widen

__all__ = ["linear_int4", "linear_f32"]


# ------------------------------------------------------------------------------------------------
# serial kernels (rows [r0, r1) of W against all M rows of x)
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _rows_int4_even(xe3, xo3, xet, xot, p3, pt, scale, zp, has_zp, r0, r1, y, we, wo, acc):
    """Rows ``r0..r1-1`` of W when K and block_size are even.

    p3: [N, KBf, bs/2] bytes of the full blocks; pt: [N, tl] bytes of the partial last block
    (tl may be 0). xe3/xo3: [M, KBf, bs/2] even/odd activations; xet/xot: [M, tl].
    we/wo: [bs/2] decoded low/high nibbles of one block; acc: [M, bs] per-position accumulators.
    All inner loops start at 0 (no negative-index wraparound checks) and store to separate
    arrays, so LLVM vectorises both the decode and the accumulation.
    """
    m_rows = xe3.shape[0]
    kbf = p3.shape[1]
    hb = p3.shape[2]
    tl = pt.shape[1]
    for r in range(r0, r1):
        for m in range(m_rows):
            for j in range(2 * hb):
                acc[m, j] = 0.0
        for b in range(kbf):
            s = widen(scale[r, b])
            z = np.int32(zp[r, b]) if has_zp else np.int32(0)
            for j in range(hb):
                v = p3[r, b, j]
                lo = ((v & 15) ^ 8) - 8
                hi = ((v >> 4) ^ 8) - 8
                we[j] = np.float32(lo - z) * s
                wo[j] = np.float32(hi - z) * s
            for m in range(m_rows):
                for j in range(hb):
                    acc[m, j] += we[j] * xe3[m, b, j]
                for j in range(hb):
                    acc[m, hb + j] += wo[j] * xo3[m, b, j]
        if tl > 0:
            s = widen(scale[r, kbf])
            z = np.int32(zp[r, kbf]) if has_zp else np.int32(0)
            for j in range(tl):
                v = pt[r, j]
                lo = ((v & 15) ^ 8) - 8
                hi = ((v >> 4) ^ 8) - 8
                we[j] = np.float32(lo - z) * s
                wo[j] = np.float32(hi - z) * s
            for m in range(m_rows):
                for j in range(tl):
                    acc[m, j] += we[j] * xet[m, j]
                for j in range(tl):
                    acc[m, hb + j] += wo[j] * xot[m, j]
        for m in range(m_rows):
            t = np.float32(0.0)
            for j in range(2 * hb):
                t += acc[m, j]
            y[m, r] = t


@njit(**JIT)
def _rows_int4_general(x, payload, scale, zp, has_zp, k, bs, r0, r1, y, w, acc):
    """Rows ``r0..r1-1`` of W for any K and block_size (codes extracted one by one).

    w: [bs] decoded block; acc: [M, bs] per-position accumulators.
    """
    m_rows = x.shape[0]
    kb = scale.shape[1]
    for r in range(r0, r1):
        for m in range(m_rows):
            for p in range(bs):
                acc[m, p] = 0.0
        for b in range(kb):
            s = widen(scale[r, b])
            z = np.int32(zp[r, b]) if has_zp else np.int32(0)
            k0 = b * bs
            ln = min(bs, k - k0)
            c0 = r * k + k0
            for p in range(ln):
                idx = c0 + p
                v = (np.int32(payload[idx >> 1]) >> np.int32((idx & 1) * 4)) & np.int32(15)
                v = (v ^ np.int32(8)) - np.int32(8)
                w[p] = np.float32(v - z) * s
            for m in range(m_rows):
                for p in range(ln):
                    acc[m, p] += w[p] * x[m, k0 + p]
        for m in range(m_rows):
            t = np.float32(0.0)
            for p in range(bs):
                t += acc[m, p]
            y[m, r] = t


# ------------------------------------------------------------------------------------------------
# parallel drivers: prange over contiguous row ranges, one workspace slice per task
# ------------------------------------------------------------------------------------------------
@njit(**PJIT)
def _linear_int4_even_par(xe3, xo3, xet, xot, p3, pt, scale, zp, has_zp, y, wbuf, accbuf):
    ntasks = wbuf.shape[0]
    n = p3.shape[0]
    hb = p3.shape[2]
    for t in prange(ntasks):
        _rows_int4_even(xe3, xo3, xet, xot, p3, pt, scale, zp, has_zp,
                        t * n // ntasks, (t + 1) * n // ntasks, y,
                        wbuf[t, 0], wbuf[t, 1], accbuf[t])


@njit(**PJIT)
def _linear_int4_general_par(x, payload, scale, zp, has_zp, n, k, bs, y, wbuf, accbuf):
    ntasks = wbuf.shape[0]
    for t in prange(ntasks):
        _rows_int4_general(x, payload, scale, zp, has_zp, k, bs,
                           t * n // ntasks, (t + 1) * n // ntasks, y, wbuf[t, 0], accbuf[t])


# ------------------------------------------------------------------------------------------------
# public wrappers
# ------------------------------------------------------------------------------------------------
_TASKS_PER_THREAD = 8


def linear_int4(x: np.ndarray, payload: np.ndarray, scale: np.ndarray,
                zero_point: np.ndarray | None, n: int, k: int, block_size: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """``y = x @ W.T`` with ``W`` a blocked signed-INT4 ``[N, K]`` matrix (never materialised).

    ``W[n, k] = float32(q[n, k] - zp[n, k // block_size]) * scale[n, k // block_size]``, the
    values ONNX ``DequantizeLinear(axis=1, block_size)`` gives (see
    :func:`~olv_runtime.kernels.affine.dequantize_affine`); then ONNX ``MatMul`` semantics with
    float32 accumulation (summation order differs from BLAS: relative error ~1e-6 of
    ``|x| @ |W|.T``).

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    payload : ndarray of uint8, shape [>= ceil(N*K/2)]
        INT4 codes of ``W`` row-major, low nibble first (code of ``(n, k)`` is number
        ``n*K + k``).
    scale : ndarray of float32 or float16, shape [N, ceil(K/block_size)]
    zero_point : ndarray of int8, shape [N, ceil(K/block_size)], or None (symmetric)
    n, k : int
        ``N`` (output features) and ``K`` (input features).
    block_size : int
        Quantization block length along K (the last block may be partial).
    out : ndarray of float32, shape [M, N], optional

    Returns
    -------
    ndarray of float32, shape [M, N]
    """
    n, k, block_size, zp = check_int4_matrix(payload, scale, zero_point, n, k, block_size)
    scale = scale_bits(scale)  # float16: its uint16 bits, widened per read (kernels/half.py)
    check_array(x, "x", dtype=np.float32, shape=(None, k))
    m = x.shape[0]
    out = check_out(out, "out", np.float32, (m, n))
    if m == 0:
        return out
    ntasks = max(1, min(n, _TASKS_PER_THREAD * numba.get_num_threads()))
    has_zp = zero_point is not None
    accbuf = np.empty((ntasks, m, block_size), dtype=np.float32)
    if k % 2 == 0 and block_size % 2 == 0:
        hk, hb = k // 2, block_size // 2
        kbf = k // block_size
        wbuf = np.empty((ntasks, 2, hb), dtype=np.float32)
        p2 = payload[: n * hk].reshape(n, hk)
        p3 = as_strided(p2, (n, kbf, hb), (hk, hb, 1), writeable=False)
        xe = np.ascontiguousarray(x[:, 0::2])
        xo = np.ascontiguousarray(x[:, 1::2])
        xe3 = as_strided(xe, (m, kbf, hb), (4 * hk, 4 * hb, 4), writeable=False)
        xo3 = as_strided(xo, (m, kbf, hb), (4 * hk, 4 * hb, 4), writeable=False)
        j0 = kbf * hb
        _linear_int4_even_par(xe3, xo3, xe[:, j0:], xo[:, j0:], p3, p2[:, j0:], scale, zp,
                              has_zp, out, wbuf, accbuf)
    else:
        wbuf = np.empty((ntasks, 1, block_size), dtype=np.float32)
        _linear_int4_general_par(x, payload, scale, zp, has_zp, n, k, block_size, out,
                                 wbuf, accbuf)
    return out


def linear_f32(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``y = x @ w.T`` for a dense float32 weight (ONNX ``MatMul(x, Transpose(w))``), via BLAS.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    w : ndarray of float32, shape [N, K], C-contiguous
    out : ndarray of float32, shape [M, N], optional

    Returns
    -------
    ndarray of float32, shape [M, N]
    """
    check_array(w, "w", dtype=np.float32, ndim=2)
    n, k = w.shape
    check_array(x, "x", dtype=np.float32, shape=(None, k))
    out = check_out(out, "out", np.float32, (x.shape[0], n))
    np.matmul(x, w.T, out=out)
    return out
