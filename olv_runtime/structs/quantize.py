"""Weight quantizers used by the converter (pure numpy, vectorized).

The INT4 format is the one of ``docs/qwen_graph.md``: symmetric blocks of 32 along the input
axis (Q4_0 arithmetic), codes in [-8, 7] packed row-major, two per byte, low nibble first,
matching the built-in affine layout (``DequantizeLinear`` with ``axis=1``, ``block_size=32``,
no zero point).
"""
from __future__ import annotations

import numpy as np

from olv_runtime.proto.helper import pack_codes  # noqa: F401  (re-exported: the converter packs with it)

__all__ = ["pack_codes", "quantize_int4_blockwise", "dequantize_int4_blockwise"]

# Rows of a weight processed at once are chosen so a chunk holds about this many elements
# (a few float32 temporaries of 16 MB each).
_CHUNK_ELEMENTS = 1 << 22


def _quantize_rows(w: np.ndarray, block_size: int, scale_dtype=np.float32):
    """Quantize a [R, K] float32 chunk. Returns (codes int8 [R, K], scale [R, nb] of
    ``scale_dtype``; the codes are rounded against the stored scale)."""
    r, k = w.shape
    nb = -(-k // block_size)
    kp = nb * block_size
    if kp != k:
        wp = np.zeros((r, kp), dtype=np.float32)
        wp[:, :k] = w
    else:
        wp = np.ascontiguousarray(w, dtype=np.float32)
    blocks = wp.reshape(r, nb, block_size)
    # Signed element of largest magnitude: the first one in the block on ties (as llama.cpp).
    idx = np.argmax(np.abs(blocks), axis=2)
    m = np.take_along_axis(blocks, idx[:, :, None], axis=2)[:, :, 0]
    d = (m / np.float32(-8.0)).astype(np.float32)
    if np.dtype(scale_dtype) == np.float16:
        with np.errstate(over="ignore"):
            d16 = d.astype(np.float16)
        bad = ~np.isfinite(d16) & np.isfinite(d)
        if bad.any():
            i = np.argwhere(bad)[0]
            raise ValueError(
                f"quantize_int4_blockwise: block scale {float(d[tuple(i)]):.6g} (row {int(i[0])}, "
                f"block {int(i[1])}) overflows float16 (max 65504); use float32 scales")
        d = d16.astype(np.float32)  # the codes are rounded against the scale actually stored
    nz = d != 0
    safe_d = np.where(nz, d, np.float32(1.0))
    q = np.rint(blocks / safe_d[:, :, None])
    np.clip(q, -8, 7, out=q)
    q = q.astype(np.int8)
    q[~nz] = 0
    d = np.where(nz, d, np.float32(0.0)).astype(scale_dtype)
    return q.reshape(r, kp)[:, :k], d


def quantize_int4_blockwise(w: np.ndarray, block_size: int = 32,
                            scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a weight to symmetric INT4 with one scale per block along axis 1.

    For each row ``n`` and block ``b`` (elements ``k`` in ``[b*block_size, (b+1)*block_size)``,
    the last block possibly partial): ``m`` is the element of largest ``|value|`` (signed; the
    first on ties), the scale is ``d = m / -8`` (rounded to float16 when ``scale_dtype`` is
    float16) and the codes are ``q = clip(round_half_to_even(x / d), -8, 7)`` with that stored
    ``d`` (``d == 0`` gives ``q = 0`` and scale 0). Decoding is ``x ≈ q * d`` (float32 product).

    Parameters
    ----------
    w : numpy.ndarray
        Float weight ``[N, K]`` (converted to float32).
    block_size : int, default 32
        Block length along axis 1.
    scale_dtype : numpy dtype, default float32
        float32, or float16 (4.5 bits per weight with block 32, the bytes of GGUF Q4_0).

    Returns
    -------
    payload : numpy.ndarray
        ``uint8`` array of ``ceil(N*K / 2)`` bytes: codes row-major over ``[N, K]``
        (element ``e = n*K + k``), two per byte, even ``e`` in the low nibble, two's complement;
        an unused final high nibble is zero.
    scale : numpy.ndarray
        ``scale_dtype`` ``[N, ceil(K / block_size)]``.

    Raises
    ------
    ValueError
        If ``w`` is not 2-D, ``block_size`` is not positive, ``scale_dtype`` is neither float32
        nor float16, or a float16 scale would overflow.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_int4_blockwise: expected a 2-D weight, got shape {w.shape}")
    if block_size <= 0:
        raise ValueError(f"quantize_int4_blockwise: block_size must be positive, got {block_size}")
    if np.dtype(scale_dtype) not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise ValueError(f"quantize_int4_blockwise: scale_dtype must be float32 or float16, got "
                         f"{np.dtype(scale_dtype)}")
    n, k = w.shape
    nb = -(-k // block_size) if k else 0
    payload = np.zeros(-(-n * k // 2), dtype=np.uint8)
    scale = np.zeros((n, nb), dtype=scale_dtype)
    if n == 0 or k == 0:
        return payload, scale
    # An even number of rows per chunk keeps every chunk's codes byte-aligned in the payload.
    rows = max(2, (_CHUNK_ELEMENTS // max(k, 1)) & ~1)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        chunk = np.asarray(w[r0:r1], dtype=np.float32)
        q, d = _quantize_rows(chunk, block_size, scale_dtype)
        scale[r0:r1] = d
        packed = pack_codes(q, 4)
        b0 = (r0 * k) // 2  # r0 is even, so r0*k is even
        payload[b0 : b0 + packed.size] = packed
    return payload, scale


def dequantize_int4_blockwise(
    payload: np.ndarray, scale: np.ndarray, shape: tuple[int, int], block_size: int = 32
) -> np.ndarray:
    """Decode the output of :func:`quantize_int4_blockwise` back to float32 ``[N, K]``.

    Parameters
    ----------
    payload : numpy.ndarray or bytes
        Packed signed 4-bit codes (row-major, low nibble first).
    scale : numpy.ndarray
        float32 ``[N, ceil(K / block_size)]``.
    shape : tuple of int
        ``(N, K)``.
    block_size : int, default 32

    Returns
    -------
    numpy.ndarray
        float32 ``[N, K]`` with ``x[n, k] = q[n, k] * scale[n, k // block_size]``.
    """
    n, k = shape
    p = np.frombuffer(bytes(payload), dtype=np.uint8) if isinstance(payload, bytes) else payload
    p = np.asarray(p, dtype=np.uint8)
    nib = np.empty(p.size * 2, dtype=np.int8)
    nib[0::2] = (p & 0x0F).astype(np.int8)
    nib[1::2] = (p >> 4).astype(np.int8)
    nib = np.where(nib >= 8, nib - 16, nib).astype(np.int8)
    q = nib[: n * k].reshape(n, k).astype(np.float32)
    s = np.repeat(np.asarray(scale, dtype=np.float32), block_size, axis=1)[:, :k]
    return q * s
