"""INT4 linear layers on weights repacked once (at session creation) into row tiles.

``y = x @ W.T`` for the blocked affine INT4 weight of :func:`~.linear.linear_int4`
(``W[n, k] = float32(q[n, k] - zp[n, k // 32]) * scale[n, k // 32]``, block size 32), but with the
weight first converted by :func:`prepack_int4` into a layout whose inner loops vectorise *across
output rows* (vertical SIMD updates, no per-block horizontal sums). See DESIGN.md section 4.

Packed layout (:class:`PackedInt4`)
-----------------------------------
``R = TILE_ROWS`` (64) consecutive output rows form a tile; ``T = ceil(N / R)`` tiles, the last one
padded with rows whose codes are 0 and whose scales are 0. K is padded to ``Kp = 32 * KB``
(``KB = ceil(K / 32)``) with codes 0, so every block is a full 32-block.

* ``codes``: uint16 ``[T, KB, 8, R]``. Word ``codes[t, b, jq, r]`` holds four codes of row
  ``n = t*R + r``: bits ``4i..4i+3`` = ``u[n, 32*b + 8*i + jq]`` (i = 0..3), where ``u = q + 8``
  in ``0..15`` (the unsigned form of the signed code; padding has ``u = 8``, i.e. ``q = 0``).
  A 256-bit vector load gives 16 rows x 4 codes, and each nibble is extracted in int16 lanes
  with one shift and/or one mask (no byte shuffles). One block of a tile is ``16 * R``
  contiguous bytes (1 KiB for R = 64).
* ``scale``: float32 ``[T, KB, R]`` (padding 0).
* ``zero_point``: int8 ``[T, KB, R]`` (padding 0), or an empty ``[0, 0, 0]`` array if absent.

Bytes read per call: ``packed.nbytes`` = ``N*Kp/2`` (codes, up to tile padding) + ``4*N*KB``
(scales) + ``N*KB`` (zero points, if any).

Modes
-----
* Exact (``quantize_activations=False``): float32 activations. Per row and block,
  ``s * sum_j float32(q - zp) * x`` in float32 (the integer ``q - zp`` is exact in float32, only
  the summation order and the factoring of ``s`` differ from the reference). Tolerance against a
  float64 reference of the dequantized ``W``:
  ``|y - y_ref| <= 1e-5 * sum_k |x_k * W_nk| + 1e-6`` (for K up to ~5000; the observed error is
  ~100x smaller). For M >= 16 each block of a tile is decoded once to float32 and reused by the M
  rows (same summation order, so results per row do not depend on M).
* Quantized (``quantize_activations=True``): each 32-block of each activation row is quantized
  symmetrically to int8 values (``d = max|x| / 127``, ``xq = rint(x / d)``, round half to even,
  held in int16), the products are summed in int16 within a block (``vpmullw``/``vpaddw``, 16 rows
  per ymm): the sum starts at ``-8 * sum(xq)`` and adds ``u * xq``, so every partial sum equals
  ``sum_{j<=J} q*xq - 8*sum_{j>J} xq`` and ``|.| <= 8*127*32 = 32512`` (raw ``u * xq`` sums are
  never formed); zero points are applied as ``- zp * sum(xq)`` in int32; each block result is
  scaled by ``d * scale`` in float32. Error against the exact path: each activation moves by at
  most ``d/2``, so ``|y_q - y_exact| <= sum_k max|x_block(k)| / 254 * |W_nk|`` (+ the
  exact-mode rounding bound); on random data
  ``max |y_q - y_exact| <= 0.02 * max |y_exact|`` (measured ~0.5 %).

Workspace
---------
:func:`make_workspace` preallocates every buffer a call needs (see its docstring for the sizes);
with ``out`` and ``workspace`` given, :func:`linear_packed` allocates no array data.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from olv_runtime.errors import InvalidArgument

from .config import JIT, PJIT, check_array, check_int, check_out
from .half import scale_bits, widen

__all__ = ["PackedInt4", "PackedWorkspace", "prepack_int4", "make_workspace", "linear_packed",
           "TILE_ROWS", "BLOCK"]

TILE_ROWS = 64     # R: output rows per tile (the SIMD dimension of every inner loop)
BLOCK = 32         # quantization block along K (the only block size this layout supports)
HALF = 16          # bytes per row per block
QUADS = 8          # uint16 words (4 codes each) per row per block
QDEC_MIN_M = 16    # quantized mode: M >= this decodes each block once to int16 before the M loop
FDEC_MIN_M = 16    # exact mode: M >= this decodes each block once to float32 before the M loop
SERIAL_MAX_WORK = 1 << 18  # M*N*Kp below this: the serial driver (a parallel region costs more)


# ------------------------------------------------------------------------------------------------
# container
# ------------------------------------------------------------------------------------------------
class PackedInt4:
    """An INT4 ``[N, K]`` weight (block 32) repacked into row tiles by :func:`prepack_int4`.

    Attributes
    ----------
    codes : ndarray of uint16, shape [T, KB, 8, R]
        ``codes[t, b, jq, r] = sum_i u[n, 32b + 8i + jq] << 4i`` (i = 0..3) with ``n = t*R + r``
        and ``u = q + 8`` (padding rows / columns: ``u = 8``).
    scale : ndarray of float32, shape [T, KB, R]
        ``scale[t, b, r]`` = original ``scale[n, b]`` (0 on padding rows).
    zero_point : ndarray of int8, shape [T, KB, R] or [0, 0, 0]
        Original zero points in the same layout; empty when the weight has none.
    n, k : int
        Logical ``N`` (out features) and ``K`` (in features).
    k_padded : int
        ``Kp = 32 * KB``.
    k_blocks : int
        ``KB = ceil(K / 32)``.
    tile_rows : int
        ``R`` (= :data:`TILE_ROWS`).
    n_tiles : int
        ``T = ceil(N / R)``.
    has_zero_point : bool
    """

    __slots__ = ("codes", "scale", "zero_point", "n", "k", "k_padded", "k_blocks", "tile_rows",
                 "n_tiles", "has_zero_point")

    def __init__(self, codes, scale, zero_point, n, k):
        self.codes = codes
        self.scale = scale
        self.zero_point = zero_point
        self.n = int(n)
        self.k = int(k)
        self.k_blocks = int(codes.shape[1])
        self.k_padded = BLOCK * self.k_blocks
        self.tile_rows = int(codes.shape[3])
        self.n_tiles = int(codes.shape[0])
        self.has_zero_point = zero_point.size > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the packed arrays (what one call streams from memory)."""
        return int(self.codes.nbytes + self.scale.nbytes + self.zero_point.nbytes)

    def __repr__(self) -> str:
        return (f"PackedInt4(n={self.n}, k={self.k}, k_padded={self.k_padded}, "
                f"tile_rows={self.tile_rows}, n_tiles={self.n_tiles}, "
                f"zero_point={self.has_zero_point}, nbytes={self.nbytes})")


class PackedWorkspace:
    """Preallocated buffers for :func:`linear_packed` (made by :func:`make_workspace`).

    Valid for any packed weight with ``k_padded <= k_max`` and any ``M <= m_max``, with at most
    ``n_tasks`` parallel tasks (``numba.get_num_threads()`` at call time is capped to it).
    """

    __slots__ = ("m_max", "k_max", "n_tasks", "xq", "xs", "xsum", "xpad", "facc", "iacc",
                 "bacc", "wdq", "wdf")

    def __init__(self, m_max, k_max, n_tasks):
        kp = BLOCK * (-(-k_max // BLOCK))
        kb = kp // BLOCK
        self.m_max, self.k_max, self.n_tasks = m_max, kp, n_tasks
        self.xq = np.zeros((m_max, kp), dtype=np.int16)
        self.xs = np.zeros((m_max, kb), dtype=np.float32)
        self.xsum = np.zeros((m_max, kb), dtype=np.int32)
        self.xpad = np.zeros((m_max, kp), dtype=np.float32)
        self.facc = np.zeros((n_tasks, m_max, TILE_ROWS), dtype=np.float32)
        self.iacc = np.zeros((n_tasks, TILE_ROWS), dtype=np.int16)
        self.bacc = np.zeros((n_tasks, TILE_ROWS), dtype=np.float32)
        self.wdq = np.zeros((n_tasks, BLOCK, TILE_ROWS), dtype=np.int16)
        self.wdf = np.zeros((n_tasks, BLOCK, TILE_ROWS), dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, a).nbytes for a in
                       ("xq", "xs", "xsum", "xpad", "facc", "iacc", "bacc", "wdq", "wdf")))


def workspace_args(m_max, k_max, n_tasks) -> tuple[int, int, int]:
    """Validated (m_max, k_max, n_tasks) of a ``make_workspace*`` call; ``n_tasks`` defaults to
    ``numba.config.NUMBA_NUM_THREADS`` (shared by every packed-kernel workspace)."""
    m_max = check_int(m_max, "m_max", lo=1)
    k_max = check_int(k_max, "k_max", lo=1)
    if n_tasks is None:
        n_tasks = int(numba.config.NUMBA_NUM_THREADS)
    return m_max, k_max, check_int(n_tasks, "n_tasks", lo=1)


def make_workspace(m_max: int, k_max: int, n_tasks: int | None = None) -> PackedWorkspace:
    """Preallocate the buffers of :func:`linear_packed` for ``M <= m_max`` and ``K <= k_max``.

    One workspace serves every packed weight with ``K <= k_max`` (e.g. one per session, sized for
    the largest in-features and the longest prefill chunk). Sizes (``Kp = 32*ceil(k_max/32)``,
    ``KB = Kp/32``, ``R = 64``, ``P = n_tasks``): ``xq`` int16 [m_max, Kp]; ``xs`` float32
    [m_max, KB]; ``xsum`` int32 [m_max, KB]; ``xpad`` float32 [m_max, Kp]; ``facc`` float32
    [P, m_max, R]; ``iacc`` int16 [P, R]; ``bacc`` float32 [P, R]; ``wdq`` int16 [P, 32, R];
    ``wdf`` float32 [P, 32, R]. Total ``~6.25 * m_max * Kp + 256 * P * m_max + 12.5 KiB * P``
    bytes (``.nbytes``).

    Parameters
    ----------
    m_max, k_max : int
        Largest ``M`` (activation rows) and ``K`` (in features) the workspace serves.
    n_tasks : int, optional
        Most parallel tasks a call may use (default ``numba.config.NUMBA_NUM_THREADS``, the
        largest thread count numba allows); calls use ``min(n_tasks, numba.get_num_threads())``.
    """
    m_max, k_max, n_tasks = workspace_args(m_max, k_max, n_tasks)
    return PackedWorkspace(m_max, k_max, n_tasks)


# ------------------------------------------------------------------------------------------------
# prepacking
# ------------------------------------------------------------------------------------------------
@njit(**PJIT)
def _prepack_par(payload, scale, zp, has_zp, n, k, codes, pscale, pzp):
    n_tiles = codes.shape[0]
    kb = codes.shape[1]
    for t in prange(n_tiles):
        for r in range(TILE_ROWS):
            row = t * TILE_ROWS + r
            valid = row < n
            for b in range(kb):
                if valid:
                    pscale[t, b, r] = widen(scale[row, b])  # float16: widened once (a repack)
                    if has_zp:
                        pzp[t, b, r] = zp[row, b]
                else:
                    pscale[t, b, r] = np.float32(0.0)
                    if has_zp:
                        pzp[t, b, r] = np.int8(0)
                for jq in range(QUADS):
                    w = np.uint16(0)
                    for i in range(4):
                        kk = b * BLOCK + 8 * i + jq
                        u = np.uint16(8)
                        if valid and kk < k:
                            e = row * k + kk
                            u = np.uint16(((payload[e >> 1] >> ((e & 1) * 4)) & 15) ^ 8)
                        w = np.uint16(w | (u << (4 * i)))
                    codes[t, b, jq, r] = w


def prepack_int4(payload: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                 n: int, k: int, block_size: int) -> PackedInt4:
    """Repack a blocked signed-INT4 ``[N, K]`` weight (block 32) into the tiled layout.

    One-time work (at session creation): a parallel pass over the tiles, about 1 ns per weight.

    Parameters
    ----------
    payload : ndarray of uint8, shape [>= ceil(N*K/2)]
        Signed INT4 codes in ``[-8, 7]`` of ``W`` row-major, two per byte, low nibble first
        (code of ``(n, k)`` is number ``n*K + k``; rows may start mid-byte when K is odd).
    scale : ndarray of float32, shape [N, ceil(K/32)]
    zero_point : ndarray of int8, shape [N, ceil(K/32)], or None (symmetric, zero point 0)
    n, k : int
        ``N`` (out features) and ``K`` (in features), both >= 1.
    block_size : int
        Must be 32 (:class:`~olv_runtime.errors.InvalidArgument` otherwise; callers fall back to
        :func:`~olv_runtime.kernels.linear.linear_int4`).

    Returns
    -------
    PackedInt4
        The layout described in the module docstring; ``.nbytes`` is its size.

    Raises
    ------
    InvalidArgument
        ``block_size != 32``, bad dtypes/shapes, or a payload shorter than ``ceil(N*K/2)``.
    """
    n = check_int(n, "n", lo=1)
    k = check_int(k, "k", lo=1)
    block_size = check_int(block_size, "block_size")
    if block_size != BLOCK:
        raise InvalidArgument(f"block_size: expected {BLOCK} for the packed INT4 layout, "
                              f"got {block_size}")
    check_array(payload, "payload", dtype=np.uint8, ndim=1)
    need = (n * k + 1) // 2
    if payload.shape[0] < need:
        raise InvalidArgument(f"payload: expected at least {need} bytes for [{n}, {k}] INT4 "
                              f"codes, got {payload.shape[0]}")
    kb = -(-k // BLOCK)
    check_array(scale, "scale", dtype=(np.float32, np.float16), shape=(n, kb))
    has_zp = zero_point is not None
    if has_zp:
        check_array(zero_point, "zero_point", dtype=np.int8, shape=(n, kb))
        zp_in = zero_point
    else:
        zp_in = np.zeros((1, 1), dtype=np.int8)
    n_tiles = -(-n // TILE_ROWS)
    codes = np.empty((n_tiles, kb, QUADS, TILE_ROWS), dtype=np.uint16)
    pscale = np.empty((n_tiles, kb, TILE_ROWS), dtype=np.float32)
    pzp = np.empty((n_tiles, kb, TILE_ROWS) if has_zp else (0, 0, 0), dtype=np.int8)
    _prepack_par(payload, scale_bits(scale), zp_in, has_zp, n, k, codes, pscale, pzp)
    return PackedInt4(codes, pscale, pzp, n, k)


# ------------------------------------------------------------------------------------------------
# activation preparation (serial; O(M*K), run inside the parallel drivers before the prange)
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _quantize_rows(x, m, k, kb, xq, xs, xsum):
    """int8 per-32-block symmetric quantization of ``x[:m, :k]`` (zeros beyond k)."""
    for i in range(m):
        for b in range(kb):
            k0 = b * BLOCK
            d, tot = _quantize_block(x, i, k0, min(BLOCK, k - k0), xq)
            xs[i, b] = d
            xsum[i, b] = tot


@njit(**JIT)
def _quantize_block(x, i, k0, ln, xq):
    """Symmetric int8 quantization of ``x[i, k0:k0+ln]`` into ``xq[i, k0:k0+32]`` (zero padded;
    ``xq`` may be int8 or int16). Returns ``(d, sum of the codes)`` with ``d = max|x| / 127`` and
    codes ``rint(x / d)`` (round half to even) clipped to [-127, 127]."""
    amax = np.float32(0.0)
    for p in range(ln):
        a = abs(x[i, k0 + p])
        if a > amax:
            amax = a
    d = amax / np.float32(127.0)
    tot = 0
    if amax > np.float32(0.0):
        for p in range(ln):
            v = np.rint(x[i, k0 + p] / d)
            if v > np.float32(127.0):
                v = np.float32(127.0)
            elif v < np.float32(-127.0):
                v = np.float32(-127.0)
            qv = np.int32(v)
            xq[i, k0 + p] = qv
            tot += qv
        for p in range(ln, BLOCK):
            xq[i, k0 + p] = 0
    else:
        for p in range(BLOCK):
            xq[i, k0 + p] = 0
    return d, tot


@njit(**JIT)
def _pad_rows(x, m, k, kp, xpad):
    for i in range(m):
        for p in range(k):
            xpad[i, p] = x[i, p]
        for p in range(k, kp):
            xpad[i, p] = np.float32(0.0)


# ------------------------------------------------------------------------------------------------
# serial tile kernels
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _tile_q(codes, wscale, wzp, has_zp, t, xq, xs, xsum, m, iacc, facc):
    """Quantized mode, one tile, activation rows 0..m-1: facc[i, r] = y[i, t*R + r].

    The j loop (16 constant trips) is fully unrolled by LLVM before vectorisation, so the r loop
    is the vectorised loop and the int16 block sum of 16 rows (ymm) stays in a register.
    """
    kb = codes.shape[1]
    for i in range(m):
        for r in range(TILE_ROWS):
            facc[i, r] = np.float32(0.0)
    for b in range(kb):
        k0 = b * BLOCK
        for i in range(m):
            d = xs[i, b]
            sx = np.int32(xsum[i, b])
            s0 = np.int16(-8 * sx)   # |8 * sum(xq)| <= 8*127*32 = 32512
            for r in range(TILE_ROWS):
                # s = sum_j (u-8)*xq, accumulated as -8*sum(xq) + sum_j u*xq: every partial sum
                # is sum_{j<=J} (u-8)*xq - 8*sum_{j>J} xq, |.| <= 32512, so int16 never overflows.
                s = s0
                for jq in range(QUADS):
                    w = codes[t, b, jq, r]
                    s = np.int16(s + np.int16(w & 15) * xq[i, k0 + jq]
                                 + np.int16((w >> 4) & 15) * xq[i, k0 + 8 + jq]
                                 + np.int16((w >> 8) & 15) * xq[i, k0 + 16 + jq]
                                 + np.int16(w >> 12) * xq[i, k0 + 24 + jq])
                iacc[r] = s
            if has_zp:
                for r in range(TILE_ROWS):
                    iv = np.int32(np.int32(iacc[r]) - np.int32(np.int32(wzp[t, b, r]) * sx))
                    facc[i, r] += np.float32(iv) * (wscale[t, b, r] * d)
            else:
                for r in range(TILE_ROWS):
                    facc[i, r] += np.float32(iacc[r]) * (wscale[t, b, r] * d)


@njit(**JIT)
def _tile_f(codes, wscale, wzp, has_zp, t, x, m, bacc, facc):
    """Exact mode, one tile, activation rows 0..m-1 (x has >= Kp columns, zero padded).

    Per row and block: two float32 partial sums (low nibbles k0..k0+15, high nibbles
    k0+16..k0+31) in a fixed order, ``s_blk = lo + hi``, then ``facc += s_blk * scale``.
    """
    kb = codes.shape[1]
    for i in range(m):
        for r in range(TILE_ROWS):
            facc[i, r] = np.float32(0.0)
    for b in range(kb):
        k0 = b * BLOCK
        for i in range(m):
            if has_zp:
                for r in range(TILE_ROWS):
                    cz = np.float32(np.int32(8) + np.int32(wzp[t, b, r]))
                    sa = np.float32(0.0)
                    sb = np.float32(0.0)
                    for jq in range(QUADS):
                        w = codes[t, b, jq, r]
                        sa += (np.float32(np.uint16(w & 15)) - cz) * x[i, k0 + jq]
                        sb += (np.float32(np.uint16((w >> 4) & 15)) - cz) * x[i, k0 + 8 + jq]
                        sa += (np.float32(np.uint16((w >> 8) & 15)) - cz) * x[i, k0 + 16 + jq]
                        sb += (np.float32(np.uint16(w >> 12)) - cz) * x[i, k0 + 24 + jq]
                    facc[i, r] += (sa + sb) * wscale[t, b, r]
            else:
                for r in range(TILE_ROWS):
                    sa = np.float32(0.0)
                    sb = np.float32(0.0)
                    for jq in range(QUADS):
                        # u ^ 8 = q as a two's complement nibble; shift it to the top of an
                        # int32 and shift back arithmetically: the signed code, exact in float32
                        w = np.int32(np.int32(codes[t, b, jq, r]) ^ np.int32(0x8888))
                        sa += np.float32(np.int32(w << 28) >> 28) * x[i, k0 + jq]
                        sb += np.float32(np.int32(w << 24) >> 28) * x[i, k0 + 8 + jq]
                        sa += np.float32(np.int32(w << 20) >> 28) * x[i, k0 + 16 + jq]
                        sb += np.float32(np.int32(w << 16) >> 28) * x[i, k0 + 24 + jq]
                    facc[i, r] += (sa + sb) * wscale[t, b, r]


@njit(**JIT)
def _store_tile(facc, m, t, n, out):
    r0 = t * TILE_ROWS
    nr = min(TILE_ROWS, n - r0)
    for i in range(m):
        for r in range(nr):
            out[i, r0 + r] = facc[i, r]


# ------------------------------------------------------------------------------------------------
# parallel drivers: prange over ntasks contiguous tile ranges, one workspace slice per task
# ------------------------------------------------------------------------------------------------
@njit(**PJIT)
def _linear_q_par(x, m, k, codes, wscale, wzp, has_zp, n, out, ntasks, xq, xs, xsum, iacc, facc,
                  wdq):
    kb = codes.shape[1]
    _quantize_rows(x, m, k, kb, xq, xs, xsum)
    n_tiles = codes.shape[0]
    for task in prange(ntasks):
        t0 = task * n_tiles // ntasks
        t1 = (task + 1) * n_tiles // ntasks
        for t in range(t0, t1):
            if m >= QDEC_MIN_M:
                _tile_q_dec(codes, wscale, wzp, has_zp, t, xq, xs, xsum, m, wdq[task],
                            iacc[task], facc[task])
            else:
                _tile_q(codes, wscale, wzp, has_zp, t, xq, xs, xsum, m, iacc[task], facc[task])
            _store_tile(facc[task], m, t, n, out)


@njit(**JIT)
def _linear_q_ser(x, m, k, codes, wscale, wzp, has_zp, n, out, xq, xs, xsum, iacc, facc, wdq):
    """Serial twin of :func:`_linear_q_par` (one task) for layers too small to split."""
    kb = codes.shape[1]
    _quantize_rows(x, m, k, kb, xq, xs, xsum)
    for t in range(codes.shape[0]):
        if m >= QDEC_MIN_M:
            _tile_q_dec(codes, wscale, wzp, has_zp, t, xq, xs, xsum, m, wdq[0], iacc[0], facc[0])
        else:
            _tile_q(codes, wscale, wzp, has_zp, t, xq, xs, xsum, m, iacc[0], facc[0])
        _store_tile(facc[0], m, t, n, out)


@njit(**JIT)
def _linear_f_ser(x, m, codes, wscale, wzp, has_zp, n, out, bacc, facc, wdf):
    """Serial twin of :func:`_linear_f_par` (one task) for layers too small to split."""
    for t in range(codes.shape[0]):
        if m >= FDEC_MIN_M:
            _tile_f_dec(codes, wscale, wzp, has_zp, t, x, m, wdf[0], facc[0])
        else:
            _tile_f(codes, wscale, wzp, has_zp, t, x, m, bacc[0], facc[0])
        _store_tile(facc[0], m, t, n, out)


@njit(**PJIT)
def _linear_f_par(x, m, codes, wscale, wzp, has_zp, n, out, ntasks, bacc, facc, wdf):
    n_tiles = codes.shape[0]
    for task in prange(ntasks):
        t0 = task * n_tiles // ntasks
        t1 = (task + 1) * n_tiles // ntasks
        for t in range(t0, t1):
            if m >= FDEC_MIN_M:
                _tile_f_dec(codes, wscale, wzp, has_zp, t, x, m, wdf[task], facc[task])
            else:
                _tile_f(codes, wscale, wzp, has_zp, t, x, m, bacc[task], facc[task])
            _store_tile(facc[task], m, t, n, out)


@njit(**JIT)
def _tile_q_dec(codes, wscale, wzp, has_zp, t, xq, xs, xsum, m, wdq, iacc, facc):
    """Quantized mode for larger M: each block is decoded once to int16 ``wdq[32, R]`` (signed
    codes q) and reused by all m rows (pure multiply-add per row). Same results as _tile_q."""
    kb = codes.shape[1]
    for i in range(m):
        for r in range(TILE_ROWS):
            facc[i, r] = np.float32(0.0)
    for b in range(kb):
        k0 = b * BLOCK
        for jq in range(QUADS):
            for r in range(TILE_ROWS):
                w = codes[t, b, jq, r]
                wdq[jq, r] = np.int16(np.int16(w & 15) - np.int16(8))
                wdq[8 + jq, r] = np.int16(np.int16((w >> 4) & 15) - np.int16(8))
                wdq[16 + jq, r] = np.int16(np.int16((w >> 8) & 15) - np.int16(8))
                wdq[24 + jq, r] = np.int16(np.int16(w >> 12) - np.int16(8))
        for i in range(m):
            d = xs[i, b]
            sx = np.int32(xsum[i, b])
            for r in range(TILE_ROWS):
                s = np.int16(0)   # partial sums of q*xq: |.| <= 8*127*32 = 32512
                for j in range(BLOCK):
                    s = np.int16(s + wdq[j, r] * xq[i, k0 + j])
                iacc[r] = s
            if has_zp:
                for r in range(TILE_ROWS):
                    iv = np.int32(np.int32(iacc[r]) - np.int32(np.int32(wzp[t, b, r]) * sx))
                    facc[i, r] += np.float32(iv) * (wscale[t, b, r] * d)
            else:
                for r in range(TILE_ROWS):
                    facc[i, r] += np.float32(iacc[r]) * (wscale[t, b, r] * d)


@njit(**JIT)
def _tile_f_dec(codes, wscale, wzp, has_zp, t, x, m, wdf, facc):
    """Exact mode for larger M: each block decoded once to float32 ``wdf[32, R]`` = q - zp
    (exact small integers), reused by all m rows. Same summation order as _tile_f."""
    kb = codes.shape[1]
    for i in range(m):
        for r in range(TILE_ROWS):
            facc[i, r] = np.float32(0.0)
    for b in range(kb):
        k0 = b * BLOCK
        for jq in range(QUADS):
            for r in range(TILE_ROWS):
                w = np.int32(codes[t, b, jq, r])
                z = np.int32(8)
                if has_zp:
                    z = np.int32(8) + np.int32(wzp[t, b, r])
                wdf[jq, r] = np.float32(np.int32(w & 15) - z)
                wdf[8 + jq, r] = np.float32(np.int32((w >> 4) & 15) - z)
                wdf[16 + jq, r] = np.float32(np.int32((w >> 8) & 15) - z)
                wdf[24 + jq, r] = np.float32(np.int32(w >> 12) - z)
        for i in range(m):
            for r in range(TILE_ROWS):
                sa = np.float32(0.0)
                sb = np.float32(0.0)
                for jq in range(QUADS):
                    sa += wdf[jq, r] * x[i, k0 + jq]
                    sb += wdf[8 + jq, r] * x[i, k0 + 8 + jq]
                    sa += wdf[16 + jq, r] * x[i, k0 + 16 + jq]
                    sb += wdf[24 + jq, r] * x[i, k0 + 24 + jq]
                facc[i, r] += (sa + sb) * wscale[t, b, r]


# ------------------------------------------------------------------------------------------------
# public wrapper
# ------------------------------------------------------------------------------------------------
def prepare_call(x, packed, packed_cls, out, workspace, ws_cls, make_ws, ws_rows=None):
    """Argument handling shared by the packed linear wrappers.

    Checks ``packed`` is a ``packed_cls``, ``x`` is float32 ``[M, K]``, ``out`` is float32
    ``[M, N]`` (allocated when None) and ``workspace`` is a ``ws_cls`` serving ``M`` rows and
    ``Kp`` columns (made by ``make_ws(ws_rows or M, Kp, n_tasks=numba threads)`` when None).
    Returns ``(M, out, workspace)``; the workspace is None when ``M == 0``.

    Raises
    ------
    InvalidArgument
        Any argument of the wrong type, dtype or shape (expected vs got).
    """
    if not isinstance(packed, packed_cls):
        raise InvalidArgument(f"packed: expected a {packed_cls.__name__}, got {type(packed).__name__}")
    k, n, kp = packed.k, packed.n, packed.k_padded
    check_array(x, "x", dtype=np.float32, shape=(None, k))
    m = x.shape[0]
    out = check_out(out, "out", np.float32, (m, n))
    if m == 0:
        return m, out, None
    ws = workspace
    if ws is None:
        ws = make_ws(ws_rows or m, kp, n_tasks=numba.get_num_threads())
    elif not isinstance(ws, ws_cls):
        raise InvalidArgument(f"workspace: expected a {ws_cls.__name__}, got {type(ws).__name__}")
    elif ws.m_max < m or ws.k_max < kp:
        raise InvalidArgument(f"workspace: expected m_max >= {m} and k_max >= {kp}, got "
                              f"m_max={ws.m_max}, k_max={ws.k_max}")
    return m, out, ws


def linear_packed(x: np.ndarray, packed: PackedInt4, out: np.ndarray | None = None, *,
                  quantize_activations: bool = False,
                  workspace: PackedWorkspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` for a weight prepacked by :func:`prepack_int4`.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    packed : PackedInt4
    out : ndarray of float32, shape [M, N], C-contiguous, optional
    quantize_activations : bool
        False (default): exact mode, float32 activations; ``|y - y_ref| <= 1e-5 *
        sum_k |x_k W_nk| + 1e-6`` against float64 ``x @ W.T`` of the dequantized W.
        True: activations quantized to int8 per 32-block, integer dot products (see the module
        docstring); ``max |y - y_exact| <= 0.02 * max |y_exact|`` on random data.
    workspace : PackedWorkspace, optional
        From :func:`make_workspace` with ``m_max >= M`` and ``k_max >= K``. With ``out`` and
        ``workspace`` given the call allocates no array data. Not thread-safe: one workspace per
        concurrently running call.

    Returns
    -------
    ndarray of float32, shape [M, N]
        ``out`` if given. Each row's result depends only on that row of ``x`` (not on M or the
        thread count).
    """
    m, out, ws = prepare_call(x, packed, PackedInt4, out, workspace, PackedWorkspace,
                              make_workspace)
    if m == 0:
        return out
    k, n, kp = packed.k, packed.n, packed.k_padded
    ntasks = min(ws.n_tasks, numba.get_num_threads(), packed.n_tiles)
    zp = packed.zero_point
    if m * n * kp < SERIAL_MAX_WORK or ntasks == 1:  # too small to pay for a parallel region
        if quantize_activations:
            _linear_q_ser(x, m, k, packed.codes, packed.scale, zp, packed.has_zero_point, n, out,
                          ws.xq, ws.xs, ws.xsum, ws.iacc, ws.facc, ws.wdq)
        else:
            xx = x
            if k != kp:
                _pad_rows(x, m, k, kp, ws.xpad)
                xx = ws.xpad
            _linear_f_ser(xx, m, packed.codes, packed.scale, zp, packed.has_zero_point, n, out,
                          ws.bacc, ws.facc, ws.wdf)
        return out
    if quantize_activations:
        _linear_q_par(x, m, k, packed.codes, packed.scale, zp, packed.has_zero_point, n, out,
                      ntasks, ws.xq, ws.xs, ws.xsum, ws.iacc, ws.facc, ws.wdq)
    else:
        xx = x
        if k != kp:
            _pad_rows(x, m, k, kp, ws.xpad)
            xx = ws.xpad
        _linear_f_par(xx, m, packed.codes, packed.scale, zp, packed.has_zero_point, n, out,
                      ntasks, ws.bacc, ws.facc, ws.wdf)
    return out
