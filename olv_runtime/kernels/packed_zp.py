"""INT4 weights with zero points on the 8-row group layout of :mod:`.packed_i8` (both modes).

onnxruntime's quantizers write blocked UINT4 weights with one zero point per (row, block):
``W[n, k] = (u[n, k] - z[n, k // 32]) * scale[n, k // 32]``, ``u, z`` in ``0..15``
(``MatMulNBits`` ``zero_points``; ``DequantizeLinear(UINT4, scale, zero_point)`` in QDQ models).
:mod:`olv_runtime.structs.recognize` gives them as signed INT4 codes ``q = u - 8`` with int8 zero points
``zp = z - 8`` (the same logical tensor). This module keeps the fast layout for them: the codes
and scales are exactly :class:`~.packed_i8.PackedInt4I8`'s (``u = q + 8`` nibbles, 8-row
groups), plus one byte per (row, block) holding ``z = zp + 8`` in the group order of the scales
(:class:`PackedInt4I8Zp`; ``N * ceil(K/32)`` bytes, 0.25 bits per weight). No float copy of
anything is made; the zero points stay integers.

* int8 activations (:func:`linear_packed_i8_zp`): the unsigned codes are what ``vpdpbusd`` /
  ``vpmaddubsw`` take, so the block dot product is the unchanged exact
  ``S = sum_j u_j * xq_j`` (VNNI or AVX2, the same integers) and the zero point is folded per
  block as ``S - z * sum_j xq_j`` (exact int32: ``|.| <= 2 * 15 * 127 * 32``); then the float
  operations of the symmetric kernel, ``acc + float32(S - z * T) * (scale * d)``. The integer
  is ``sum (q - zp) xq`` exactly, so the result is bitwise that of
  ``tests/reference.py::linear_int4_int8`` with zero points, and bitwise equal between the VNNI
  and AVX2 paths.
* float32 activations (:func:`linear_packed_i8_exact_zp`): the exact-mode decode of
  :mod:`.packed_f32` subtracts ``2^e + z`` per lane instead of the constant ``2^e + 8``, which
  gives ``u - z`` exactly (``2^23 + 15`` is a float32 integer), then the same FMA chain in the
  same order. Folding ``z * sum(x)`` after a float dot product would cancel (``u`` and ``z`` are
  both ~8): the per-lane subtraction keeps the exact-mode tolerance
  ``|y - y_ref| <= 1e-5 * sum_k |x_k W_nk| + 1e-6`` against a float64 reference.

The symmetric kernels are untouched: these functions are compiled only when a model has zero
points (cold start of other models is unchanged).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from olv_runtime.errors import InvalidArgument

from .arena import weight_empty
from .config import JIT, PJIT, check_array, check_int
from .half import scale_bits
from .packed import pad_rows, prepare_call
from .packed_f32 import NB_R1, NB_R2, NB_R4, PackedF32Workspace, make_workspace_f32
from .packed_f32 import PF_BYTES as PF_BYTES_F32
from .packed_f32 import SERIAL_MAX_WORK as SERIAL_MAX_WORK_F32
from .packed_i8 import (
    BLOCK,
    GROUP_BLOCK_BYTES,
    GROUP_ROWS,
    SERIAL_MAX_WORK,
    V8F32,
    V8I32,
    PackedI8Workspace,
    PackedInt4I8,
    aligned_empty,
    check_array_arg,
    dot_r1,
    dot_r2,
    dot_r4,
    elem_ptr,
    fzero,
    is_scale_array,
    load_scales8,
    make_workspace_i8,
    prefetch,
    prefetch_block,
    prepack,
    quantize_rows_i8,
    splat,
    store_group,
    use_vnni,
)

__all__ = ["PackedInt4I8Zp", "prepack_int4_i8_zp", "linear_packed_i8_zp",
           "linear_packed_i8_exact_zp"]

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_F32 = ir.FloatType()
_LV8I8 = ir.VectorType(_I8, 8)
_LV8I32 = ir.VectorType(_I32, 8)
_LV8F32 = ir.VectorType(_F32, 8)


class PackedInt4I8Zp(PackedInt4I8):
    """A blocked INT4 ``[N, K]`` weight with zero points (block 32), from
    :func:`prepack_int4_i8_zp`.

    Attributes
    ----------
    codes, scale
        As :class:`~.packed_i8.PackedInt4I8` (``u = q + 8`` nibbles; float32 or float16-bit
        scales).
    zp : ndarray of uint8, shape [NG, KB, 8]
        ``zp[g, b, r] = z`` of row ``8g + r``, block ``b`` (``W = (u - z) * scale``); 8 on
        padding rows (their scale is 0).
    """

    __slots__ = ("zp",)

    def __init__(self, codes, scale, zp, n, k):
        super().__init__(codes, scale, n, k)
        self.zp = zp

    @property
    def nbytes(self) -> int:
        """Bytes of the packed arrays (what one call streams from memory)."""
        return int(self.codes.nbytes + self.scale.nbytes + self.zp.nbytes)

    def copy(self) -> "PackedInt4I8Zp":
        base = super().copy()
        zp = aligned_empty(self.zp.shape, np.uint8)
        zp[...] = self.zp
        return PackedInt4I8Zp(base.codes, base.scale, zp, self.n, self.k)

    def __repr__(self) -> str:
        return (f"PackedInt4I8Zp(n={self.n}, k={self.k}, k_padded={self.k_padded}, "
                f"n_groups={self.n_groups}, nbytes={self.nbytes})")


def prepack_int4_i8_zp(payload: np.ndarray, scale: np.ndarray, zero_point: np.ndarray,
                       n: int, k: int, block_size: int) -> PackedInt4I8Zp:
    """Repack a blocked INT4 ``[N, K]`` weight with zero points (block 32).

    Parameters
    ----------
    payload : ndarray of uint8, shape [>= ceil(N*K/2)]
        Signed INT4 codes ``q`` in ``[-8, 7]`` of ``W`` row-major, two per byte, low nibble first
        (:func:`olv_runtime.structs.recognize.linear_weight`'s form).
    scale : ndarray of float32 or float16, shape [N, ceil(K/32)]
    zero_point : ndarray of int8, shape [N, ceil(K/32)]
        ``zp`` in ``[-8, 7]`` with ``W = (q - zp) * scale`` (a UINT4 zero point ``z`` is
        ``z - 8``).
    n, k : int
    block_size : int
        Must be 32.

    Raises
    ------
    InvalidArgument
        block_size not 32, arrays of the wrong dtype/shape, zero points outside ``[-8, 7]``.
    """
    n = check_int(n, "n", lo=1)
    k = check_int(k, "k", lo=1)
    block_size = check_int(block_size, "block_size")
    if block_size != BLOCK:
        raise InvalidArgument(f"block_size: expected {BLOCK} for the int8-dot packed INT4 "
                              f"layout, got {block_size}")
    check_array(payload, "payload", dtype=np.uint8, ndim=1)
    need = (n * k + 1) // 2
    if payload.shape[0] < need:
        raise InvalidArgument(f"payload: expected at least {need} bytes for [{n}, {k}] INT4 "
                              f"codes, got {payload.shape[0]}")
    kb = -(-k // BLOCK)
    check_array(scale, "scale", dtype=(np.float32, np.float16), shape=(n, kb))
    check_array(zero_point, "zero_point", dtype=np.int8, shape=(n, kb))
    lo, hi = int(zero_point.min()), int(zero_point.max())
    if lo < -8 or hi > 7:
        raise InvalidArgument(f"zero_point: expected values in [-8, 7] (INT4 codes), got "
                              f"[{lo}, {hi}]")
    ng = -(-n // GROUP_ROWS)
    codes = weight_empty((ng, kb, GROUP_BLOCK_BYTES), np.uint8)
    sdt = np.uint16 if scale.dtype == np.float16 else np.float32
    pscale = weight_empty((ng, kb, GROUP_ROWS), sdt)
    prepack(payload, scale_bits(scale), n, k, codes, pscale)
    rows = np.full((ng * GROUP_ROWS, kb), 8, np.uint8)
    rows[:n] = (zero_point.astype(np.int16) + 8).astype(np.uint8)
    zp = weight_empty((ng, kb, GROUP_ROWS), np.uint8)
    zp[...] = rows.reshape(ng, GROUP_ROWS, kb).transpose(0, 2, 1)
    return PackedInt4I8Zp(codes, pscale, zp, n, k)


# ------------------------------------------------------------------------------------------------
# int8 activations
# ------------------------------------------------------------------------------------------------
def _load_zp8_i32(context, builder, aty, arr, off):
    """8 consecutive uint8 zero points from linear element ``off`` widened to int32 lanes."""
    p = elem_ptr(context, builder, aty, arr, off, _LV8I8)
    return builder.zext(builder.load(p, align=1), _LV8I32)


@intrinsic
def _block_acc_zp(typingctx, acc, s32, s8, zp, zoff, scale, soff, d):
    """``acc + float32(s32 - zp[zoff:zoff+8] * (s8 / 8)) * (scale[soff:soff+8] * d)``.

    ``s32``: the exact ``sum u * xq`` per row; ``s8 = 8 * sum(xq)`` (the workspace's form, so
    ``s8 >> 3`` is the exact ``sum(xq)``)."""
    if (acc != V8F32 or s32 != V8I32 or not check_array_arg(zp, types.uint8)
            or not is_scale_array(scale)):
        return None

    def codegen(context, builder, sig, args):
        a, i32, sx, za, zo, sc, so, dd = args
        sx = context.cast(builder, sx, sig.args[2], types.int32)
        tot = builder.ashr(sx, ir.Constant(_I32, 3))
        z = _load_zp8_i32(context, builder, sig.args[3], za, zo)
        i32 = builder.sub(i32, builder.mul(z, splat(builder, tot, _LV8I32)))
        f = builder.sitofp(i32, _LV8F32)
        ws = load_scales8(context, builder, sig.args[5], sc, so)
        dd = context.cast(builder, dd, sig.args[7], types.float32)
        v = builder.fmul(ws, splat(builder, dd, _LV8F32))
        return builder.fadd(a, builder.fmul(f, v))
    return V8F32(V8F32, V8I32, types.int32, zp, types.intp, scale, types.intp,
                 types.float32), codegen


@njit(**JIT)
def _zgroup_r1(codes, scale, zp, g, xq, xd, xs8, i0, n, out, facc, vnni):
    kb = codes.shape[1]
    xr = i0 * xq.shape[1]
    base = g * kb
    acc = fzero()
    for b in range(kb):
        prefetch_block(codes, scale, base, b)
        s = dot_r1(codes, (base + b) * GROUP_BLOCK_BYTES, xq, xr + b * BLOCK, vnni)
        so = (base + b) * GROUP_ROWS
        acc = _block_acc_zp(acc, s[0], xs8[i0, b], zp, so, scale, so, xd[i0, b])
    store_group(acc, facc, g, i0, n, out)


@njit(**JIT)
def _zgroup_r2(codes, scale, zp, g, xq, xd, xs8, i0, n, out, facc, vnni):
    kb = codes.shape[1]
    kx = xq.shape[1]
    x0 = i0 * kx
    x1 = x0 + kx
    base = g * kb
    a0 = fzero()
    a1 = fzero()
    for b in range(kb):
        prefetch_block(codes, scale, base, b)
        xo = b * BLOCK
        s = dot_r2(codes, (base + b) * GROUP_BLOCK_BYTES, xq, x0 + xo, x1 + xo, vnni)
        so = (base + b) * GROUP_ROWS
        a0 = _block_acc_zp(a0, s[0], xs8[i0, b], zp, so, scale, so, xd[i0, b])
        a1 = _block_acc_zp(a1, s[1], xs8[i0 + 1, b], zp, so, scale, so, xd[i0 + 1, b])
    store_group(a0, facc, g, i0, n, out)
    store_group(a1, facc, g, i0 + 1, n, out)


@njit(**JIT)
def _zgroup_r4(codes, scale, zp, g, xq, xd, xs8, i0, n, out, facc, vnni):
    kb = codes.shape[1]
    kx = xq.shape[1]
    x0 = i0 * kx
    x1 = x0 + kx
    x2 = x1 + kx
    x3 = x2 + kx
    base = g * kb
    a0 = fzero()
    a1 = fzero()
    a2 = fzero()
    a3 = fzero()
    for b in range(kb):
        prefetch_block(codes, scale, base, b)
        xo = b * BLOCK
        s = dot_r4(codes, (base + b) * GROUP_BLOCK_BYTES, xq, x0 + xo, x1 + xo, x2 + xo,
                   x3 + xo, vnni)
        so = (base + b) * GROUP_ROWS
        a0 = _block_acc_zp(a0, s[0], xs8[i0, b], zp, so, scale, so, xd[i0, b])
        a1 = _block_acc_zp(a1, s[1], xs8[i0 + 1, b], zp, so, scale, so, xd[i0 + 1, b])
        a2 = _block_acc_zp(a2, s[2], xs8[i0 + 2, b], zp, so, scale, so, xd[i0 + 2, b])
        a3 = _block_acc_zp(a3, s[3], xs8[i0 + 3, b], zp, so, scale, so, xd[i0 + 3, b])
    store_group(a0, facc, g, i0, n, out)
    store_group(a1, facc, g, i0 + 1, n, out)
    store_group(a2, facc, g, i0 + 2, n, out)
    store_group(a3, facc, g, i0 + 3, n, out)


@njit(**JIT)
def _zgroups(codes, scale, zp, g0, g1, xq, xd, xs8, m, n, out, facc, vnni):
    """Groups g0..g1-1 of ``out[:m]`` (activation rows in chunks of 4, 2, 1)."""
    for g in range(g0, g1):
        i0 = np.int64(0)
        while m - i0 >= 4:
            _zgroup_r4(codes, scale, zp, g, xq, xd, xs8, i0, n, out, facc, vnni)
            i0 += 4
        if m - i0 >= 2:
            _zgroup_r2(codes, scale, zp, g, xq, xd, xs8, i0, n, out, facc, vnni)
            i0 += 2
        if m - i0 >= 1:
            _zgroup_r1(codes, scale, zp, g, xq, xd, xs8, i0, n, out, facc, vnni)


@njit(**PJIT)
def _zlinear_i8(x, m, k, codes, scale, zp, n, out, ntasks, xq, xd, xs8, facc, vnni):
    kb = codes.shape[1]
    quantize_rows_i8(x, m, k, kb, xq, xd, xs8)
    ng = codes.shape[0]
    if ntasks <= 1:
        _zgroups(codes, scale, zp, np.int64(0), ng, xq, xd, xs8, m, n, out, facc[0], vnni)
    else:
        for task in prange(ntasks):
            g0 = task * ng // ntasks
            g1 = (task + 1) * ng // ntasks
            _zgroups(codes, scale, zp, g0, g1, xq, xd, xs8, m, n, out, facc[task], vnni)


def linear_packed_i8_zp(x: np.ndarray, packed: PackedInt4I8Zp, out: np.ndarray | None = None,
                        workspace: PackedI8Workspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` with int8-quantized activations for a weight with zero points.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    packed : PackedInt4I8Zp
    out : ndarray of float32, shape [M, N], C-contiguous, optional
    workspace : PackedI8Workspace, optional
        From :func:`~.packed_i8.make_workspace_i8` (``m_max >= M``, ``k_max >= K``).

    Returns
    -------
    ndarray of float32, shape [M, N]
        Per block ``acc + float32(sum (q - zp) xq) * (scale * d)`` in block order, the exact
        integer and the same float operations on the VNNI and AVX2 paths (bitwise equal; module
        docstring).

    Raises
    ------
    InvalidArgument
        Wrong packed type, dtypes or shapes (expected vs got).
    """
    m, out, ws = prepare_call(x, packed, PackedInt4I8Zp, out, workspace, PackedI8Workspace,
                              make_workspace_i8)
    if m == 0:
        return out
    k, n, kp = packed.k, packed.n, packed.k_padded
    ntasks = min(ws.n_tasks, numba.get_num_threads(), packed.n_groups)
    if m * n * kp < SERIAL_MAX_WORK:
        ntasks = 1
    _zlinear_i8(x, m, k, packed.codes, packed.scale, packed.zp, n, out, ntasks, ws.xq, ws.xd,
                ws.xs8, ws.facc, use_vnni())
    return out


# ------------------------------------------------------------------------------------------------
# float32 activations (exact mode)
# ------------------------------------------------------------------------------------------------
def _emit_blocks_zp(context, builder, sig, args, nrows, nblk):
    """IR of ``nblk`` blocks of one group for ``nrows`` activation rows: the decode and FMA
    order of :func:`.packed_f32._emit_blocks` with ``2^e + z`` (per lane) subtracted."""
    codes, cb, scale, so, zp, x, xo, kx, facc = args
    aty = sig.args
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_LV8F32, [_LV8F32] * 3), "llvm.fma.v8f32")
    masks, ors, pows = [], [], []
    for p in range(4):
        e = 23 - 4 * p
        masks.append(ir.Constant(_LV8I32, [0xF << (4 * p)] * 8))
        ors.append(ir.Constant(_LV8I32, [(127 + e) << 23] * 8))
        pows.append(ir.Constant(_LV8F32, [float(2.0 ** e)] * 8))
    subs = []
    for bl in range(nblk):
        zoff = builder.add(so, ir.Constant(so.type, bl * GROUP_ROWS))
        zf = builder.sitofp(_load_zp8_i32(context, builder, aty[4], zp, zoff), _LV8F32)
        subs.append([builder.fadd(pows[p], zf) for p in range(4)])  # exact: 2^e + z
    sh16 = ir.Constant(_LV8I32, [16] * 8)
    accs = [builder.load(elem_ptr(context, builder, aty[8], facc,
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
            pbit = 2 * j + h
            half, p = pbit // 4, pbit % 4
            kk = (16 if h else 0) + 4 * c + j
            for bl in range(nblk):
                src = vs[bl][half]
                wi = builder.or_(builder.and_(src, masks[p]), ors[p])
                w = builder.fsub(builder.bitcast(wi, _LV8F32), subs[bl][p])
                for r in range(nrows):
                    xoff = builder.add(xrow[r], ir.Constant(xo.type, bl * BLOCK + kk))
                    xv = builder.load(elem_ptr(context, builder, aty[5], x, xoff, _F32))
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
        builder.store(accs[r], elem_ptr(context, builder, aty[8], facc,
                                        ir.Constant(xo.type, 8 * r), _LV8F32), align=4)
    return context.get_dummy_value()


def _make_blocks_zp(nrows, nblk):
    @intrinsic
    def _blocks(typingctx, codes, cb, scale, so, zp, x, xo, kx, facc):
        """facc[r, :] = fma(block sums (u - z) . x of rows xo + r*kx, scale, facc[r, :]) for
        ``nblk`` blocks (zero points at element ``so`` like the scales)."""
        if not (check_array_arg(codes, types.uint8) and is_scale_array(scale)
                and check_array_arg(zp, types.uint8) and check_array_arg(x, types.float32)
                and check_array_arg(facc, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            return _emit_blocks_zp(context, builder, sig, args, nrows, nblk)
        sig = types.none(codes, types.intp, scale, types.intp, zp, x, types.intp, types.intp,
                         facc)
        return sig, codegen
    return _blocks


_zblk_r1_n = _make_blocks_zp(1, NB_R1)
_zblk_r1_1 = _make_blocks_zp(1, 1)
_zblk_r2_n = _make_blocks_zp(2, NB_R2)
_zblk_r2_1 = _make_blocks_zp(2, 1)
_zblk_r4_n = _make_blocks_zp(4, NB_R4)
_zblk_r4_1 = _make_blocks_zp(4, 1)


@njit(**JIT)
def _zgroup_rows(codes, scale, zp, g, x, i0, nr, facc):
    """facc[r*8:(r+1)*8] = y[i0 + r, 8g:8g+8] for r < nr (nr in 1, 2, 4)."""
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
        if PF_BYTES_F32 > 0:
            for q in range(nb):
                prefetch(codes, cb + PF_BYTES_F32 + 128 * q)
                prefetch(codes, cb + PF_BYTES_F32 + 128 * q + 64)
                prefetch(scale, (base + b + q) * GROUP_ROWS + PF_BYTES_F32 // 16)
        so = (base + b) * GROUP_ROWS
        if nr == 1:
            _zblk_r1_n(codes, cb, scale, so, zp, x, xo + b * BLOCK, kx, facc)
        elif nr == 2:
            _zblk_r2_n(codes, cb, scale, so, zp, x, xo + b * BLOCK, kx, facc)
        else:
            _zblk_r4_n(codes, cb, scale, so, zp, x, xo + b * BLOCK, kx, facc)
        b += nb
    while b < kb:
        cb = (base + b) * GROUP_BLOCK_BYTES
        so = (base + b) * GROUP_ROWS
        if nr == 1:
            _zblk_r1_1(codes, cb, scale, so, zp, x, xo + b * BLOCK, kx, facc)
        elif nr == 2:
            _zblk_r2_1(codes, cb, scale, so, zp, x, xo + b * BLOCK, kx, facc)
        else:
            _zblk_r4_1(codes, cb, scale, so, zp, x, xo + b * BLOCK, kx, facc)
        b += 1


@njit(**JIT)
def _zgroups_f32(codes, scale, zp, g0, g1, x, m, n, out, facc):
    """Groups g0..g1-1 of rows 0..m-1 in chunks of 4, 2, 1 rows (runtime counts: one
    specialisation of the callees)."""
    for g in range(g0, g1):
        i0 = np.int64(0)
        while i0 < m:
            if m - i0 >= 4:
                nr = np.int64(4)
            elif m - i0 >= 2:
                nr = np.int64(2)
            else:
                nr = np.int64(1)
            _zgroup_rows(codes, scale, zp, g, x, i0, nr, facc)
            r0 = g * GROUP_ROWS
            nc = min(GROUP_ROWS, n - r0)
            for r in range(nr):
                for c in range(nc):
                    out[i0 + r, r0 + c] = facc[r * GROUP_ROWS + c]
            i0 += nr


@njit(**PJIT)
def _zlinear_f32(x, m, codes, scale, zp, n, out, ntasks, facc):
    ng = codes.shape[0]
    if ntasks <= 1:
        _zgroups_f32(codes, scale, zp, np.int64(0), ng, x, m, n, out, facc[0])
    else:
        for task in prange(ntasks):
            g0 = task * ng // ntasks
            g1 = (task + 1) * ng // ntasks
            _zgroups_f32(codes, scale, zp, g0, g1, x, m, n, out, facc[task])


def linear_packed_i8_exact_zp(x: np.ndarray, packed: PackedInt4I8Zp,
                              out: np.ndarray | None = None,
                              workspace: PackedF32Workspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` with float32 activations (exact mode) for a weight with zero points.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    packed : PackedInt4I8Zp
    out : ndarray of float32, shape [M, N], C-contiguous, optional
    workspace : PackedF32Workspace, optional
        From :func:`~.packed_f32.make_workspace_f32` (``m_max >= M``, ``k_max >= K``).

    Returns
    -------
    ndarray of float32, shape [M, N]
        ``|y - y_ref| <= 1e-5 * sum_k |x_k W_nk| + 1e-6`` against float64; each row depends only
        on that row of ``x``.

    Raises
    ------
    InvalidArgument
        Wrong packed type, dtypes or shapes (expected vs got).
    """
    m, out, ws = prepare_call(x, packed, PackedInt4I8Zp, out, workspace, PackedF32Workspace,
                              make_workspace_f32,
                              ws_rows=1 if (isinstance(packed, PackedInt4I8Zp)
                                            and packed.k == packed.k_padded) else None)
    if m == 0:
        return out
    k, n, kp = packed.k, packed.n, packed.k_padded
    xx = x
    if k != kp:
        pad_rows(x, m, k, kp, ws.xpad)
        xx = ws.xpad[:m]
    ntasks = min(ws.n_tasks, numba.get_num_threads(), packed.n_groups)
    if m * n * kp < SERIAL_MAX_WORK_F32:
        ntasks = 1
    _zlinear_f32(xx, m, packed.codes, packed.scale, packed.zp, n, out, ntasks, ws.facc)
    return out
