"""Exact-mode (float32 activation) INT4 linear with AVX-512 VNNI integer dot products.

The VNNI path of :func:`~.packed_f32.linear_packed_i8_exact`, on the same prepacked weight
(:class:`~.packed_i8.PackedInt4I8`: one copy serves the int8 mode, the float exact path and this
one). It computes ``y = x @ W.T`` with ``W[n, k] = float32(q[n, k]) * scale[n, k // 32]``
(symmetric codes ``q = u - 8``), with no int8 quantization of the activations: each 32-block of
each activation row is written *exactly* (for all but its tiny elements, below) as 31-bit block
fixed point, and the products are exact integer dot products (``vpdpbusd``), four per code.

Why: the float path (:mod:`.packed_f32`) spends ~3 vector operations per 8 weights (decode by the
magic-number trick, ``vsubps``, ``vfmadd``) and is bound by the vector pipes at about 14 GB/s of
weights per core, below the streaming read. Here a weight costs 4 ``vpdpbusd`` lanes of 32
(u8 x s8, 4 products per int32 lane): 32 instructions per (8 rows x 32 codes), the decode is
the int8 mode's ``vpand`` / ``vpsrlw`` of a 32-byte chunk, and the float work is per block.

Activation digits (:func:`digits_rows`, once per call and row; shared by every output row)
-----------------------------------------------------------------------------------------
For block ``b`` of row ``i`` let ``e`` be the biased float32 exponent of ``max_j |x_j|``
(``e = max(e, 1)``) and ``E = e - 126``, so ``max |x_j| < 2^E``. Then::

    X_j = rint(x_j * 2^(30 - E))                     (int32, |X_j| <= 2^30; round half to even)
    X_j = D3_j * 2^24 + D2_j * 2^16 + D1_j * 2^8 + D0_j,   D0..D2 in [-128, 127], |D3| <= 65

(balanced base-256 digits: ``D0 = int8(X)``, ``X' = (X + 128) >> 8``, ...). ``x_j * 2^(30-E)`` is
formed by two exact float32 multiplications by powers of two, so ``X_j`` is the exactly rounded
fixed-point value: elements with ``|x_j| >= 2^(E-7)`` (within 7 binades of the block's largest)
are represented exactly, smaller ones to ``|x_j - X_j 2^(E-30)| <= 2^(E-31) <= 2^-30 max|x_b|``.
Stored per (row, block): the digits ``dg[., 128 b + 32 p + j] = Dp_j`` (int8), ``bz[., 4 b + p]
= -8 * sum_j Dp_j`` (int32) and ``xsc[., b] = 2^(E - 30)`` (float32; rounds to 0 for blocks with
``max |x| < 2^-119``, NaN for a block holding a non-finite value).

Per (group of 8 output rows, block, row) -- the int32 lanes are the 8 output rows::

    e_p = bz_p + sum_{c, h} vpdpbusd(u[c, h], bcast4(Dp at 16h + 4c))    = sum_j q_j Dp_j
    A = e_3 * 256 + e_2,  B = e_1 * 256 + e_0           (exact int32: |A| < 2^23, |B| < 2^24)
    T = fma(float(A), 65536, float(B))                  (= sum_j q_j X_j, one rounding)
    acc = fma(T, scale[., b] * xsc[b], acc)             (blocks in order b = 0, 1, ...; acc = 0)

``u[c, h]`` are the unsigned nibbles (``vpand`` low / ``vpsrlw 4 + vpand`` high) of the 32-byte
chunk ``c`` (layout: :mod:`.packed_i8`), ``|e_p| <= 32 * 8 * 128``; every intermediate of the
``vpdpbusd`` chains fits int32. ``scale * xsc`` is exact (a power of two times the block scale)
unless it underflows. The same operations in the same order for every variant (1 or 4 groups
at a time, 1, 2 or 4 activation rows sharing the decoded codes), so a row's result depends only
on that row of ``x``: not on M, the thread count or the variant.

Tolerance against a float64 ``x @ W.T`` of the dequantized weight (tests/kernels/test_kernels_packed_f32.py)::

    |y - y_ref| <= 1e-5 * sum_k |x_k W_nk| + 2^-30 * sum_b max_{k in b}|x_k| * sum_{k in b}|W_nk| + 1e-6

(the float path's bound plus the fixed-point term, which only matters when a row's weights
sit on elements much smaller than their block's largest). A row with a non-finite activation:
:func:`~.packed_f32.linear_packed_i8_exact` recomputes it with the float path (IEEE inf / NaN
semantics); the compiled decode step gives NaN for its every output.

Variants (M = 1, decode), accumulators in registers: for long rows (K >= :data:`NG4_MIN_K`)
4 groups at a time (each broadcast activation digit vector feeds 4 ``vpdpbusd``: 16
independent chains, 4x fewer digit loads -- the digits of a K = 4864 row are 19 KB, as large as
L1 holds beside the codes stream; ~18.5 cycles per group and block from L2, one thread, near
the 16 of 32 ``vpdpbusd`` at 2 per cycle); shorter rows one group at a time (one sequential
codes stream per task, ~23 cycles from L2: the 32 digit loads per group and block are not
shared). From DRAM (one thread) the single stream is the faster one for K = 896 (4864 x 896:
20.4 against 16.7 GB/s; short 3.5 KB group streams, four of them interleaved, defeat the
memory side), the 4 streams for K = 4864 (896 x 4864: 20.1 against 16.3 GB/s). Codes are
prefetched :data:`PF_BYTES` ahead in each stream. M >= 2 (prefill): 4 rows per pass (then 1
at a time) share the decoded codes of two groups held in 512-bit vectors (int32 / float32
lanes 0-7 the first group's output rows, 8-15 the second's; :func:`_pass_rows_pair`), so each
broadcast activation digit feeds both groups: the one-group pass needs ~2 digit loads per cycle
beside its 2 ``vpdpbusd`` and is bound by them (M = 128, one thread: 160 -> 194 G
multiply-adds/s at the gate|up shape, 134 -> 195 at the down shape); a last odd group runs
alone.

Only compiled and run where the CPU has AVX-512 VNNI + VL (:func:`~.packed_i8.use_vnni`); the
fallback is the float path of :mod:`.packed_f32` (tests force it).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .config import JIT, PJIT
from .packed_i8 import (
    BLOCK,
    GROUP_BLOCK_BYTES,
    GROUP_ROWS,
    V8F32,
    check_array_arg,
    elem_ptr,
    emit_prefetch,
    fstore,
    is_scale_array,
    load_scales8,
    prefetch,
    prefetch_task_head,
    splat,
)

__all__ = ["PIECES", "DG_BYTES", "digit_buffers"]

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_LV32I8 = ir.VectorType(_I8, 32)
_LV16I16 = ir.VectorType(_I16, 16)
_LV8F32 = ir.VectorType(_F32, 8)
_LV32I32 = ir.VectorType(_I32, 32)
_LV32F32 = ir.VectorType(_F32, 32)

PIECES = 4                 # base-256 digits per activation (31-bit block fixed point)
DG_BYTES = PIECES * BLOCK  # digit bytes per (row, block)
NG_MULTI = 4               # groups per pass of the M = 1 multi-group variant
NG4_MIN_K = 2048           # M = 1: K from which the multi-group variant runs (below: 1 group)
PF_BYTES = 4096           # software prefetch distance in each codes stream
DIGITS_PAR_MIN_M = 8       # rows from which the digits are computed in a parallel loop
PAIR_GROUPS = True         # M >= 2: two groups per pass in 512-bit lanes (_pass_rows_pair)


def digit_buffers(m_max: int, kb: int):
    """The per-row digit buffers ``(dg int8 [m_max, 128 kb], bz int32 [m_max, 4 kb],
    xsc float32 [m_max, kb])`` (see the module docstring)."""
    return (np.zeros((m_max, DG_BYTES * kb), np.int8), np.zeros((m_max, PIECES * kb), np.int32),
            np.zeros((m_max, kb), np.float32))


def _c32(v):
    return ir.Constant(_LV32I32, [v] * 32)


@intrinsic
def _xdigits(typingctx, x, xoff, ln, dg, bz, xsc, rb):
    """Digits of the block ``x[xoff : xoff + ln]`` (float32, linear element offset, ``ln <= 32``;
    missing elements are 0) into row-block ``rb`` of ``dg`` / ``bz`` / ``xsc`` (row-block =
    row * KB + block of those buffers). Returns True if the block is finite."""
    if not (check_array_arg(x, types.float32) and check_array_arg(dg, types.int8)
            and check_array_arg(bz, types.int32) and check_array_arg(xsc, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        xa, xo, lnv, da, ba, sa, rbv = args
        it = xo.type
        # ---- 32 activations (a partial block: lanes >= ln are 0; only x[xoff:xoff+ln] read)
        full = builder.icmp_signed(">=", lnv, ir.Constant(lnv.type, BLOCK))
        with builder.if_else(full) as (then, otherwise):
            with then:
                p = elem_ptr(context, builder, sig.args[0], xa, xo, _LV32F32)
                v_full = builder.load(p, align=4)
                b_full = builder.block
            with otherwise:
                v_part = ir.Constant(_LV32F32, [0.0] * 32)
                last = builder.sub(lnv, ir.Constant(lnv.type, 1))
                for lane in range(BLOCK):
                    cl = ir.Constant(lnv.type, lane)
                    inb = builder.icmp_signed(">", lnv, cl)
                    idx = builder.select(inb, cl, last)  # a valid element in every lane
                    pe = elem_ptr(context, builder, sig.args[0], xa, builder.add(xo, idx), _F32)
                    val = builder.select(inb, builder.load(pe, align=4), ir.Constant(_F32, 0.0))
                    v_part = builder.insert_element(v_part, val, ir.Constant(_I32, lane))
                b_part = builder.block
        v = builder.phi(_LV32F32)
        v.add_incoming(v_full, b_full)
        v.add_incoming(v_part, b_part)
        # ---- block exponent
        vi = builder.bitcast(v, _LV32I32)
        a = builder.and_(vi, _c32(0x7FFFFFFF))
        umax = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I32, [_LV32I32]), "llvm.vector.reduce.umax.v32i32")
        e = builder.lshr(builder.call(umax, [a]), ir.Constant(_I32, 23))
        finite = builder.icmp_unsigned("<", e, ir.Constant(_I32, 255))
        one = ir.Constant(_I32, 1)
        e1 = builder.select(builder.icmp_unsigned("<", e, one), one, e)
        e1 = builder.select(finite, e1, ir.Constant(_I32, 128))
        # 2^(30 - E) = 2^(156 - e1) as two exact float32 powers of two (each in -49..78)
        t = builder.sub(ir.Constant(_I32, 156), e1)
        t1 = builder.ashr(t, one)
        t2 = builder.sub(t, t1)

        def pow2(n):  # float32 2^n, -126 <= n <= 127
            bits = builder.shl(builder.add(n, ir.Constant(_I32, 127)), ir.Constant(_I32, 23))
            return builder.bitcast(bits, _F32)
        y = builder.fmul(builder.fmul(v, splat(builder, pow2(t1), _LV32F32)),
                         splat(builder, pow2(t2), _LV32F32))
        rint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV32F32, [_LV32F32]), "llvm.rint.v32f32")
        xi = builder.fptosi(builder.call(rint, [y]), _LV32I32)
        xi = builder.select(finite, xi, _c32(0))
        radd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I32, [_LV32I32]), "llvm.vector.reduce.add.v32i32")
        cur = xi
        for pc in range(PIECES):
            d8 = builder.trunc(cur, _LV32I8)
            dsx = builder.sext(d8, _LV32I32) if pc < PIECES - 1 else cur
            off = builder.add(builder.mul(rbv, ir.Constant(it, DG_BYTES)),
                              ir.Constant(it, BLOCK * pc))
            builder.store(d8, elem_ptr(context, builder, sig.args[3], da, off, _LV32I8),
                          align=1)
            boff = builder.add(builder.mul(rbv, ir.Constant(it, PIECES)), ir.Constant(it, pc))
            builder.store(builder.mul(builder.call(radd, [dsx]), ir.Constant(_I32, -8)),
                          elem_ptr(context, builder, sig.args[4], ba, boff, _I32))
            if pc < PIECES - 1:
                cur = builder.ashr(builder.add(cur, _c32(128)), _c32(8))
        # 2^(E - 30) = 2^-t1 * 2^-t2 (rounds to 0 below 2^-149)
        zero = ir.Constant(_I32, 0)
        xs = builder.fmul(pow2(builder.sub(zero, t1)), pow2(builder.sub(zero, t2)))
        xs = builder.select(finite, xs, ir.Constant(_F32, float("nan")))
        builder.store(xs, elem_ptr(context, builder, sig.args[5], sa, rbv, _F32))
        return finite
    return types.boolean(x, types.intp, types.intp, dg, bz, xsc, types.intp), codegen


def _vnni_fns(builder, lanes):
    """``(fma, vpdpbusd)`` LLVM functions on ``lanes`` int32 / float32 lanes (8: 256-bit,
    16: 512-bit)."""
    vf = ir.VectorType(_F32, lanes)
    vi = ir.VectorType(_I32, lanes)
    vb = ir.VectorType(_I8, 4 * lanes)
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{lanes}f32")
    dp = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vi, [vi, vb, vb]),
        f"llvm.x86.avx512.vpdpbusd.{32 * lanes}")
    return fma, dp


def _emit_block_sums(context, builder, aty_dg, dg, aty_bz, bz, rb, code_vec, nslots, lanes):
    """``T = sum_j q_j X_j`` (float32, one rounding; module docstring) of digit row-block ``rb``
    for each of ``nslots`` code vector sets ``code_vec(slot, c, h)`` (``4 * lanes`` unsigned
    nibbles): the 4 digit chains per slot side by side in program order (``4 * nslots``
    independent chains), each broadcast activation digit word feeding every slot."""
    fma, dp = _vnni_fns(builder, lanes)
    vi = ir.VectorType(_I32, lanes)
    vb = ir.VectorType(_I8, 4 * lanes)
    vf = ir.VectorType(_F32, lanes)
    it = rb.type

    def ci(v):
        return ir.Constant(it, v)
    e = [[None] * PIECES for _ in range(nslots)]
    for pc in range(PIECES):
        init = splat(builder, builder.load(elem_ptr(
            context, builder, aty_bz, bz, builder.add(builder.mul(rb, ci(PIECES)), ci(pc)),
            _I32)), vi)
        for sl in range(nslots):
            e[sl][pc] = init
    for c in range(4):
        for h in range(2):
            for pc in range(PIECES):
                doff = builder.add(builder.mul(rb, ci(DG_BYTES)), ci(BLOCK * pc + 16 * h + 4 * c))
                xv = builder.load(elem_ptr(context, builder, aty_dg, dg, doff, _I32), align=1)
                xv = builder.bitcast(splat(builder, xv, vi), vb)
                for sl in range(nslots):
                    e[sl][pc] = builder.call(dp, [e[sl][pc], code_vec(sl, c, h), xv])
    sh8 = ir.Constant(vi, [8] * lanes)
    k16 = ir.Constant(vf, [65536.0] * lanes)
    out = []
    for sl in range(nslots):
        a = builder.add(builder.shl(e[sl][3], sh8), e[sl][2])
        b = builder.add(builder.shl(e[sl][1], sh8), e[sl][0])
        out.append(builder.call(fma, [builder.sitofp(a, vf), k16, builder.sitofp(b, vf)]))
    return out


def _emit_xblocks(context, builder, sig, args, ngrp, nrows, regs=False):
    """IR of one block of ``ngrp`` consecutive groups for ``nrows`` activation rows:
    ``acc = fma(T, scale * xsc, acc)`` (see the module docstring) for the accumulator of each
    (group gi, row r): ``facc[8 (gi * nrows + r) : +8]`` in memory, or (``regs``, one row) the
    ``gi``-th vector of the accumulator tuple, returned updated; ``regs`` also prefetches
    (``llvm.prefetch``) each group's codes ``pfc`` bytes (two lines) and its scales ``pfs``
    elements after the block's."""
    if regs:
        accs, codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, pfc, pfs = args
        kbw = ir.Constant(rb0.type, 0)
        aty = sig.args[1:]
    else:
        codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc = args
        aty = sig.args
    it = rb0.type

    def ci(v):
        return ir.Constant(it, v)
    fma, _ = _vnni_fns(builder, 8)
    m0f = ir.Constant(_LV32I8, [0x0F] * 32)
    rbs = [builder.add(rb0, builder.mul(kbw, ci(r))) for r in range(nrows)]
    gcb = [builder.add(cb, builder.mul(gsc, ci(gi))) for gi in range(ngrp)]
    gso = [builder.add(so, builder.mul(gss, ci(gi))) for gi in range(ngrp)]
    if regs and PF_BYTES > 0:
        for gi in range(ngrp):
            pa = builder.add(gcb[gi], pfc)
            emit_prefetch(context, builder, aty[0], codes, pa)
            emit_prefetch(context, builder, aty[0], codes, builder.add(pa, ci(64)))
            emit_prefetch(context, builder, aty[3], scale, builder.add(gso[gi], pfs))
    raw = {}

    def code_vec(gi, c, h):
        """Unsigned nibbles (h = 0 low, 1 high) of chunk c of group gi, decoded at first use."""
        if (gi, c) not in raw:
            off = builder.add(gcb[gi], ci(32 * c))
            raw[gi, c] = builder.load(elem_ptr(context, builder, aty[0], codes, off, _LV32I8),
                                      align=1)
        if (gi, c, h) not in raw:
            v = raw[gi, c]
            if h:
                v = builder.bitcast(builder.lshr(builder.bitcast(v, _LV16I16),
                                                 ir.Constant(_LV16I16, [4] * 16)), _LV32I8)
            raw[gi, c, h] = builder.and_(v, m0f)
        return raw[gi, c, h]

    tv = {}
    for r in range(nrows):
        for gi, t in enumerate(_emit_block_sums(context, builder, aty[6], dg, aty[7], bz,
                                                rbs[r], code_vec, ngrp, 8)):
            tv[gi, r] = t
    xss = [splat(builder, builder.load(elem_ptr(context, builder, aty[8], xsc, rbs[r], _F32)),
                 _LV8F32) for r in range(nrows)]
    if regs:
        out = []
        for gi in range(ngrp):
            sc = load_scales8(context, builder, aty[3], scale, gso[gi])
            acc = builder.extract_value(accs, gi)
            out.append(builder.call(fma, [tv[gi, 0], builder.fmul(sc, xss[0]), acc]))
        return context.make_tuple(builder, sig.return_type, out)
    for gi in range(ngrp):
        sc = load_scales8(context, builder, aty[3], scale, gso[gi])
        for r in range(nrows):
            p = elem_ptr(context, builder, aty[11], facc, ci(8 * (gi * nrows + r)), _LV8F32)
            acc = builder.load(p, align=4)
            builder.store(builder.call(fma, [tv[gi, r], builder.fmul(sc, xss[r]), acc]), p,
                          align=4)
    return context.get_dummy_value()


def _make_xblock(ngrp, nrows):
    @intrinsic
    def _xblock(typingctx, codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc):
        """One block (codes byte ``cb``, scale element ``so``; group strides ``gsc`` / ``gss``)
        of ``ngrp`` groups for ``nrows`` rows (digit row-block ``rb0``, row stride ``kbw``
        blocks), accumulated into ``facc``."""
        if not (check_array_arg(codes, types.uint8) and is_scale_array(scale)
                and check_array_arg(dg, types.int8) and check_array_arg(bz, types.int32)
                and check_array_arg(xsc, types.float32)
                and check_array_arg(facc, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            return _emit_xblocks(context, builder, sig, args, ngrp, nrows)
        sig = types.none(codes, types.intp, types.intp, scale, types.intp, types.intp, dg, bz,
                         xsc, types.intp, types.intp, facc)
        return sig, codegen
    return _xblock


def _make_xacc(ngrp):
    @intrinsic
    def _xacc(typingctx, accs, codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb, pfc, pfs):
        """``accs`` (``ngrp`` float32 x 8 vectors, one per group) after one block (codes byte
        ``cb``, scale element ``so``; group strides ``gsc`` / ``gss``) of ``ngrp`` groups for
        one row (digit row-block ``rb``), accumulated in registers; prefetches each group's
        codes ``pfc`` bytes and its scales ``pfs`` elements ahead of the block's."""
        if not (isinstance(accs, types.UniTuple) and accs.count == ngrp and accs.dtype == V8F32
                and check_array_arg(codes, types.uint8) and is_scale_array(scale)
                and check_array_arg(dg, types.int8) and check_array_arg(bz, types.int32)
                and check_array_arg(xsc, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            return _emit_xblocks(context, builder, sig, args, ngrp, 1, regs=True)
        sig = accs(accs, codes, types.intp, types.intp, scale, types.intp, types.intp, dg, bz,
                   xsc, types.intp, types.intp, types.intp)
        return sig, codegen
    return _xacc


def _make_zeros(ngrp):
    @intrinsic
    def _zeros(typingctx):
        """``ngrp`` float32 x 8 zero vectors (the register accumulators of one pass)."""
        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, sig.return_type,
                                      [ir.Constant(_LV8F32, [0.0] * 8)] * ngrp)
        return types.UniTuple(V8F32, ngrp)(), codegen
    return _zeros


_LV64I8 = ir.VectorType(_I8, 64)
_LV32I16 = ir.VectorType(_I16, 32)
_LV16F32 = ir.VectorType(_F32, 16)


def _emit_xblocks_pair(context, builder, sig, args, nrows):
    """IR of one block of the two consecutive groups ``g, g + 1`` for ``nrows`` activation rows
    in 512-bit vectors: int32 / float32 lanes 0-7 are group g's rows, 8-15 group g + 1's, so
    each broadcast activation digit feeds both groups in one ``vpdpbusd`` (half the digit loads
    of two one-group passes; the loads, not the dot products, bound those). Every lane does the
    operations of :func:`_emit_xblocks` in the same order (bitwise the same results).
    Accumulator of row r: ``facc[16 r : 16 r + 16]``."""
    codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc = args
    aty = sig.args
    it = rb0.type

    def ci(v):
        return ir.Constant(it, v)
    fma, _ = _vnni_fns(builder, 16)
    m0f = ir.Constant(_LV64I8, [0x0F] * 64)
    cat64 = ir.Constant(ir.VectorType(_I32, 64), list(range(64)))
    cat16 = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
    rbs = [builder.add(rb0, builder.mul(kbw, ci(r))) for r in range(nrows)]
    gcb = [cb, builder.add(cb, gsc)]
    gso = [so, builder.add(so, gss)]
    vec = {}
    for c in range(4):
        v0 = builder.load(elem_ptr(context, builder, aty[0], codes,
                                   builder.add(gcb[0], ci(32 * c)), _LV32I8), align=1)
        v1 = builder.load(elem_ptr(context, builder, aty[0], codes,
                                   builder.add(gcb[1], ci(32 * c)), _LV32I8), align=1)
        v = builder.shuffle_vector(v0, v1, cat64)
        vec[c, 0] = builder.and_(v, m0f)
        vec[c, 1] = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(v, _LV32I16),
                                                              ir.Constant(_LV32I16, [4] * 32)),
                                                 _LV64I8), m0f)
    s0 = load_scales8(context, builder, aty[3], scale, gso[0])
    s1 = load_scales8(context, builder, aty[3], scale, gso[1])
    sc = builder.shuffle_vector(s0, s1, cat16)
    for r in range(nrows):
        rb = rbs[r]
        (tv,) = _emit_block_sums(context, builder, aty[6], dg, aty[7], bz, rb,
                                 lambda sl, c, h: vec[c, h], 1, 16)
        xs = splat(builder, builder.load(elem_ptr(context, builder, aty[8], xsc, rb, _F32)),
                   _LV16F32)
        p = elem_ptr(context, builder, aty[11], facc, ci(16 * r), _LV16F32)
        acc = builder.load(p, align=4)
        builder.store(builder.call(fma, [tv, builder.fmul(sc, xs), acc]), p, align=4)
    return context.get_dummy_value()


def _make_xblock_pair(nrows):
    @intrinsic
    def _xblock_pair(typingctx, codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc):
        """One block (codes byte ``cb``, scale element ``so`` of group g; group strides ``gsc``
        / ``gss``) of groups g and g + 1 for ``nrows`` rows (digit row-block ``rb0``, row
        stride ``kbw`` blocks), accumulated into ``facc[16 r : 16 r + 16]``."""
        if not (check_array_arg(codes, types.uint8) and is_scale_array(scale)
                and check_array_arg(dg, types.int8) and check_array_arg(bz, types.int32)
                and check_array_arg(xsc, types.float32)
                and check_array_arg(facc, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            return _emit_xblocks_pair(context, builder, sig, args, nrows)
        sig = types.none(codes, types.intp, types.intp, scale, types.intp, types.intp, dg, bz,
                         xsc, types.intp, types.intp, facc)
        return sig, codegen
    return _xblock_pair


_xa_g4 = _make_xacc(NG_MULTI)
_xa_g1 = _make_xacc(1)
_z_g4 = _make_zeros(NG_MULTI)
_z_g1 = _make_zeros(1)
_xb_g1 = _make_xblock(1, 1)
_xb_r4 = _make_xblock(1, 4)
_xp_r1 = _make_xblock_pair(1)
_xp_r4 = _make_xblock_pair(4)


# ------------------------------------------------------------------------------------------------
# activation digits
# ------------------------------------------------------------------------------------------------
@njit(inline="always", **JIT)  # into its callers: one library level less
def _digits_row(x, i, k, dg, bz, xsc):
    """Digits of row ``i`` of ``x`` (float32 [., >= k]); returns its number of non-finite
    blocks."""
    kx = x.shape[1]
    kbw = xsc.shape[1]
    bad = 0
    for b in range((k + BLOCK - 1) // BLOCK):
        ln = min(BLOCK, k - b * BLOCK)
        if not _xdigits(x, i * kx + b * BLOCK, ln, dg, bz, xsc, i * kbw + b):
            bad += 1
    return bad


@njit(**JIT)
def digits_rows(x, m, k, dg, bz, xsc):
    """Digits of rows ``0..m-1``; returns the number of non-finite blocks."""
    bad = 0
    for i in range(m):
        bad += _digits_row(x, i, k, dg, bz, xsc)
    return bad


# ------------------------------------------------------------------------------------------------
# group loops
# ------------------------------------------------------------------------------------------------
@njit(inline="always", **JIT)  # into its callers: one library level less
def _store_row8(acc, g, n, out, facc):
    """``out[0, 8 g : 8 g + 8] = acc`` (the part below ``n``; a partial group through
    ``facc``)."""
    r0 = g * GROUP_ROWS
    if r0 + GROUP_ROWS <= n:
        fstore(out, r0, acc)
    else:
        fstore(facc, 0, acc)
        for c in range(n - r0):
            out[0, r0 + c] = facc[c]


@njit(**JIT)
def groups_m1(codes, scale, g0, g1, dg, bz, xsc, n, out, facc):
    """Groups ``g0..g1-1`` of ``out[0]`` for a one-row ``x`` whose digits are row 0 of
    ``dg`` / ``bz`` / ``xsc`` (``facc``: float32 >= 8 scratch).

    Passes of NG_MULTI groups (accumulators in registers), then one group at a time; weights
    with short rows (K < NG4_MIN_K) one group at a time throughout (one sequential stream). A pass over NG_MULTI groups reads NG_MULTI interleaved streams (block b of
    each in turn); each is prefetched PF_BYTES ahead, continuing into the same stream of the
    next pass (the group NG_MULTI further on) when it runs past the end of its group: at stream
    position ``s = 128 b + PF_BYTES`` bytes into group ``g + gi`` the target lies
    ``q = s // gsc`` groups of its stream further, ``PF_BYTES + (NG_MULTI - 1) q gsc`` bytes
    after the block's codes (the scales: the same in units of 16 bytes of codes per scale
    element). One group at a time: one stream, prefetched PF_BYTES ahead."""
    kb = codes.shape[1]
    gsc = kb * GROUP_BLOCK_BYTES
    gss = kb * GROUP_ROWS
    g = g0
    if kb * BLOCK >= NG4_MIN_K:
        while g + NG_MULTI <= g1:
            base = g * kb
            q = PF_BYTES // gsc
            r = PF_BYTES - q * gsc
            pfc = PF_BYTES + (NG_MULTI - 1) * q * gsc
            pfs = PF_BYTES // 16 + (NG_MULTI - 1) * q * gss
            accs = _z_g4()
            for b in range(kb):
                accs = _xa_g4(accs, codes, (base + b) * GROUP_BLOCK_BYTES, gsc, scale,
                              (base + b) * GROUP_ROWS, gss, dg, bz, xsc, b, pfc, pfs)
                r += GROUP_BLOCK_BYTES
                if r >= gsc:
                    r -= gsc
                    pfc += (NG_MULTI - 1) * gsc
                    pfs += (NG_MULTI - 1) * gss
            for gi in range(NG_MULTI):
                _store_row8(accs[gi], g + gi, n, out, facc)
            g += NG_MULTI
    while g < g1:
        base = g * kb
        accs1 = _z_g1()
        for b in range(kb):
            accs1 = _xa_g1(accs1, codes, (base + b) * GROUP_BLOCK_BYTES, gsc, scale,
                           (base + b) * GROUP_ROWS, gss, dg, bz, xsc, b, PF_BYTES,
                           PF_BYTES // 16)
        _store_row8(accs1[0], g, n, out, facc)
        g += 1


@njit(inline="always", **JIT)  # into its callers: one library level less
def _pass_rows(codes, scale, g, i0, nr, dg, bz, xsc, facc):
    """``facc[8 r : 8 r + 8] = y[i0 + r, 8 g : 8 g + 8]`` for ``r < nr`` (1 or 4 rows sharing
    the decoded codes of group g)."""
    kb = codes.shape[1]
    kbw = xsc.shape[1]
    for t in range(GROUP_ROWS * nr):
        facc[t] = np.float32(0.0)
    base = g * kb
    gsc = kb * GROUP_BLOCK_BYTES
    gss = kb * GROUP_ROWS
    for b in range(kb):
        cb = (base + b) * GROUP_BLOCK_BYTES
        so = (base + b) * GROUP_ROWS
        if PF_BYTES > 0:
            prefetch(codes, cb + PF_BYTES)
            prefetch(codes, cb + PF_BYTES + 64)
            prefetch(scale, so + PF_BYTES // 16)
        rb0 = i0 * kbw + b
        if nr == 4:
            _xb_r4(codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc)
        else:
            _xb_g1(codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc)


@njit(inline="always", **JIT)  # into its callers: one library level less
def _pass_rows_pair(codes, scale, g, i0, nr, dg, bz, xsc, facc):
    """``facc[16 r : 16 r + 8] = y[i0 + r, 8 g : 8 g + 8]`` and ``facc[16 r + 8 : 16 r + 16] =
    y[i0 + r, 8 g + 8 : 8 g + 16]`` for ``r < nr`` (1 or 4 rows: a variant for 2 costs ~0.3 s
    of compile for a few remainder rows; groups g and g + 1 in 512-bit lanes)."""
    kb = codes.shape[1]
    kbw = xsc.shape[1]
    for t in range(2 * GROUP_ROWS * nr):
        facc[t] = np.float32(0.0)
    base = g * kb
    gsc = kb * GROUP_BLOCK_BYTES
    gss = kb * GROUP_ROWS
    for b in range(kb):
        cb = (base + b) * GROUP_BLOCK_BYTES
        so = (base + b) * GROUP_ROWS
        if PF_BYTES > 0:
            prefetch(codes, cb + PF_BYTES)
            prefetch(codes, cb + PF_BYTES + 64)
            prefetch(codes, cb + gsc + PF_BYTES)
            prefetch(codes, cb + gsc + PF_BYTES + 64)
            prefetch(scale, so + PF_BYTES // 16)
            prefetch(scale, so + gss + PF_BYTES // 16)
        rb0 = i0 * kbw + b
        if nr == 4:
            _xp_r4(codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc)
        else:
            _xp_r1(codes, cb, gsc, scale, so, gss, dg, bz, xsc, rb0, kbw, facc)


@njit(**JIT)
def groups_rows(codes, scale, g0, g1, m, dg, bz, xsc, n, out, facc):
    """Groups ``g0..g1-1`` of rows ``0..m-1``: pairs of groups (:func:`_pass_rows_pair`), then
    a last odd group alone; chunks of 4 rows, then 1, per pass (a later chunk re-reads the groups'
    codes from L1/L2)."""
    g = g0
    if PAIR_GROUPS:
        while g + 2 <= g1:
            r0 = g * GROUP_ROWS
            nc = min(2 * GROUP_ROWS, n - r0)
            i0 = np.int64(0)
            while i0 < m:
                nr = np.int64(4) if m - i0 >= 4 else np.int64(1)
                _pass_rows_pair(codes, scale, g, i0, nr, dg, bz, xsc, facc)
                for r in range(nr):
                    for c in range(nc):
                        out[i0 + r, r0 + c] = facc[r * 2 * GROUP_ROWS + c]
                i0 += nr
            g += 2
    while g < g1:
        r0 = g * GROUP_ROWS
        nc = min(GROUP_ROWS, n - r0)
        i0 = np.int64(0)
        while i0 < m:
            nr = np.int64(4) if m - i0 >= 4 else np.int64(1)
            _pass_rows(codes, scale, g, i0, nr, dg, bz, xsc, facc)
            for r in range(nr):
                for c in range(nc):
                    out[i0 + r, r0 + c] = facc[r * GROUP_ROWS + c]
            i0 += nr
        g += 1


@njit(**JIT)
def linear_vnni_ser(x, m, k, codes, scale, n, out, facc, dg, bz, xsc):
    """``out[:m] = x[:m] @ W.T`` serially; returns the number of non-finite activation blocks
    (their rows are NaN here)."""
    bad = digits_rows(x, m, k, dg, bz, xsc)
    ng = codes.shape[0]
    zero = np.int64(0)
    if m == 1:
        groups_m1(codes, scale, zero, ng, dg, bz, xsc, n, out, facc[0])
    else:
        groups_rows(codes, scale, zero, ng, m, dg, bz, xsc, n, out, facc[0])
    return bad


@njit(**PJIT)
def linear_vnni_par(x, m, k, codes, scale, n, out, ntasks, facc, dg, bz, xsc):
    """:func:`linear_vnni_ser` with the groups split over ``ntasks`` tasks (and the digits of
    M >= DIGITS_PAR_MIN_M rows over the rows)."""
    bad = 0
    ng = codes.shape[0]
    if m >= DIGITS_PAR_MIN_M:
        for i in prange(m):
            bad += _digits_row(x, i, k, dg, bz, xsc)
    else:
        bad = digits_rows(x, m, k, dg, bz, xsc)
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        if m == 1:
            prefetch_task_head(codes, scale, g0, g1, NG_MULTI, PF_BYTES)
            groups_m1(codes, scale, g0, g1, dg, bz, xsc, n, out, facc[task])
        else:
            groups_rows(codes, scale, g0, g1, m, dg, bz, xsc, n, out, facc[task])
    return bad


#: Old names, still used by kernels/decoder_layers.py and tests/test_decoder_stack.py.
_digits_rows = digits_rows
_groups_m1 = groups_m1
_groups_rows = groups_rows
