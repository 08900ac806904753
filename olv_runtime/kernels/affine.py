"""Built-in affine decoder: ONNX ``DequantizeLinear`` over row-major packed integer codes.

Source: ONNX operator ``DequantizeLinear`` (opset 21+ semantics: per-tensor, per-axis and blocked
quantization) applied to the seed 000 affine layout, whose codes are stored packed, least
significant bits first (2, 4 or 8 bits per code, two's complement when signed).

Arithmetic (replicates ``onnx/reference/ops/op_dequantize_linear.py`` bit for bit)::

    y = float32(q - zero_point) * float32(scale)

``q - zero_point`` is computed in int32 (exact; the reference computes ``float32(q) -
float32(zp)``, which is the same value because every operand is a small integer), then one float32
multiply rounds once, exactly as the reference's ``dx * scale``. A float16 scale is widened to
float32 first (exact); the result is float32. (The reference then casts to the scale's dtype; for
a float16 scale ``result.astype(np.float16)`` is bit-identical to it.)

Three tiers: serial ``@njit`` code decoders, ``@njit(parallel=True)`` drivers with ``prange``, and
the public wrappers :func:`unpack_codes`, :func:`dequantize_affine`, :func:`gather_rows_int4` that
validate arguments and allocate outputs.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from olv_runtime.errors import InvalidArgument

from .config import JIT, PARALLEL_MIN_WORK, PJIT, check_array, check_int, check_out
from .half import scale_bits, widen

__all__ = ["unpack_codes", "dequantize_affine", "gather_rows_int4"]

_CHUNK = 16384  # codes per parallel task


# ------------------------------------------------------------------------------------------------
# serial kernels
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _code_at(payload, bits, signed, idx):
    """Code number ``idx`` (0-based) of a packed LSB-first stream, sign-extended if signed."""
    bitpos = idx * bits
    v = (np.int32(payload[bitpos >> 3]) >> np.int32(bitpos & 7)) & np.int32((1 << bits) - 1)
    if signed:
        half = np.int32(1 << (bits - 1))
        v = (v ^ half) - half
    return v


@njit(**JIT)
def _unpack_range(payload, bits, signed, start, stop, out):
    for i in range(start, stop):
        out[i] = _code_at(payload, bits, signed, i)


@njit(**JIT)
def _dequant_range(payload, bits, signed, f0, f1, inner, dim, bs, scale, s_st, zp, z_st, out):
    """Decoded elements ``out[f0:f1]`` (float32) of an affine-quantized tensor viewed as
    ``[outer, dim, inner]``: ``(code - zp) * scale`` with the scale and zero point of block
    ``d // bs`` along ``dim``; ``s_st = (s_o, s_d, s_i)`` and ``z_st = (z_o, z_d, z_i)`` the
    element strides (int) of the flat ``scale`` and ``zp`` arrays per (outer, block, inner)
    index."""
    s_o, s_d, s_i = s_st
    z_o, z_d, z_i = z_st
    i = f0 % inner
    t = f0 // inner
    d = t % dim
    o = t // dim
    for f in range(f0, f1):
        q = _code_at(payload, bits, signed, f)
        db = d // bs
        z = zp[o * z_o + db * z_d + i * z_i]
        out[f] = np.float32(q - z) * widen(scale[o * s_o + db * s_d + i * s_i])
        i += 1
        if i == inner:
            i = 0
            d += 1
            if d == dim:
                d = 0
                o += 1


@njit(**JIT)
def _gather_row_int4(payload, scale, zp, has_zp, n, k, bs, out_row):
    kb = scale.shape[1]
    for b in range(kb):
        s = widen(scale[n, b])
        z = np.int32(zp[n, b]) if has_zp else np.int32(0)
        k0 = b * bs
        k1 = min(k0 + bs, k)
        for kk in range(k0, k1):
            idx = n * k + kk
            v = (np.int32(payload[idx >> 1]) >> np.int32((idx & 1) * 4)) & np.int32(15)
            v = (v ^ np.int32(8)) - np.int32(8)
            out_row[kk] = np.float32(v - z) * s


# ------------------------------------------------------------------------------------------------
# parallel drivers
# ------------------------------------------------------------------------------------------------
@njit(**PJIT)
def _unpack_codes_par(payload, bits, signed, count, out):
    nchunks = (count + _CHUNK - 1) // _CHUNK
    for c in prange(nchunks):
        f0 = c * _CHUNK
        _unpack_range(payload, bits, signed, f0, min(f0 + _CHUNK, count), out)


@njit(**PJIT)
def _dequant_par(payload, bits, signed, inner, dim, bs,
                 scale, s_o, s_d, s_i, zp, z_o, z_d, z_i, out):
    total = out.size
    nchunks = (total + _CHUNK - 1) // _CHUNK
    for c in prange(nchunks):
        f0 = c * _CHUNK
        _dequant_range(payload, bits, signed, f0, min(f0 + _CHUNK, total), inner, dim, bs,
                       scale, (s_o, s_d, s_i), zp, (z_o, z_d, z_i), out)


@njit(**PJIT)
def _gather_int4_par(payload, scale, zp, has_zp, n_rows, k, bs, ids, out):
    for r in prange(ids.shape[0]):
        n = ids[r]
        if n < 0:
            n += n_rows
        _gather_row_int4(payload, scale, zp, has_zp, n, k, bs, out[r])


@njit(**JIT)
def _gather_int4_ser(payload, scale, zp, has_zp, n_rows, k, bs, ids, out):
    for r in range(ids.shape[0]):
        n = ids[r]
        if n < 0:
            n += n_rows
        _gather_row_int4(payload, scale, zp, has_zp, n, k, bs, out[r])


# ------------------------------------------------------------------------------------------------
# public wrappers
# ------------------------------------------------------------------------------------------------
def _check_bits(bits, signed):
    bits = check_int(bits, "bits")
    if bits not in (2, 4, 8):
        raise InvalidArgument(f"bits: expected 2, 4 or 8, got {bits}")
    if not isinstance(signed, (bool, np.bool_)):
        raise InvalidArgument(f"signed: expected a bool, got {type(signed).__name__}")
    return bits, bool(signed)


def _check_payload(payload, count, bits):
    check_array(payload, "payload", dtype=np.uint8, ndim=1)
    need = (count * bits + 7) // 8
    if payload.shape[0] < need:
        raise InvalidArgument(
            f"payload: expected at least {need} bytes for {count} codes of {bits} bits, "
            f"got {payload.shape[0]} bytes")


def unpack_codes(payload: np.ndarray, bits: int, signed: bool, count: int, out=None) -> np.ndarray:
    """Unpack ``count`` integer codes packed least-significant-bits first.

    Parameters
    ----------
    payload : ndarray of uint8, shape [nbytes], C-contiguous
        Packed codes; code ``i`` occupies bits ``[i*bits, (i+1)*bits)`` of the little-endian bit
        stream (for 4 bits: low nibble first). Needs ``nbytes >= ceil(count*bits/8)``.
    bits : int
        2, 4 or 8.
    signed : bool
        Two's complement codes (INT2 -2..1, INT4 -8..7, INT8 -128..127) when True, else unsigned
        (0..2**bits-1).
    count : int
        Number of codes.
    out : ndarray, shape [count], optional
        Output buffer (int8 if signed else uint8).

    Returns
    -------
    ndarray of int8 (signed) or uint8 (unsigned), shape [count]
        The codes. Unsigned codes come back as uint8 so that UINT8 values 128..255 are exact.
    """
    bits, signed = _check_bits(bits, signed)
    count = check_int(count, "count", lo=0)
    _check_payload(payload, count, bits)
    out = check_out(out, "out", np.int8 if signed else np.uint8, (count,))
    if count:
        _unpack_codes_par(payload, bits, signed, count, out)
    return out


_CODE_RANGE = {(2, True): (-2, 1), (4, True): (-8, 7), (8, True): (-128, 127),
               (2, False): (0, 3), (4, False): (0, 15), (8, False): (0, 255)}


def dequantize_affine(payload: np.ndarray, bits: int, signed: bool, shape: tuple,
                      scale: np.ndarray, zero_point: np.ndarray | None = None,
                      axis: int | None = 1, block_size: int | None = None,
                      out=None) -> np.ndarray:
    """ONNX ``DequantizeLinear`` (opset 21+) of a row-major packed code tensor.

    Parameters
    ----------
    payload : ndarray of uint8, shape [nbytes], C-contiguous
        Codes of the tensor ``x`` of shape ``shape`` in row-major order, packed LSB-first
        (see :func:`unpack_codes`).
    bits : int
        2, 4 or 8 bits per code.
    signed : bool
        INTn (two's complement) when True, UINTn otherwise.
    shape : tuple of int
        Logical shape of ``x`` and of the output.
    scale : ndarray of float32 or float16
        Per-tensor: a scalar (or one element). Per-axis: 1-D of length ``shape[axis]``.
        Blocked (``block_size`` > 0): same rank as ``x``, equal dims except
        ``scale.shape[axis] == ceil(shape[axis] / block_size)`` (the last block may be partial).
    zero_point : ndarray of integers, optional
        Same shape as ``scale``; values inside the code range. None means 0.
    axis : int, optional
        Quantization axis for per-axis / blocked modes (negative counts from the end; ONNX
        default 1). Ignored for per-tensor.
    block_size : int, optional
        Block length along ``axis`` (blocked mode); None or 0 for per-tensor / per-axis.
    out : ndarray of float32, shape ``shape``, optional
        Output buffer (C-contiguous).

    Returns
    -------
    ndarray of float32, shape ``shape``
        ``float32(q - zero_point) * scale``: bit-identical to ``onnx.reference``
        DequantizeLinear for a float32 scale; for a float16 scale, bit-identical after
        ``.astype(np.float16)``.
    """
    bits, signed = _check_bits(bits, signed)
    try:
        shape = tuple(int(check_int(s, "shape", lo=0)) for s in shape)
    except TypeError:
        raise InvalidArgument(f"shape: expected a tuple of ints, got {shape!r}") from None
    count = math.prod(shape)
    _check_payload(payload, count, bits)
    if isinstance(scale, np.generic):
        scale = np.asarray(scale)
    if not isinstance(scale, np.ndarray):
        raise InvalidArgument(f"scale: expected a numpy.ndarray, got {type(scale).__name__}")
    check_array(scale, "scale", dtype=(np.float32, np.float16), contiguous=False)
    rank = len(shape)
    blocked = block_size is not None and block_size != 0
    if blocked:
        block_size = check_int(block_size, "block_size", lo=1)
    if blocked or scale.size != 1:
        if axis is None:
            raise InvalidArgument("axis: expected an int for per-axis/blocked quantization, got None")
        axis = check_int(axis, "axis", lo=-rank, hi=rank - 1)
        if axis < 0:
            axis += rank
    if blocked:
        # block_size >= shape[axis] is one block (DequantizeLinear); clamp so the int64 kernel
        # arithmetic cannot wrap for block sizes near 2**64 (the wire field is uint64)
        block_size = min(block_size, max(shape[axis], 1))
        exp = list(shape)
        exp[axis] = -(-shape[axis] // block_size)
        check_array(scale, "scale", shape=exp, contiguous=False)
        outer, dim, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
        strides = (exp[axis] * inner, inner, 1)
        bs = block_size
    elif scale.size == 1 and scale.ndim <= 1:
        outer, dim, inner = 1, max(count, 1), 1
        strides = (0, 0, 0)
        bs = 1
    else:
        check_array(scale, "scale", shape=(shape[axis],), contiguous=False)
        outer, dim, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
        strides = (0, 1, 0)
        bs = 1
    scale32 = scale_bits(np.ascontiguousarray(scale)).reshape(-1)  # float16: bits, widened per read
    if zero_point is None:
        zp32 = np.zeros(1, dtype=np.int32)
        zstrides = (0, 0, 0)
    else:
        if not isinstance(zero_point, np.ndarray) or zero_point.dtype.kind not in "iu":
            raise InvalidArgument(
                f"zero_point: expected an integer ndarray, got "
                f"{getattr(zero_point, 'dtype', type(zero_point).__name__)}")
        if zero_point.shape != scale.shape:
            raise InvalidArgument(f"zero_point: expected shape {list(scale.shape)} (that of scale), "
                                  f"got {list(zero_point.shape)}")
        lo, hi = _CODE_RANGE[(bits, signed)]
        if zero_point.size and (zero_point.min() < lo or zero_point.max() > hi):
            raise InvalidArgument(f"zero_point: expected values in [{lo}, {hi}] for "
                                  f"{'' if signed else 'U'}INT{bits}, got "
                                  f"[{zero_point.min()}, {zero_point.max()}]")
        zp32 = np.ascontiguousarray(zero_point, dtype=np.int32).reshape(-1)
        zstrides = strides
    out = check_out(out, "out", np.float32, shape)
    if count == 0:
        return out
    _dequant_par(payload, bits, signed, inner, dim, bs, scale32, *strides, zp32, *zstrides,
                 out.reshape(-1))
    return out


def check_int4_matrix(payload, scale, zero_point, n_rows, k, block_size):
    n_rows = check_int(n_rows, "n_rows", lo=1)
    k = check_int(k, "k", lo=1)
    block_size = min(check_int(block_size, "block_size", lo=1), k)  # one block when >= K
    _check_payload(payload, n_rows * k, 4)
    kb = -(-k // block_size)
    check_array(scale, "scale", dtype=(np.float32, np.float16), shape=(n_rows, kb))
    if zero_point is None:
        zp = np.zeros((1, 1), dtype=np.int8)
    else:
        zp = check_array(zero_point, "zero_point", dtype=np.int8, shape=(n_rows, kb))
    return n_rows, k, block_size, zp


def gather_rows_int4(payload: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                     n_rows: int, k: int, block_size: int, ids: np.ndarray,
                     out=None) -> np.ndarray:
    """Decode only the rows ``ids`` of a blocked INT4 ``[N, K]`` matrix (embedding lookup).

    Equivalent to ``Gather(DequantizeLinear(W, scale, zero_point, axis=1, block_size), ids,
    axis=0)`` (ONNX ``Gather`` + ``DequantizeLinear``), without decoding the other rows.

    Parameters
    ----------
    payload : ndarray of uint8, shape [>= ceil(N*K/2)]
        Signed INT4 codes of ``W`` row-major, two per byte, low nibble first. Element ``(n, k)``
        is code ``n*K + k`` (rows may start mid-byte when K is odd).
    scale : ndarray of float32 or float16, shape [N, ceil(K/block_size)]
        (float16 is read through its bits and widened exactly, never copied)
    zero_point : ndarray of int8, shape [N, ceil(K/block_size)], or None (symmetric)
    n_rows, k : int
        ``N`` and ``K``.
    block_size : int
        Block length along axis 1 (the last block may be partial).
    ids : ndarray of int64 or int32, any shape
        Row indices in ``[-N, N)`` (negative counts from the end, as ONNX ``Gather``).
    out : ndarray of float32, shape [*ids.shape, K], optional

    Returns
    -------
    ndarray of float32, shape [*ids.shape, K]
        Bit-identical to the same rows of :func:`dequantize_affine`.
    """
    args = int4_gather_args(payload, scale, zero_point, n_rows, k, block_size)
    check_array(ids, "ids", dtype=(np.int64, np.int32), contiguous=False)
    return gather_rows_checked(args, ids, out)


def int4_gather_args(payload, scale, zero_point, n_rows, k, block_size) -> tuple:
    """The validated matrix arguments of :func:`gather_rows_checked` (the checks of
    :func:`gather_rows_int4` on the matrix; a caller that gathers from one matrix many times
    keeps them): ``(payload, scale bits, zero_point or a dummy, has_zp, N, K, block_size)``."""
    n_rows, k, block_size, zp = check_int4_matrix(payload, scale, zero_point, n_rows, k,
                                                  block_size)
    return (payload, scale_bits(scale), zp, zero_point is not None, n_rows, k, block_size)


def gather_rows_checked(args: tuple, ids: np.ndarray, out=None) -> np.ndarray:
    """:func:`gather_rows_int4` on the matrix of ``args`` (:func:`int4_gather_args`) for int64 or
    int32 ``ids`` of any shape: the index range and ``out`` are checked here
    (:class:`~olv_runtime.errors.InvalidArgument`)."""
    payload, sbits, zp, has_zp, n_rows, k, block_size = args
    ids_flat = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids_flat.size:
        if ids_flat.size <= 64:  # a decode step's few rows: no numpy reductions
            vals = ids_flat.tolist()
            lo, hi = min(vals), max(vals)
        else:
            lo, hi = int(ids_flat.min()), int(ids_flat.max())
        if lo < -n_rows or hi >= n_rows:
            bad = lo if lo < -n_rows else hi
            raise InvalidArgument(f"ids: expected indices in [{-n_rows}, {n_rows}), got {bad}")
    out = check_out(out, "out", np.float32, tuple(ids.shape) + (k,))
    if ids_flat.size:
        drv = _gather_int4_par if ids_flat.size * k >= PARALLEL_MIN_WORK else _gather_int4_ser
        drv(payload, sbits, zp, has_zp, n_rows, k, block_size, ids_flat,
            out.reshape(ids_flat.size, k))
    return out
