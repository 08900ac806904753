"""Exact-mode (float32 activations) INT4 linear on the :mod:`.packed_i8` layout.

One prepacked copy (:class:`~.packed_i8.PackedInt4I8`, from :func:`~.packed_i8.prepack_int4_i8`)
serves both modes: :func:`~.packed_i8_gemm.linear_packed_i8` (int8-quantized activations) and
:func:`linear_packed_i8_exact` here (float32 activations, no activation quantization), which
computes ``y = x @ W.T`` with ``W[n, k] = float32(q[n, k]) * scale[n, k // 32]`` (symmetric codes,
no zero points).

Per (activation row, 8-row group, block b) -- lanes = the 8 output rows of the group::

    s   = sum_{t<32} w_t * x[k_t]            (float32, one FMA chain, fixed order t = 0..31)
    acc = fma(s, scale[., b], acc)           (blocks in order b = 0, 1, ...; acc starts at 0)

where ``w_t`` is the exactly decoded code ``q = u - 8`` (float32) of the 8 rows at
``k_t = 32b + (16 if t odd else 0) + 4c + j`` for ``t = 8c + 2j + h`` (``c`` = 32-byte chunk,
``j`` = byte within the row's dword, ``h`` = nibble): the order in which the codes lie in the
chunk. The order is the same for every kernel variant (1, 2, 4 or 8 activation rows sharing each
decoded vector, 1 or more blocks interleaved), so a row's result does not depend on M or the
thread count.

Decoding (no int -> float conversion, no shifts per nibble): chunk ``c`` of a (group, block) is
8 int32 lanes, lane ``r`` = 8 nibbles of row ``r``. With ``v`` the lane and ``v >> 16`` (one
``vpsrld`` per chunk) every nibble sits at bit position ``4p``, ``p`` in 0..3; then::

    w = bitcast_f32((v & (0xF << 4p)) | bits(2^(23 - 4p))) - (2^(23 - 4p) + 8)

(``vpand``, ``vpor``, ``vsubps``): the float with exponent ``23 - 4p`` has unit ``ulp`` at
mantissa bit ``4p``, so the or-ed value is exactly ``2^(23-4p) + u`` and the subtraction gives
``u - 8 = q`` exactly. Then one ``vfmadd231ps`` with the broadcast activation per activation row.

Tolerance (against a float64 ``x @ W.T`` of the dequantized weight), the bound of the existing
exact path: ``|y - y_ref| <= 1e-5 * sum_k |x_k W_nk| + 1e-6``.

Kernel variants: activation rows in chunks of 8, 4, 2, 1 per group share each decoded vector
(8 rows: FMA bound, ~85 GFLOP/s per core with 256-bit vectors); a single row interleaves
:data:`NB_R1` = 4 blocks (4 independent FMA chains). M = 1 costs ~3-4 vector uops per 8 rows x 1
code (and, or, sub, fma; AVX-512VL builds merge and/or into vpternlogd), about 1.2 cycles, i.e.
~12.5 GB/s of weights per core when cache-resident; from DRAM with 2 threads 17-20 GB/s (2-2.5x
the tiled exact path). Codes are software-prefetched :data:`PF_BYTES` ahead (scales at the same
distance in blocks).

Workspace (:func:`make_workspace_f32`): ``xpad`` float32 ``[m_max, Kp]`` (only used when
``K % 32 != 0``) and ``facc`` float32 ``[n_tasks, 8, 8]`` (per-task accumulators). With ``out``
and ``workspace`` given a call allocates no array data.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from . import packed_f32_vnni
from .config import JIT, PJIT
from .packed import pad_rows, prepare_call, workspace_args
from .packed_i8 import (
    BLOCK,
    GROUP_BLOCK_BYTES,
    GROUP_ROWS,
    HOST_VNNI,
    PackedInt4I8,
    check_array_arg,
    elem_ptr,
    fast_call_rows,
    is_scale_array,
    load_scales8,
    num_threads,
    prefetch,
    splat,
    task_scratch,
    use_vnni,
)

__all__ = ["PackedF32Workspace", "make_workspace_f32", "linear_packed_i8_exact"]

SERIAL_MAX_WORK = 1 << 18  # M*N*Kp below this: serial driver
ROWS_MAX = 8               # activation rows sharing one decoded weight vector
PF_BYTES = 4096           # software prefetch distance ahead of the codes stream
NB_R1 = 4                  # blocks interleaved (independent FMA chains) for 1 activation row
NB_R2 = 2
NB_R4 = 2
NB_R8 = 1

_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_LV8I32 = ir.VectorType(_I32, 8)
_LV8F32 = ir.VectorType(_F32, 8)


def _emit_blocks(context, builder, sig, args, nrows, nblk):
    """IR of ``nblk`` consecutive blocks of one group for ``nrows`` activation rows."""
    codes, cb, scale, so, x, xo, kx, facc = args
    aty = sig.args
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_LV8F32, [_LV8F32] * 3), "llvm.fma.v8f32")
    masks, ors, subs = [], [], []
    for p in range(4):
        e = 23 - 4 * p
        masks.append(ir.Constant(_LV8I32, [0xF << (4 * p)] * 8))
        ors.append(ir.Constant(_LV8I32, [(127 + e) << 23] * 8))
        subs.append(ir.Constant(_LV8F32, [float(2.0 ** e + 8.0)] * 8))
    sh16 = ir.Constant(_LV8I32, [16] * 8)
    accs = [builder.load(elem_ptr(context, builder, aty[7], facc,
                                  ir.Constant(xo.type, 8 * r), _LV8F32), align=4)
            for r in range(nrows)]
    xrow = [xo]
    for r in range(1, nrows):
        xrow.append(builder.add(xrow[-1], kx))
    s = [[None] * nrows for _ in range(nblk)]
    for c in range(4):
        vs = []
        for bl in range(nblk):
            off = builder.add(cb, ir.Constant(cb.type, bl * GROUP_BLOCK_BYTES + 32 * c))
            v = builder.load(elem_ptr(context, builder, aty[0], codes, off, _LV8I32), align=4)
            vs.append((v, builder.lshr(v, sh16)))
        for t in range(8):
            j, h = t // 2, t % 2
            pbit = 2 * j + h          # nibble position in the 32-bit lane
            half, p = pbit // 4, pbit % 4
            kk = (16 if h else 0) + 4 * c + j
            for bl in range(nblk):
                src = vs[bl][half]
                wi = builder.or_(builder.and_(src, masks[p]), ors[p])
                w = builder.fsub(builder.bitcast(wi, _LV8F32), subs[p])
                for r in range(nrows):
                    xoff = builder.add(xrow[r], ir.Constant(xo.type, bl * BLOCK + kk))
                    xv = builder.load(elem_ptr(context, builder, aty[4], x, xoff, _F32))
                    xb = splat(builder, xv, _LV8F32)
                    if s[bl][r] is None:
                        s[bl][r] = builder.fmul(w, xb)
                    else:
                        s[bl][r] = builder.call(fma, [w, xb, s[bl][r]])
    for bl in range(nblk):
        soff = builder.add(so, ir.Constant(so.type, bl * GROUP_ROWS))
        sc = load_scales8(context, builder, aty[2], scale, soff)
        for r in range(nrows):
            accs[r] = builder.call(fma, [s[bl][r], sc, accs[r]])
    for r in range(nrows):
        builder.store(accs[r], elem_ptr(context, builder, aty[7], facc,
                                        ir.Constant(xo.type, 8 * r), _LV8F32), align=4)
    return context.get_dummy_value()


def _make_blocks(nrows, nblk):
    @intrinsic
    def _blocks(typingctx, codes, cb, scale, so, x, xo, kx, facc):
        """facc[r, :] = fma(block sums of rows xo + r*kx, scale, facc[r, :]) for ``nblk``
        blocks from codes byte ``cb`` / scale element ``so`` / x element ``xo``."""
        if not (check_array_arg(codes, types.uint8) and is_scale_array(scale)
                and check_array_arg(x, types.float32)
                and check_array_arg(facc, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            return _emit_blocks(context, builder, sig, args, nrows, nblk)
        sig = types.none(codes, types.intp, scale, types.intp, x, types.intp, types.intp, facc)
        return sig, codegen
    return _blocks


_blk_r1_n = _make_blocks(1, NB_R1)
_blk_r1_1 = _make_blocks(1, 1)
_blk_r2_n = _make_blocks(2, NB_R2)
_blk_r2_1 = _make_blocks(2, 1)
_blk_r4_n = _make_blocks(4, NB_R4)
_blk_r4_1 = _make_blocks(4, 1)
_blk_r8_n = _make_blocks(8, NB_R8)
_blk_r8_1 = _make_blocks(8, 1)


# ------------------------------------------------------------------------------------------------
# workspace
# ------------------------------------------------------------------------------------------------
class PackedF32Workspace:
    """Preallocated buffers for :func:`linear_packed_i8_exact` (see :func:`make_workspace_f32`)."""

    __slots__ = ("m_max", "k_max", "n_tasks", "xpad", "facc", "dg", "bz", "xsc")

    def __init__(self, m_max, k_max, n_tasks):
        kp = BLOCK * (-(-k_max // BLOCK))
        kb = kp // BLOCK
        self.m_max, self.k_max, self.n_tasks = m_max, kp, n_tasks
        self.facc = task_scratch(n_tasks, (ROWS_MAX * GROUP_ROWS,), np.float32)  # own lines
        if HOST_VNNI:
            # the VNNI path's activation digits and the float path's xpad (forced fallback,
            # zero-point kernels) share one buffer: a call writes every element it then reads
            dgb, bzb = m_max * kb * packed_f32_vnni.DG_BYTES, m_max * kb * 4 * packed_f32_vnni.PIECES
            raw = np.zeros(dgb + bzb + 4 * m_max * kb, dtype=np.uint8)
            self.dg = raw[:dgb].view(np.int8).reshape(m_max, kb * packed_f32_vnni.DG_BYTES)
            self.bz = raw[dgb:dgb + bzb].view(np.int32).reshape(m_max, kb * packed_f32_vnni.PIECES)
            self.xsc = raw[dgb + bzb:].view(np.float32).reshape(m_max, kb)
            self.xpad = raw[:4 * m_max * kp].view(np.float32).reshape(m_max, kp)
        else:
            self.xpad = np.zeros((m_max, kp), dtype=np.float32)
            self.dg, self.bz, self.xsc = packed_f32_vnni.digit_buffers(0, 0)

    @property
    def nbytes(self) -> int:
        if HOST_VNNI:
            return int(self.facc.nbytes + self.dg.nbytes + self.bz.nbytes + self.xsc.nbytes)
        return int(self.xpad.nbytes + self.facc.nbytes)


def make_workspace_f32(m_max: int, k_max: int, n_tasks: int | None = None) -> PackedF32Workspace:
    """Preallocate the buffers of :func:`linear_packed_i8_exact` for ``M <= m_max``,
    ``K <= k_max`` (``Kp = 32 * ceil(k_max / 32)``, ``KB = Kp / 32``): ``facc`` float32
    ``[n_tasks, 64]``, ``xpad`` float32 ``[m_max, Kp]`` and, on a CPU with AVX-512 VNNI, the
    activation digits of :mod:`.packed_f32_vnni` (int8 ``[m_max, 128 KB]``, int32
    ``[m_max, 4 KB]``, float32 ``[m_max, KB]``) in one buffer with ``xpad`` (``4.625 * m_max *
    Kp`` bytes; ``4 * m_max * Kp`` without VNNI).
    ``n_tasks`` defaults to ``numba.config.NUMBA_NUM_THREADS``."""
    m_max, k_max, n_tasks = workspace_args(m_max, k_max, n_tasks)
    return PackedF32Workspace(m_max, k_max, n_tasks)


# ------------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _group_rows(codes, scale, g, x, i0, nr, facc):
    """facc[r*8:(r+1)*8] = y[i0 + r, 8g:8g+8] for r < nr (nr in 1, 2, 4; 8 rows:
    :func:`_group_rows8`, kept apart so that models never running M >= 8 never compile it)."""
    kb = codes.shape[1]
    kx = x.shape[1]
    for t in range(nr * GROUP_ROWS):
        facc[t] = np.float32(0.0)
    base = g * kb
    xo = i0 * kx
    if nr == 1:
        nb = NB_R1
    elif nr == 2:
        nb = NB_R2
    else:
        nb = NB_R4
    b = 0
    while b + nb <= kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        if PF_BYTES > 0:
            for q in range(nb):
                prefetch(codes, cb + PF_BYTES + 128 * q)
                prefetch(codes, cb + PF_BYTES + 128 * q + 64)
                # the scale stream runs at 1/4 of the codes rate: same distance in blocks
                prefetch(scale, (base + b + q) * GROUP_ROWS + PF_BYTES // 16)
        so = (base + b) * GROUP_ROWS
        if nr == 1:
            _blk_r1_n(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        elif nr == 2:
            _blk_r2_n(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        else:
            _blk_r4_n(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        b += nb
    while b < kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        so = (base + b) * GROUP_ROWS
        if nr == 1:
            _blk_r1_1(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        elif nr == 2:
            _blk_r2_1(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        else:
            _blk_r4_1(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        b += 1


@njit(**JIT)
def _group_rows8(codes, scale, g, x, i0, facc):
    """facc[r*8:(r+1)*8] = y[i0 + r, 8g:8g+8] for r < 8."""
    kb = codes.shape[1]
    kx = x.shape[1]
    for t in range(8 * GROUP_ROWS):
        facc[t] = np.float32(0.0)
    base = g * kb
    xo = i0 * kx
    nb = NB_R8
    b = 0
    while b + nb <= kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        if PF_BYTES > 0:
            for q in range(nb):
                prefetch(codes, cb + PF_BYTES + 128 * q)
                prefetch(codes, cb + PF_BYTES + 128 * q + 64)
                prefetch(scale, (base + b + q) * GROUP_ROWS + PF_BYTES // 16)
        so = (base + b) * GROUP_ROWS
        _blk_r8_n(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        b += nb
    while b < kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        so = (base + b) * GROUP_ROWS
        _blk_r8_1(codes, cb, scale, so, x, xo + b * BLOCK, kx, facc)
        b += 1


@njit(**JIT)
def _group_row1(codes, scale, g, x, facc):
    """facc[:8] = y[0, 8g:8g+8] of a one-row ``x``: the ``nr == 1`` path of
    :func:`_group_rows` (same operations, so bitwise the same), apart so that the compiled decode
    step (M = 1 only) does not compile the 2- and 4-row block kernels."""
    kb = codes.shape[1]
    for t in range(GROUP_ROWS):
        facc[t] = np.float32(0.0)
    base = g * kb
    nb = NB_R1
    b = 0
    while b + nb <= kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        if PF_BYTES > 0:
            for q in range(nb):
                prefetch(codes, cb + PF_BYTES + 128 * q)
                prefetch(codes, cb + PF_BYTES + 128 * q + 64)
                prefetch(scale, (base + b + q) * GROUP_ROWS + PF_BYTES // 16)
        so = (base + b) * GROUP_ROWS
        _blk_r1_n(codes, cb, scale, so, x, b * BLOCK, x.shape[1], facc)
        b += nb
    while b < kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        so = (base + b) * GROUP_ROWS
        _blk_r1_1(codes, cb, scale, so, x, b * BLOCK, x.shape[1], facc)
        b += 1


@njit(**JIT)
def groups_m1(codes, scale, g0, g1, x, n, out, facc):
    """Groups g0..g1-1 of ``out[0]`` for a one-row ``x`` (:func:`_groups_small` with m = 1)."""
    one = np.int64(1)
    zero = np.int64(0)
    for g in range(g0, g1):
        _group_row1(codes, scale, g, x, facc)
        _store_rows(facc, g, zero, one, n, out)


@njit(**JIT)
def _store_rows(facc, g, i0, nr, n, out):
    r0 = g * GROUP_ROWS
    nc = min(GROUP_ROWS, n - r0)
    for r in range(nr):
        for c in range(nc):
            out[i0 + r, r0 + c] = facc[r * GROUP_ROWS + c]


@njit(**JIT)
def _groups_small(codes, scale, g0, g1, x, i_start, m, n, out, facc):
    """Groups g0..g1-1 of rows i_start..m-1 (fewer than 8 left): chunks of 4, 2, 1 rows.

    Row counts are runtime int64 values, never literals: a literal argument makes numba compile
    one specialisation of the callee per value (cold start)."""
    for g in range(g0, g1):
        i0 = i_start
        nr = np.int64(0)
        if m - i0 >= 4:
            nr = np.int64(4)
        elif m - i0 >= 2:
            nr = np.int64(2)
        elif m - i0 >= 1:
            nr = np.int64(1)
        while nr > 0:
            _group_rows(codes, scale, g, x, i0, nr, facc)
            _store_rows(facc, g, i0, nr, n, out)
            i0 += nr
            if m - i0 >= 4:
                nr = np.int64(4)
            elif m - i0 >= 2:
                nr = np.int64(2)
            elif m - i0 >= 1:
                nr = np.int64(1)
            else:
                nr = np.int64(0)


@njit(**JIT)
def _groups8(codes, scale, g0, g1, x, m, n, out, facc):
    """Groups g0..g1-1 of all m rows: chunks of 8 rows, then :func:`_groups_small`."""
    eight = np.int64(8)
    for g in range(g0, g1):
        i0 = np.int64(0)
        while m - i0 >= 8:
            _group_rows8(codes, scale, g, x, i0, facc)
            _store_rows(facc, g, i0, eight, n, out)
            i0 += 8
        if i0 < m:
            _groups_small(codes, scale, g, g + 1, x, i0, m, n, out, facc)


# One driver per row class (M < 8: decode, short prompts never compile the 8-row code) and per
# mode: serial (one task, no parallel region) or parallel (ntasks >= 2 tasks). A call takes the
# serial driver when its work is below SERIAL_MAX_WORK, so a small model (``olv demo``) compiles
# the serial drivers only and a large one the parallel ones only: a parallel driver holding a
# serial branch too re-optimises the kernels linked into it twice (seconds of a cold start).
@njit(**JIT)
def _linear_small_ser(x, m, codes, scale, n, out, facc):
    zero = np.int64(0)
    _groups_small(codes, scale, zero, codes.shape[0], x, zero, m, n, out, facc[0])


@njit(**PJIT)
def _linear_small_par(x, m, codes, scale, n, out, ntasks, facc):
    ng = codes.shape[0]
    zero = np.int64(0)
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        _groups_small(codes, scale, g0, g1, x, zero, m, n, out, facc[task])


@njit(**JIT)
def _linear_big_ser(x, m, codes, scale, n, out, facc):
    _groups8(codes, scale, np.int64(0), codes.shape[0], x, m, n, out, facc[0])


@njit(**PJIT)
def _linear_big_par(x, m, codes, scale, n, out, ntasks, facc):
    ng = codes.shape[0]
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        _groups8(codes, scale, g0, g1, x, m, n, out, facc[task])


def linear_packed_i8_exact(x: np.ndarray, packed: PackedInt4I8, out: np.ndarray | None = None,
                           workspace: PackedF32Workspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` with float32 activations (exact mode) for a weight from
    :func:`~.packed_i8.prepack_int4_i8`.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    packed : PackedInt4I8
    out : ndarray of float32, shape [M, N], C-contiguous, optional
    workspace : PackedF32Workspace, optional
        From :func:`make_workspace_f32` with ``m_max >= M`` and ``k_max >= K``. With ``out`` and
        ``workspace`` given the call allocates no array data. One workspace per concurrent call.

    Returns
    -------
    ndarray of float32, shape [M, N]
        Against a float64 ``x @ W.T`` of the dequantized weight:
        ``|y - y_ref| <= 1e-5 * sum_k |x_k W_nk| + 1e-6`` on the float path, plus
        ``2^-30 * sum_b max_{k in b}|x_k| * sum_{k in b}|W_nk|`` (blocks ``b`` of 32) on the
        VNNI path (:mod:`.packed_f32_vnni`, chosen at run time where the CPU has AVX-512 VNNI;
        :func:`~.packed_i8.set_isa` ``("avx2")`` forces the float path). On either path each
        row depends only on that row of ``x`` (not on M or the thread count); rows holding an
        inf or NaN get the float path's IEEE results.
    """
    vnni = use_vnni()
    ws = workspace
    m = fast_call_rows(x, packed, out, ws, PackedInt4I8, PackedF32Workspace)
    if m < 0:
        m, out, ws = prepare_call(x, packed, PackedInt4I8, out, workspace, PackedF32Workspace,
                                  make_workspace_f32,
                                  ws_rows=1 if (isinstance(packed, PackedInt4I8) and not vnni
                                                and packed.k == packed.k_padded) else None)
        if m == 0:
            return out
    k, n, kp = packed.k, packed.n, packed.k_padded
    # too small to pay for a parallel region; and a weight below the bound always runs short
    # row counts serially, so a small model compiles no parallel driver for them
    ntasks = min(ws.n_tasks, num_threads(), packed.n_groups)
    if m * n * kp < SERIAL_MAX_WORK or (m < 8 and n * kp < SERIAL_MAX_WORK):
        ntasks = 1
    if vnni:
        if ntasks <= 1:
            bad = packed_f32_vnni.linear_vnni_ser(x, m, k, packed.codes, packed.scale, n, out,
                                                  ws.facc, ws.dg, ws.bz, ws.xsc)
        else:
            bad = packed_f32_vnni.linear_vnni_par(x, m, k, packed.codes, packed.scale, n, out,
                                                  ntasks, ws.facc, ws.dg, ws.bz, ws.xsc)
        if bad:  # rows with inf / NaN: the float path's IEEE results (rare: allocates)
            rows = np.flatnonzero(~np.isfinite(x).all(axis=1))
            xr = np.ascontiguousarray(x[rows])
            yr = np.empty((rows.size, n), np.float32)
            _linear_float(xr, rows.size, packed, yr, make_workspace_f32(rows.size, kp, 1), 1)
            out[rows] = yr
        return out
    _linear_float(x, m, packed, out, ws, ntasks)
    return out


def _linear_float(x, m, packed, out, ws, ntasks):
    """The float path (any AVX2 CPU; :mod:`.packed_f32_vnni` where the CPU has VNNI)."""
    k, n, kp = packed.k, packed.n, packed.k_padded
    xx = x
    if k != kp:
        pad_rows(x, m, k, kp, ws.xpad)
        xx = ws.xpad[:m]  # rows k_max >= Kp long (the kernels use x.shape[1] as row stride)
    if ntasks <= 1:
        driver = _linear_big_ser if m >= 8 else _linear_small_ser
        driver(xx, m, packed.codes, packed.scale, n, out, ws.facc)
    else:
        driver = _linear_big_par if m >= 8 else _linear_small_par
        driver(xx, m, packed.codes, packed.scale, n, out, ntasks, ws.facc)


#: Old name, still used by kernels/decoder_layers.py and tests/test_decoder_stack.py.
_groups_m1 = groups_m1
