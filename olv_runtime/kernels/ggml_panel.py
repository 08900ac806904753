"""Panel GEMM for prefill on the ggml group records (Q8_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K),
int8 mode, AVX2 and AVX-512 VNNI.

:mod:`.ggml_gemm` decodes a record (nibbles, high bits, 6-bit scales) once per
:data:`~.ggml_gemm.ROWS` = 4 activation rows, so at prefill the decode is repeated ``M / 4``
times per record and past 4 rows the registers run out. Here a task decodes a *pair* of 8-row
groups once per row block (up to :func:`block_rows` activation rows, at least 64, L2-resident)
into an int8 *panel* (the exact codes the multiply reads, plus the per-block scales as small
arrays) and then runs the block's rows against it: the decode is amortized over the block and
the inner loop is loads, ``vpbroadcastd``, ``vpmaddubsw``, ``vpaddw`` and a short float epilogue
(the technique of large-batch quantized GEMMs that first convert a weight tile to a
multiply-friendly form; no code copied from any of them).

Panel layout (per task, two slots ``j = 0, 1`` for groups ``g, g + 1``; ``nb = K / 32``):

* ``codes`` uint8 ``[2, nb, 8, 32]``: for 32-block ``b``, chunk ``t``, byte ``4r + i`` = the
  unsigned code ``U_t`` of :func:`~.ggml_gemm._chunk` (Q5_0 ``lo | h << 4`` = q + 16, Q4_1 /
  Q4_K q 0..15, Q5_1 / Q5_K q 0..31, Q6_K q + 32), Q8_0 ``|q|`` (the sign trick of
  :mod:`.ggml_packed`);
* ``signs`` uint8 ``[2, nb, 8, 32]`` (Q8_0 only): ``q`` itself, for ``vpsignb(x, q)``;
* ``scales`` float32 ``[2, nb, 3, 8]`` (one float32 x 8 lanes per slot): Q8_0 / Q5_0 ``[d, -, -]``;
  Q4_1 / Q5_1 ``[d, m, -]``; Q4_K / Q5_K ``[d sc_b, dmin m_b, -]`` (the float32 products of
  the one-row kernel); Q6_K ``[d, sc_0, sc_1]`` (the two 16-halves' int8 scales as int32 bits).

Per task: row blocks, then group pairs in order (an odd last group decoded into both slots, slot
1 not stored); per pair, the block's activation rows in tiles of :data:`ROWS` = 2 rows x
:data:`TILE_GROUPS` = 2 slots (the rows left over one at a time), per tile the 32-blocks in
order, per block chunk-outer: each chunk's two panel vectors loaded once, each row's 4
activation bytes broadcast once and used for both groups (as :mod:`.packed_i8_gemm`'s AVX2
tile), ``vpmaddubsw`` pair sums added in int16 over :data:`~.ggml_gemm.I16_TERMS` chunks,
``vpmaddwd`` with ones, then per (row, group) the epilogue. Adding a kind: its decode in
:func:`~.ggml_gemm._chunk`, a :data:`SPECS` entry, its panel scales in :func:`_emit_decode` and
its epilogue in :func:`_epilogue`.

Bitwise equality with ``ggml_packed._row_i8`` (and tests/reference.py ``linear_ggml_int8``): the
int32 sums per (row, 32-block or 16-half) are exact on every path; the float32 operations per
(row, block) are the one-row kernel's in its order (no FMA, fastmath off):

* Q8_0: ``a + float(S) * (d * d_x)``; Q5_0: ``a + float(S - 16 sum xq) * (d * d_x)``;
* Q4_1 / Q5_1: ``a + (float(S) * (d * d_x) + m * (d_x * float(sum xq)))``;
* Q4_K / Q5_K: ``a + ((d sc) float(S) - (dmin m) float(sum xq)) * d_x`` (``d sc``, ``dmin m``
  computed by the same float32 multiply at decode and stored);
* Q6_K: ``a + float(sc_0 (S_0 - 32 s_0) + sc_1 (S_1 - 32 s_1)) * (d * d_x)``.

VNNI path (``vnni`` flag, a VNNI host; :func:`_emit_ztile`): the two slots' panels interleaved
per chunk (slot ``j`` at byte ``32 j`` of each 64-byte chunk, 512 bytes per 32-block; scales
``[nb, 3, 2, 8]``), so one zmm load holds chunk ``t`` of both groups (slot 0 in lanes 0-7) and
one ``vpdpbusd`` zmm per (row, chunk) with the row's 4 activation bytes as a ``{1to16}``
broadcast operand serves both; tiles of :data:`VROWS` = 4 rows, one int32 chain per (row, chunk
group) and the epilogue on 16 lanes (lane-wise the same float32 operations). Q8_0's codes are
stored as ``u = q + 128`` and its chains start at ``-128 sum(xq)`` (as :mod:`.ggml_gemm`'s
VNNI path): the same exact integers, so the bits of both paths are equal.

Used by :func:`~.ggml_packed._groups` when :func:`use_panel`: AVX2 path from :data:`MIN_ROWS`
activation rows, Q4_1 from :data:`MIN_ROWS_Q4_1`, every kind but Q8_0; VNNI path the k-quants from
:data:`MIN_ROWS`, Q5_0 / Q4_1 / Q5_1 from :data:`MIN_ROWS_VNNI`, Q8_0 from
:data:`MIN_ROWS_VNNI_Q8_0`.

Measured on a Zen 4 (AVX-512 VNNI, 2 cores shared with a compiler build and another helper, load
~7: ``python bench/bench_ggml_panel.py --rounds 11 --paths vnni,vpanel`` with a third path of
ymm tiles then in the module, one thread, the median per-round ratio of the paths run back to
back): zmm VNNI panel / ggml_gemm's VNNI path (``vpdpbusd`` ymm, 4 rows per decoded record),
M = 128 / 512, N x K as below (k-quants K = 1024 for 896):

=====  ===========  ===========  ===========  ===========
kind   896 x 896    128 x 896    4864 x 896   896 x 4864
=====  ===========  ===========  ===========  ===========
Q8_0   0.94 / 1.32  1.06 / 0.99  1.38 / 1.06  1.24 / 1.04
Q5_0   1.41 / 1.25  1.17 / 1.13  1.11 / 0.74  1.32 / 1.34
Q4_1   0.80 / 1.38  1.11 / 0.85  1.04 / 0.76  1.21 / 1.14
Q5_1   1.32 / 1.24  1.25 / 1.12  1.13 / 0.78  1.31 / 1.25
Q4_K   1.11 / 1.35  1.44 / 1.26  1.39 / 1.04  1.65 / 1.43
Q5_K   1.07 / 1.47  1.45 / 1.08  1.27 / 0.97  1.81 / 1.74
Q6_K   1.94 / 1.77  1.53 / 1.17  1.46 / 1.21  1.85 / 1.98
=====  ===========  ===========  ===========  ===========

Geometric means: Q8_0 1.12, Q5_0 1.16, Q4_1 1.02, Q5_1 1.16, Q4_K 1.32, Q5_K 1.33, Q6_K 1.58
(ggml_gemm VNNI 36-105 GMAC/s, the zmm panel 55-130). The same run had the ymm variant (the
AVX2 tile structure with one ``vpdpbusd`` ymm chain per (row, slot)) at geometric means 0.96 -
1.31, so it was dropped. Single figures swing: a (path, shape) sometimes runs at ~55 GMAC/s for
a whole run (4864 x 896 M = 512 here; 896 x 896 M = 512 for the ymm tiles in the same run, the
other way round in an earlier one), not understood. The AVX2 panel on this host is 0.38-0.66x
ggml_gemm's VNNI path for Q8_0 / Q5_0 and 0.8-1.2x for Q6_K (``--paths avx2,vnni,panel``): the
AVX2 multiply (``vpmaddubsw``, ``vpaddw``, ``vpmaddwd``) costs more than the decode saves.

Measured, AVX2 path (``python bench/bench_ggml_panel.py --rounds 5 --ms 128,512`` at the time:
one thread, panel vs ggml_gemm alternating in one process, best of 5 rounds, GMAC/s; a shared
2-core Zen 3 with load ~4, so single figures are noisy, the ratios less so). Panel / ggml_gemm
at M = 128 / 512 on
Qwen2.5-0.5B's shapes N x K (Q4_K / Q6_K with K = 896 rounded up to 1024):

=====  ===========  ===========  ===========  ===========
kind   896 x 896    128 x 896    4864 x 896   896 x 4864
=====  ===========  ===========  ===========  ===========
Q5_0   1.50 / 0.97  1.17 / 1.30  1.61 / 1.16  1.49 / 1.37
Q4_K   1.73 / 1.76  1.14 / 1.39  1.15 / 1.28  1.20 / 1.67
Q6_K   1.59 / 1.18  1.21 / 1.25  1.23 / 1.21  1.22 / 1.29
Q8_0   1.07 / 1.15  1.00 / 0.99  0.63 / 0.92  1.11 / 1.01
=====  ===========  ===========  ===========  ===========

Q4_1, Q5_1, Q5_K (added later, ``--rounds 3 --kinds Q4_1,Q5_1,Q5_K``, ``time.thread_time``,
load ~4): Q4_1 1.04 / 1.34, 1.14 / 1.12, 0.93 / 1.17, 1.01 / 1.14; Q5_1 1.24 / 1.30, 1.35 /
1.26, 1.09 / 0.96, 1.27 / 1.30; Q5_K 1.46 / 1.20, 2.00 / 1.27, 1.34 / 1.24, 1.38 / 1.53.

(panel GMAC/s 25-66, ggml_gemm 16-59.) llvm-mca (``-mcpu=znver3``) on the tile loops: see
:data:`ROWS`; the remaining limit is the four FP pipes (``vpmaddubsw``, ``vpaddw``, the
broadcasts and the float epilogue all compete for them), not the decode.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .config import JIT
from .ggml_gemm import BLOCK_BYTES, I16_TERMS, _chunk
from .ggml_ir import (
    F32,
    I32,
    LV8F32,
    LV8I32,
    LV16I16,
    LV32I8,
    Emit,
    k4_scales,
    load_f32,
    load_i32,
    xbcast,
)
from .packed_i8 import (HOST_VNNI, V8F32, _prefetch_l2, check_array_arg, elem_ptr, splat,
                        store_group)

__all__ = ["MIN_ROWS", "MIN_ROWS_Q4_1", "MIN_ROWS_VNNI", "MIN_ROWS_VNNI_Q8_0", "ROWS", "SPECS",
           "TILE_GROUPS", "VROWS", "block_rows", "panel_groups", "panel_rows", "use_panel"]

#: activation rows per tile (llvm-mca -mcpu=znver3 on the tile loops, MAC per cycle, (slots,
#: rows) = (2, 2) / (1, 4) / (2, 3) / (2, 4): Q5_0 35.2 / 28.4 / 33.6 / 32.0, Q4_K 32.9 / 28.9
#: / 32.6 / 34.1, Q6_K 27.9 / 24.9 / 27.5 / 27.8, Q8_0 23.2 / 22.5 / 23.2 / 23.5; (2, 2) is the
#: only one without spills in the loop (ggml_gemm's rows_i8: 19-24)).
ROWS = 2
#: activation rows per tile of the VNNI path (``vpdpbusd``: no int16 sums, 32 registers).
VROWS = 4
#: panel slots (8-row groups) per tile: each row's broadcast activations serve both.
TILE_GROUPS = 2
#: :func:`~.ggml_packed._groups` runs the panel from this many activation rows (AVX2 path;
#: Q8_0 never, see :func:`use_panel`). bench/bench_ggml_panel.py, 896x896, one thread: panel /
#: ggml_gemm at M = 8 / 16 / 32: Q5_0 1.03 / 1.11 / 1.21, Q4_K 1.21 / 1.26 / 1.33, Q6_K 1.16 /
#: 1.30 / 1.41, Q8_0 0.78 / 0.84 / 0.91.
MIN_ROWS = 8
#: Q4_1's (the panel / ggml_gemm at M = 8 / 16 / 32: 0.97 / 1.02 / 1.10; Q5_1 1.02 / 1.16 /
#: 1.26, Q5_K 1.23 / 1.34 / 1.35).
MIN_ROWS_Q4_1 = 16
#: VNNI path: Q5_0 / Q4_1 / Q5_1 from this many rows (bench/bench_ggml_panel.py --rounds 15
#: --paths vnni,vpanel --ms 8,16,32, one thread, zmm panel / ggml_gemm's VNNI path at M = 8 / 16
#: / 32, 896 x 896 and 896 x 4864: Q5_0 0.99 / 1.11 / 1.14, 0.88 / 1.05 / 1.25; Q4_1 0.97 / 1.06
#: / 1.13, 0.83 / 0.99 / 1.15; Q5_1 1.03 / 1.12 / 1.19, 0.98 / 1.02 / 1.17; the k-quants 1.10 -
#: 1.29 at M = 8, 1.22 - 1.72 above).
MIN_ROWS_VNNI = 16
#: VNNI path, Q8_0 (0.92 / 1.02 / 1.04 and 0.91 / 1.00 / 1.14 at M = 8 / 16 / 32).
MIN_ROWS_VNNI_Q8_0 = 32
#: fewest activation rows per row block (:func:`block_rows`).
MIN_BLOCK_ROWS = 64
#: per kind: (32-blocks per record, chunk groups summed separately (Q6_K: 16-halves), signed).
SPECS = {
    8: (1, (tuple(range(8)),), True),
    6: (1, (tuple(range(8)),), False),
    3: (1, (tuple(range(8)),), False),
    7: (1, (tuple(range(8)),), False),
    12: (8, (tuple(range(8)),), False),
    13: (8, (tuple(range(8)),), False),
    14: (8, ((0, 1, 2, 3), (4, 5, 6, 7)), False),
}
#: float32 x 8 slots of panel scales per 32-block.
NSC = 3


def _store(context, builder, aty, arr, off, val):
    builder.store(val, elem_ptr(context, builder, aty, arr, off, val.type), align=1)


def _emit_decode(kind, vnni, context, builder, sig, args, w=1):
    """One record -> the panel: codes (and Q8_0 signs) of its ``nsub`` 32-blocks at byte ``po``,
    scales at float ``so`` (layout of the module docstring; ``vnni``: Q8_0's codes are
    ``u = q + 128``, no signs)."""
    dat, ro, pan, po, sgn, psc, so = args
    at = sig.args
    e = Emit(context, builder, at[0], dat, ro)
    nsub = SPECS[kind][0]
    absb = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(LV32I8, [LV32I8, ir.IntType(1)]), "llvm.abs.v32i8")
    d = e.f16x8(0)
    dmin = e.f16x8(16) if kind in (3, 7, 12, 13) else None  # (Q4_1 / Q5_1: m)
    for sub in range(nsub):
        for t in range(8):
            u = _chunk(e, kind, sub, t)
            o = builder.add(po, ir.Constant(po.type, w * (256 * sub + 32 * t)))
            if kind == 8 and not vnni:
                q = builder.xor(u, ir.Constant(LV32I8, [0x80] * 32))
                _store(context, builder, at[4], sgn, o, q)
                u = builder.call(absb, [q, ir.Constant(ir.IntType(1), 0)])
            _store(context, builder, at[2], pan, o, u)
        so_s = builder.add(so, ir.Constant(so.type, w * 8 * NSC * sub))

        def put(slot, v, so_s=so_s):
            _store(context, builder, at[5], psc,
                   builder.add(so_s, ir.Constant(so.type, w * 8 * slot)), v)
        if kind in (12, 13):
            sc, mn = k4_scales(e, sub)
            put(0, builder.fmul(d, builder.sitofp(sc, LV8F32)))
            put(1, builder.fmul(dmin, builder.sitofp(mn, LV8F32)))
        elif kind == 14:
            put(0, d)
            put(1, builder.bitcast(e.bytes8(16 + 8 * (2 * sub), signed=True), LV8F32))
            put(2, builder.bitcast(e.bytes8(16 + 8 * (2 * sub + 1), signed=True), LV8F32))
        elif kind in (3, 7):
            put(0, d)
            put(1, dmin)
        else:
            put(0, d)
    return context.get_dummy_value()


def _make_decode(kind, vnni=False, w=1):
    @intrinsic
    def dec(typingctx, data, roff, panel, po, signs, scales, so):
        if not (check_array_arg(data, types.uint8) and check_array_arg(panel, types.uint8)
                and check_array_arg(signs, types.uint8)
                and check_array_arg(scales, types.float32)):
            return None
        sig = types.none(data, types.intp, panel, types.intp, signs, scales, types.intp)
        return sig, (lambda context, builder, sig, args:
                     _emit_decode(kind, vnni, context, builder, sig, args, w))
    return dec


def _epilogue(kind, builder, a, sums, sc, xd, x8, t16):
    """``a`` + the float32 operations of ``ggml_packed._make_rec_i8`` for one (row, group,
    32-block): ``sums`` the exact int32 lanes per chunk group, ``sc`` the panel scale slots,
    ``xd`` the row's d_x (splat), ``x8`` = 8 sum(xq) (int32), ``t16`` the two 16-half sums.
    Lane-wise: 8 lanes (one slot) or 16 (two slots, the zmm tiles)."""
    vf = a.type
    vi = ir.VectorType(I32, vf.count)
    if kind == 14:
        c32 = ir.Constant(I32, 32)
        s0 = builder.sub(sums[0], splat(builder, builder.mul(t16[0], c32), vi))
        s1 = builder.sub(sums[1], splat(builder, builder.mul(t16[1], c32), vi))
        sc0 = builder.bitcast(sc[1], vi)
        sc1 = builder.bitcast(sc[2], vi)
        tot = builder.add(builder.mul(sc0, s0), builder.mul(sc1, s1))
        return builder.fadd(a, builder.fmul(builder.sitofp(tot, vf),
                                            builder.fmul(sc[0], xd)))
    (s,) = sums
    if kind in (3, 7):
        sx = builder.sitofp(builder.ashr(x8, ir.Constant(I32, 3)), F32)
        f = builder.fadd(builder.fmul(builder.sitofp(s, vf), builder.fmul(sc[0], xd)),
                         builder.fmul(sc[1], builder.fmul(xd, splat(builder, sx, vf))))
        return builder.fadd(a, f)
    if kind in (12, 13):
        sx = builder.sitofp(builder.ashr(x8, ir.Constant(I32, 3)), F32)
        f = builder.fsub(builder.fmul(sc[0], builder.sitofp(s, vf)),
                         builder.fmul(sc[1], splat(builder, sx, vf)))
        return builder.fadd(a, builder.fmul(f, xd))
    if kind == 6:
        s = builder.sub(s, splat(builder, builder.shl(x8, ir.Constant(I32, 1)), vi))
    return builder.fadd(a, builder.fmul(builder.sitofp(s, vf), builder.fmul(sc[0], xd)))


def _emit_tile(kind, ngr, nrows, context, builder, sig, args):
    """One 32-block for ``nrows`` activation rows x ``ngr`` panel slots (from ``po`` / ``so``,
    ``pst`` / ``sst`` apart): ``acc[ngr r + j]`` (row ``r``, slot ``j``) += the block's
    contribution (module docstring). Chunk-outer: per chunk the slots' panel vectors are loaded
    once and each row's broadcast activations serve every slot; live: the ``ngr nrows`` int16
    sums and float32 accumulators, ``ngr`` panel vectors (Q8_0: and their signs), one
    broadcast (the VNNI path: :func:`_emit_ztile`)."""
    accs, pan, po, pst, sgn, psc, so, sst, xqa, xo, kx, xda, s8a, s16a, bo, kbx = args
    at = sig.args
    a = [builder.extract_value(accs, i) for i in range(ngr * nrows)]
    pj = [po]
    sj = [so]
    for _ in range(1, ngr):
        pj.append(builder.add(pj[-1], pst))
        sj.append(builder.add(sj[-1], sst))

    def pvec(arr_i, j, t):
        o = builder.add(pj[j], ir.Constant(po.type, 32 * t))
        arr = pan if arr_i == 1 else sgn
        return builder.load(elem_ptr(context, builder, at[arr_i], arr, o, LV32I8), align=1)
    xr = [builder.add(xo, builder.mul(kx, ir.Constant(kx.type, r))) for r in range(nrows)]
    br = [builder.add(bo, builder.mul(kbx, ir.Constant(kbx.type, r))) for r in range(nrows)]
    sums = _avx2_sums(context, builder, at, pvec, xqa, xr, ngr, nrows, kind)
    for r in range(nrows):
        xd = splat(builder, load_f32(context, builder, at[11], xda, br[r]), LV8F32)
        x8 = load_i32(context, builder, at[12], s8a, br[r]) if kind != 8 and kind != 14 else None
        t16 = None
        if kind == 14:
            i16 = builder.mul(br[r], ir.Constant(br[r].type, 2))
            t16 = [load_i32(context, builder, at[13], s16a, i16),
                   load_i32(context, builder, at[13], s16a,
                            builder.add(i16, ir.Constant(i16.type, 1)))]
        for j in range(ngr):
            sc = [builder.load(elem_ptr(context, builder, at[5], psc,
                                        builder.add(sj[j], ir.Constant(so.type, 8 * s)),
                                        LV8F32), align=1) for s in range(NSC)]
            i = ngr * r + j
            a[i] = _epilogue(kind, builder, a[i], sums[i], sc, xd, x8, t16)
    return context.make_tuple(builder, sig.return_type, a)


def _avx2_sums(context, builder, at, pvec, xqa, xr, ngr, nrows, kind):
    """``[ngr r + j][chunk group]`` exact int32 sums, AVX2: per chunk the slots' panel vectors
    loaded once, each row's broadcast used for every slot, ``vpmaddubsw`` pair sums added in
    int16 over :data:`~.ggml_gemm.I16_TERMS` chunks, ``vpmaddwd`` with ones (Q8_0: ``vpsignb``
    of the activations by the stored ``q``)."""
    _, groups, signed = SPECS[kind]
    terms = I16_TERMS[kind]

    def fn(name, ret, argt):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argt), name)
    mub = fn("llvm.x86.avx2.pmadd.ub.sw", LV16I16, [LV32I8, LV32I8])
    mwd = fn("llvm.x86.avx2.pmadd.wd", LV8I32, [LV16I16, LV16I16])
    psign = fn("llvm.x86.avx2.psign.b", LV32I8, [LV32I8, LV32I8])
    ones = ir.Constant(LV16I16, [1] * 16)
    sums = [[None] * len(groups) for _ in range(ngr * nrows)]
    for gi, grp in enumerate(groups):
        s16 = [None] * (ngr * nrows)
        for c, t in enumerate(grp):
            us = [pvec(1, j, t) for j in range(ngr)]
            qs = [pvec(4, j, t) for j in range(ngr)] if signed else None
            for r in range(nrows):
                xb = xbcast(context, builder, at[8], xqa, xr[r], t)
                for j in range(ngr):
                    x2 = builder.call(psign, [xb, qs[j]]) if signed else xb
                    p = builder.call(mub, [us[j], x2])
                    i = ngr * r + j
                    s16[i] = p if s16[i] is None else builder.add(s16[i], p)
                    if (c + 1) % terms == 0 or c + 1 == len(grp):
                        w = builder.call(mwd, [s16[i], ones])
                        sums[i][gi] = w if sums[i][gi] is None else builder.add(sums[i][gi], w)
                        s16[i] = None
    return sums


def _make_tile(kind, ngr, nrows):
    tup = types.UniTuple(V8F32, ngr * nrows)

    @intrinsic
    def tile(typingctx, accs, panel, po, pst, signs, scales, so, sst, xq, xo, kx, xd, xs8,
             xs16, bo, kbx):
        if not (accs == tup and check_array_arg(panel, types.uint8)
                and check_array_arg(signs, types.uint8)
                and check_array_arg(scales, types.float32) and check_array_arg(xq, types.int8)
                and check_array_arg(xd, types.float32) and check_array_arg(xs8, types.int32)
                and check_array_arg(xs16, types.int32)):
            return None
        ip = types.intp
        sig = tup(tup, panel, ip, ip, signs, scales, ip, ip, xq, ip, ip, xd, xs8, xs16, ip, ip)
        return sig, (lambda context, builder, sig, args:
                     _emit_tile(kind, ngr, nrows, context, builder, sig, args))
    return tile


def _emit_ztile(kind, nrows, context, builder, sig, args):
    """VNNI path, zmm: one 32-block for ``nrows`` rows x both slots of the interleaved panel
    (:data:`ZW`): per chunk one 64-byte load (slot 0 lanes 0-7, slot 1 lanes 8-15), per row one
    16-lane broadcast and one ``vpdpbusd`` zmm per chunk; the epilogue on 16 lanes (the same
    lane-wise operations). ``acc[2r + j]`` as :func:`_emit_tile`."""
    accs, pan, po, psc, so, xqa, xo, kx, xda, s8a, s16a, bo, kbx = args
    at = sig.args
    lv16i32 = ir.VectorType(I32, 16)
    lv64i8 = ir.VectorType(ir.IntType(8), 64)
    lv16f32 = ir.VectorType(F32, 16)
    lo = ir.Constant(LV8I32, list(range(8)))
    a = []
    for r in range(nrows):
        a0, a1 = builder.extract_value(accs, 2 * r), builder.extract_value(accs, 2 * r + 1)
        a.append(builder.shuffle_vector(a0, a1, ir.Constant(lv16i32, list(range(16)))))
    _, groups, signed = SPECS[kind]
    dp = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(lv16i32, [lv16i32, lv64i8, lv64i8]),
        "llvm.x86.avx512.vpdpbusd.512")
    xr = [builder.add(xo, builder.mul(kx, ir.Constant(kx.type, r))) for r in range(nrows)]
    br = [builder.add(bo, builder.mul(kbx, ir.Constant(kbx.type, r))) for r in range(nrows)]
    x8 = [load_i32(context, builder, at[9], s8a, b) for b in br]
    zero = ir.Constant(lv16i32, [0] * 16)
    sums = [[None] * len(groups) for _ in range(nrows)]
    for gi, grp in enumerate(groups):
        acc = [splat(builder, builder.sub(ir.Constant(I32, 0), builder.shl(
            x8[r], ir.Constant(I32, 4))), lv16i32) if signed else zero for r in range(nrows)]
        for t in grp:
            o = builder.add(po, ir.Constant(po.type, 64 * t))
            u = builder.load(elem_ptr(context, builder, at[1], pan, o, lv64i8), align=1)
            for r in range(nrows):
                xo_t = builder.add(xr[r], ir.Constant(xo.type, 4 * t))
                xv = builder.load(elem_ptr(context, builder, at[5], xqa, xo_t, I32), align=1)
                xb = builder.bitcast(splat(builder, xv, lv16i32), lv64i8)
                acc[r] = builder.call(dp, [acc[r], u, xb])
        for r in range(nrows):
            sums[r][gi] = acc[r]
    sc = [builder.load(elem_ptr(context, builder, at[3], psc,
                                builder.add(so, ir.Constant(so.type, 16 * i)), lv16f32), align=1)
          for i in range(NSC)]
    out = []
    for r in range(nrows):
        xd = splat(builder, load_f32(context, builder, at[8], xda, br[r]), lv16f32)
        t16 = None
        if kind == 14:
            i16 = builder.mul(br[r], ir.Constant(br[r].type, 2))
            t16 = [load_i32(context, builder, at[10], s16a, i16),
                   load_i32(context, builder, at[10], s16a,
                            builder.add(i16, ir.Constant(i16.type, 1)))]
        v = _epilogue(kind, builder, a[r], sums[r], sc, xd, x8[r], t16)
        out.append(builder.shuffle_vector(v, v, lo))
        out.append(builder.shuffle_vector(v, v, ir.Constant(LV8I32, list(range(8, 16)))))
    return context.make_tuple(builder, sig.return_type, out)


def _make_ztile(kind):
    """The zmm tile of ``kind`` for ``n`` rows: ``accs`` a tuple of ``2 n`` float32 x 8."""
    @intrinsic
    def tile(typingctx, accs, panel, po, scales, so, xq, xo, kx, xd, xs8, xs16, bo, kbx):
        if not (isinstance(accs, types.UniTuple) and accs.dtype == V8F32 and accs.count % 2 == 0
                and check_array_arg(panel, types.uint8)
                and check_array_arg(scales, types.float32) and check_array_arg(xq, types.int8)
                and check_array_arg(xd, types.float32) and check_array_arg(xs8, types.int32)
                and check_array_arg(xs16, types.int32)):
            return None
        ip = types.intp
        sig = accs(accs, panel, ip, scales, ip, xq, ip, ip, xd, xs8, xs16, ip, ip)
        if not HOST_VNNI:  # the zmm instruction cannot be compiled here (never called)
            return sig, lambda context, builder, sig, args: args[0]
        return sig, (lambda context, builder, sig, args:
                     _emit_ztile(kind, accs.count // 2, context, builder, sig, args))
    return tile

def _make_zeros(n):
    @intrinsic
    def zeros(typingctx):
        tup = types.UniTuple(V8F32, n)

        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, tup, [ir.Constant(LV8F32, [0.0] * 8)] * n)
        return tup(), codegen
    return zeros


_zeros = _make_zeros(TILE_GROUPS * ROWS)
_zeros1 = _make_zeros(TILE_GROUPS)
_KINDS = (8, 6, 12, 14, 3, 7, 13)
(_dec_q8_0, _dec_q5_0, _dec_q4_k, _dec_q6_k, _dec_q4_1, _dec_q5_1,
 _dec_q5_k) = (_make_decode(k) for k in _KINDS)
(_tile_q8_0, _tile_q5_0, _tile_q4_k, _tile_q6_k, _tile_q4_1, _tile_q5_1,
 _tile_q5_k) = (_make_tile(k, TILE_GROUPS, ROWS) for k in _KINDS)
(_one_q8_0, _one_q5_0, _one_q4_k, _one_q6_k, _one_q4_1, _one_q5_1,
 _one_q5_k) = (_make_tile(k, TILE_GROUPS, 1) for k in _KINDS)
_vzeros = _make_zeros(TILE_GROUPS * VROWS)
(_zdec_q8_0, _zdec_q5_0, _zdec_q4_k, _zdec_q6_k, _zdec_q4_1, _zdec_q5_1,
 _zdec_q5_k) = (_make_decode(k, True, 2) for k in _KINDS)
(_ztile_q8_0, _ztile_q5_0, _ztile_q4_k, _ztile_q6_k, _ztile_q4_1, _ztile_q5_1,
 _ztile_q5_k) = (_make_ztile(k) for k in _KINDS)


@njit(**JIT)
def use_panel(kind, m, vnni):
    """True when :func:`~.ggml_packed._groups` should run :func:`panel_groups` for ``m`` rows.

    AVX2 path (``vnni`` false): from :data:`MIN_ROWS` rows for Q5_0, Q5_1, Q4_K, Q5_K and Q6_K,
    from :data:`MIN_ROWS_Q4_1` for Q4_1. Not Q8_0: its decode is a load, so the panel saves
    :mod:`.ggml_gemm` nothing, and its multiply costs the same there (the sign trick's
    ``vpsignb`` per multiply; storing ``u = q + 128`` in two nibble planes, ``S = S_lo + 16
    S_hi - 128 sum(xq)``, exact, takes two ``vpmaddubsw`` per chunk instead: measured 0.89-0.97x
    ggml_gemm, the sign-trick panel 0.96-1.13x, bench/bench_ggml_panel.py --kinds Q8_0).

    VNNI path (the ``vpdpbusd`` tiles): the k-quants from :data:`MIN_ROWS`, Q5_0 / Q4_1 / Q5_1
    from :data:`MIN_ROWS_VNNI`, Q8_0 from :data:`MIN_ROWS_VNNI_Q8_0` (module docstring)."""
    if vnni:
        if kind == 12 or kind == 13 or kind == 14:
            return m >= MIN_ROWS
        if kind == 8:
            return m >= MIN_ROWS_VNNI_Q8_0
        return (kind == 3 or kind == 6 or kind == 7) and m >= MIN_ROWS_VNNI
    if kind == 3:
        return m >= MIN_ROWS_Q4_1
    return (kind == 6 or kind == 7 or kind == 12 or kind == 13 or kind == 14) and m >= MIN_ROWS


@njit(**JIT)
def _decode(kind, data, g, panel, po, signs, scales, so):
    """Every record of group ``g`` into the panel slot at byte ``po`` / float ``so``."""
    nrec = data.shape[1]
    rb = data.shape[2]
    nsub = 1 if kind == 6 or kind == 8 or kind == 3 or kind == 7 else 8
    for s in range(nrec):
        ro = (g * nrec + s) * rb
        p = po + 256 * nsub * s
        q = so + 8 * NSC * nsub * s
        if kind == 8:
            _dec_q8_0(data, ro, panel, p, signs, scales, q)
        elif kind == 6:
            _dec_q5_0(data, ro, panel, p, signs, scales, q)
        elif kind == 12:
            _dec_q4_k(data, ro, panel, p, signs, scales, q)
        elif kind == 3:
            _dec_q4_1(data, ro, panel, p, signs, scales, q)
        elif kind == 7:
            _dec_q5_1(data, ro, panel, p, signs, scales, q)
        elif kind == 13:
            _dec_q5_k(data, ro, panel, p, signs, scales, q)
        else:
            _dec_q6_k(data, ro, panel, p, signs, scales, q)


@njit(**JIT)
def _tile(kind, nb, panel, po, pst, signs, scales, so, sst, xq, xd, xs8, xs16, i0):
    """Activation rows ``i0 .. i0 + ROWS - 1`` x both slots: ``2 ROWS`` float32 x 8
    accumulators (``[2r + j]``)."""
    kx = xq.shape[1]
    kbx = xd.shape[1]
    xo = i0 * kx
    bo = i0 * kbx
    acc = _zeros()
    if kind == 8:
        for b in range(nb):
            acc = _tile_q8_0(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 6:
        for b in range(nb):
            acc = _tile_q5_0(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 12:
        for b in range(nb):
            acc = _tile_q4_k(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 3:
        for b in range(nb):
            acc = _tile_q4_1(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 7:
        for b in range(nb):
            acc = _tile_q5_1(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 13:
        for b in range(nb):
            acc = _tile_q5_k(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    else:
        for b in range(nb):
            acc = _tile_q6_k(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    return acc


@njit(**JIT)
def _one(kind, nb, panel, po, pst, signs, scales, so, sst, xq, xd, xs8, xs16, i):
    """Activation row ``i`` x both slots (``[j]``)."""
    kx = xq.shape[1]
    kbx = xd.shape[1]
    xo = i * kx
    bo = i * kbx
    acc = _zeros1()
    if kind == 8:
        for b in range(nb):
            acc = _one_q8_0(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 6:
        for b in range(nb):
            acc = _one_q5_0(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 12:
        for b in range(nb):
            acc = _one_q4_k(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 3:
        for b in range(nb):
            acc = _one_q4_1(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 7:
        for b in range(nb):
            acc = _one_q5_1(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    elif kind == 13:
        for b in range(nb):
            acc = _one_q5_k(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    else:
        for b in range(nb):
            acc = _one_q6_k(acc, panel, po + 256 * b, pst, signs, scales, so + 8 * NSC * b,
                             sst, xq, xo + 32 * b, kx, xd, xs8, xs16, bo + b, kbx)
    return acc


@njit(**JIT)
def _zdecode(kind, data, g, panel, po, signs, scales, so):
    """:func:`_decode` into the interleaved (zmm) panel: slot ``j`` at byte ``32 j`` / float
    ``8 j``, 64-byte chunks, 512-byte 32-blocks."""
    nrec = data.shape[1]
    rb = data.shape[2]
    nsub = 1 if kind == 6 or kind == 8 or kind == 3 or kind == 7 else 8
    for s in range(nrec):
        ro = (g * nrec + s) * rb
        p = po + 512 * nsub * s
        q = so + 16 * NSC * nsub * s
        if kind == 8:
            _zdec_q8_0(data, ro, panel, p, signs, scales, q)
        elif kind == 6:
            _zdec_q5_0(data, ro, panel, p, signs, scales, q)
        elif kind == 12:
            _zdec_q4_k(data, ro, panel, p, signs, scales, q)
        elif kind == 3:
            _zdec_q4_1(data, ro, panel, p, signs, scales, q)
        elif kind == 7:
            _zdec_q5_1(data, ro, panel, p, signs, scales, q)
        elif kind == 13:
            _zdec_q5_k(data, ro, panel, p, signs, scales, q)
        else:
            _zdec_q6_k(data, ro, panel, p, signs, scales, q)


@njit(**JIT)
def _ztile(kind, nb, panel, scales, xq, xd, xs8, xs16, i0, acc):
    """Rows ``i0 ..`` (as many as ``acc`` holds: :data:`VROWS` or 1) x both slots of the
    interleaved panel, ``acc`` its zeros."""
    kx = xq.shape[1]
    kbx = xd.shape[1]
    xo = i0 * kx
    bo = i0 * kbx
    for b in range(nb):
        po = 512 * b
        so = 16 * NSC * b
        xb = xo + 32 * b
        if kind == 8:
            acc = _ztile_q8_0(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
        elif kind == 6:
            acc = _ztile_q5_0(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
        elif kind == 12:
            acc = _ztile_q4_k(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
        elif kind == 3:
            acc = _ztile_q4_1(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
        elif kind == 7:
            acc = _ztile_q5_1(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
        elif kind == 13:
            acc = _ztile_q5_k(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
        else:
            acc = _ztile_q6_k(acc, panel, po, scales, so, xq, xb, kx, xd, xs8, xs16, bo + b, kbx)
    return acc


@njit(**JIT)
def _aligned(nbytes):
    """A 64-byte aligned uint8 buffer of ``nbytes`` (sliced from a larger one)."""
    raw = np.empty(nbytes + 64, np.uint8)
    off = (64 - raw.ctypes.data % 64) % 64
    return raw[off:off + nbytes]


@njit(**JIT)
def block_rows(kx):
    """Activation rows per row block (:data:`~.ggml_gemm.BLOCK_BYTES` of int8 codes, L2), at
    least :data:`MIN_BLOCK_ROWS` (the decode of a pair is amortized over a block)."""
    return max(MIN_BLOCK_ROWS, BLOCK_BYTES // kx // ROWS * ROWS)


@njit(**JIT)
def panel_groups(kind, data, g0, g1, xq, xd, xs8, xs16, m, n, out, facc, vnni):
    """Groups ``g0 .. g1 - 1`` of ``out[:m]`` (activations already quantized, Q6_K's per-16
    sums in ``xs16``): activation rows in blocks of :func:`block_rows`; per block, group pairs
    decoded once into a panel (module docstring), then the block's rows in tiles of
    :data:`ROWS` (``vnni``: :data:`VROWS`, ``vpdpbusd``; only on a VNNI host) and one at a
    time. Bitwise ``ggml_packed._row_i8`` per output row."""
    panel_rows(kind, data, g0, g1, xq, xd, xs8, xs16, m, n, out, facc, block_rows(xq.shape[1]),
               vnni)


@njit(**JIT)
def panel_rows(kind, data, g0, g1, xq, xd, xs8, xs16, m, n, out, facc, mb, vnni):
    """:func:`panel_groups` with row blocks of ``mb`` rows."""
    nsub = 1 if kind == 6 or kind == 8 or kind == 3 or kind == 7 else 8
    nb = data.shape[1] * nsub
    pst = 256 * nb
    sst = 8 * NSC * nb
    panel = _aligned(2 * pst)
    signs = _aligned(2 * pst if kind == 8 and not vnni else 64)
    scales = _aligned(4 * 2 * sst).view(np.float32)
    rows = VROWS if vnni else ROWS
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        mt = ib + (ie - ib) // rows * rows
        # bytes of the next pair's records prefetched per tile (64-byte lines, over the tiles)
        pf0 = (2 * data.shape[1] * data.shape[2] * rows // max(mt - ib, 1) + 63) // 64 * 64
        g = g0
        while g < g1:
            g2 = g + 1 if g + 1 < g1 else g  # an odd last group: both slots, slot 1 not stored
            if vnni:
                _zdecode(kind, data, g, panel, 0, signs, scales, 0)
                _zdecode(kind, data, g2, panel, 32, signs, scales, 8)
            else:
                _decode(kind, data, g, panel, 0, signs, scales, 0)
                _decode(kind, data, g2, panel, pst, signs, scales, sst)
            nslot = 2 if g2 != g else 1
            pf = (g + 2) * data.shape[1] * data.shape[2]  # the next pair's records, into L2
            for i0 in range(ib, mt, rows):
                for o in range(pf0 * (i0 - ib) // rows, pf0 * (i0 - ib + rows) // rows, 64):
                    _prefetch_l2(data, pf + o)
                if vnni:
                    zacc = _ztile(kind, nb, panel, scales, xq, xd, xs8, xs16, i0, _vzeros())
                    for r in range(VROWS):
                        for j in range(nslot):
                            store_group(zacc[TILE_GROUPS * r + j], facc, g + j, i0 + r, n, out)
                else:
                    acc = _tile(kind, nb, panel, 0, pst, signs, scales, 0, sst, xq, xd, xs8,
                                xs16, i0)
                    for r in range(ROWS):
                        for j in range(nslot):
                            store_group(acc[TILE_GROUPS * r + j], facc, g + j, i0 + r, n, out)
            for i in range(mt, ie):
                if vnni:
                    acc1 = _ztile(kind, nb, panel, scales, xq, xd, xs8, xs16, i, _zeros1())
                else:
                    acc1 = _one(kind, nb, panel, 0, pst, signs, scales, 0, sst, xq, xd, xs8,
                                xs16, i)
                for j in range(nslot):
                    store_group(acc1[j], facc, g + j, i, n, out)
            g += 2
