"""Exact-mode prefill of the ggml group records in float32 x 16 vectors (AVX-512 VNNI hosts,
the ``vnni`` path of :mod:`.ggml_packed`).

The float panel of :mod:`.ggml_gemm` (:func:`~.ggml_gemm.panel_f32`) decodes a group's records
once per L2 row block into float32 and runs tiles of rows over it in float32 x 8 vectors, one
group's 8 output rows per vector. Here the two groups of a pair are decoded into one interleaved
panel (code ``q`` of group ``g`` at ``16 q + lane``, of group ``g + 1`` at ``16 q + 8 + lane``)
and the tiles work on float32 x 16 vectors: one 16-lane FMA does both groups' FMAs of a (row,
code), so each panel load and each broadcast activation feeds 16 lanes, and the 32 vector
registers hold :data:`ROWS_Z` rows' chains, accumulators and half sums. Per lane the operations
are those of the 8-lane tile (:func:`~.ggml_gemm._emit_tile_f32`) in the same order, the two
records' block scales side by side (:func:`~.ggml_ir.concat`), so every row is bitwise the one-row
kernel's (``ggml_packed._row_f32``; tests/kernels/test_ggml_gemm.py).

Measured, one thread, Zen 4 (``python bench/bench_ggml_exact.py --rounds 5 --kinds Q4_K,Q8_0``,
empty numba cache, % of the thread's FMA peak, gate/up and down at M = 128 / 512): 8-lane
2-group panel -> 16-lane panel Q8_0 49-52 -> 64-73 %, Q4_K 38-41 -> 60-64 %.

Without AVX-512 the 16-lane tile is never called (``vnni`` is False) and emits nothing: LLVM
cannot give a 512-bit value to the ordering barrier's inline asm there (it exits the process).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from .config import JIT
from .ggml_gemm import (BARRIER, _after, _combine_f32, _fma_fn, _make_decode, _make_load_accs,
                        panel_floats)
from .ggml_ir import I32, KQ, LV16F32, MIN32, Emit, concat, idx, load_f32, nsub
from .packed_i8 import (HOST_VNNI, V8F32, check_array_arg, elem_ptr, fstore, prefetch, splat,
                        store_group)
from .packed_i8_gemm import V16F32

__all__ = ["ROWS_Z", "panel_f32z"]

#: exact mode, float panel of 2 groups in float32 x 16 vectors (:func:`panel_f32z`): activation
#: rows per tile (2 of the 4 chains of each row live at a time: 2 x 6 zmm, beside 6
#: accumulators, 6 first half sums and, during a half's second chain pair, its first pair's 6
#: sums -- about the 32 registers; 4 and 8 rows were not measured apart from it).
ROWS_Z = 6


def _emit_tile_z(kind, nrows, context, builder, sig, args):
    """IR of one record of each of two groups (records at ``ro0`` / ``ro1``, codes read from the
    interleaved float panel at ``po``: ``panel[po + 16 q + 8 gi + lane]``,
    :func:`~.ggml_gemm._emit_decode` with stride 16) in exact mode for ``nrows`` activation rows, in
    float32 x 16 vectors (lanes 0-7 the first group, 8-15 the second). Per lane the operations and
    their order are those of :func:`~.ggml_gemm._emit_tile_f32` (bitwise
    ``ggml_packed._make_rec_f32``): one 16-lane FMA does the two groups' FMAs of a (row, code), so
    each panel load and each broadcast activation feeds twice the lanes of the 8-lane tile;
    accumulator ``r`` holds row ``r`` of both groups."""
    accs, pan, po, dat, ro0, ro1, xa, xoff, kx, xsa, boff, kbx = args
    at = sig.args
    a = [builder.extract_value(accs, r) for r in range(nrows)]
    es = [Emit(context, builder, at[3], dat, ro) for ro in (ro0, ro1)]
    d = concat(builder, [e.f16x8(0) for e in es])
    dmin = (concat(builder, [e.f16x8(16) for e in es]) if kind in KQ or kind in MIN32 else None)
    fma = _fma_fn(builder, LV16F32)
    zero = ir.Constant(LV16F32, [0.0] * 16)
    xo_r = [builder.add(xoff, builder.mul(kx, ir.Constant(kx.type, r))) for r in range(nrows)]
    bo_r = [builder.add(boff, builder.mul(kbx, ir.Constant(kbx.type, r))) for r in range(nrows)]
    prev = []
    for sub in range(nsub(kind)):
        xo_s = [idx(builder, xo, 32 * sub) for xo in xo_r]
        halves = [[] for _ in range(nrows)]
        for grp in ((0, 1, 2, 3), (4, 5, 6, 7)):
            pair = []
            for jp in ((0, 1), (2, 3)):
                z = _after(builder, zero, prev) if BARRIER else zero
                ch = [[z] * 2 for _ in range(nrows)]
                for t in grp:
                    for c, j in enumerate(jp):
                        q = 32 * sub + 4 * t + j
                        w = builder.load(elem_ptr(context, builder, at[1], pan,
                                                  idx(builder, po, 16 * q), LV16F32), align=4)
                        for r in range(nrows):
                            xv = splat(builder, load_f32(context, builder, at[6], xa,
                                                         idx(builder, xo_s[r], 4 * t + j)),
                                       LV16F32)
                            ch[r][c] = builder.call(fma, [w, xv, ch[r][c]])
                pair.append([builder.fadd(ch[r][0], ch[r][1]) for r in range(nrows)])
                prev = pair[-1]
            for r in range(nrows):
                halves[r].append(builder.fadd(pair[0][r], pair[1][r]))

        def sx(r, sub=sub):
            return splat(builder, load_f32(context, builder, at[9], xsa,
                                           idx(builder, bo_r[r], sub)), LV16F32)
        a = _combine_f32(kind, es, builder, fma, d, dmin, sub, halves, a, sx)
    return context.make_tuple(builder, sig.return_type, a)


def _make_tile_z(kind, nrows):
    tup = types.UniTuple(V16F32, nrows)

    @intrinsic
    def tile(typingctx, accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx):
        if not (accs == tup and check_array_arg(panel, types.float32)
                and check_array_arg(data, types.uint8)
                and check_array_arg(x, types.float32) and check_array_arg(xsum, types.float32)):
            return None
        sig = tup(tup, panel, types.intp, data, types.intp, types.intp, x, types.intp,
                  types.intp, xsum, types.intp, types.intp)
        return sig, (lambda context, builder, sig, args:
                     _emit_tile_z(kind, nrows, context, builder, sig, args) if HOST_VNNI
                     else args[0])  # never called without AVX-512 (the vnni flag is False)
    return tile


@intrinsic
def _halves_z(typingctx, v):
    """The two float32 x 8 halves (lanes 0-7, 8-15) of a float32 x 16 vector."""
    if v != V16F32:
        return None

    def codegen(context, builder, sig, args):
        lo, hi = (builder.shuffle_vector(args[0], args[0], ir.Constant(
            ir.VectorType(I32, 8), list(range(h, h + 8)))) for h in (0, 8))
        return context.make_tuple(builder, sig.return_type, [lo, hi])
    return types.UniTuple(V8F32, 2)(V16F32), codegen


(_ztile_q8_0, _ztile_q5_0, _ztile_q4_k, _ztile_q6_k, _ztile_q4_1, _ztile_q5_1,
 _ztile_q5_k) = (_make_tile_z(k, ROWS_Z) for k in (8, 6, 12, 14, 3, 7, 13))
(_zdec_q8_0, _zdec_q5_0, _zdec_q4_k, _zdec_q6_k, _zdec_q4_1, _zdec_q5_1,
 _zdec_q5_k) = (_make_decode(k, 16) for k in (8, 6, 12, 14, 3, 7, 13))

_load_accs_z = _make_load_accs(ROWS_Z, 16)


@njit(**JIT)
def _decode_z(kind, data, ro, panel, po):
    if kind == 8:
        _zdec_q8_0(data, ro, panel, po)
    elif kind == 6:
        _zdec_q5_0(data, ro, panel, po)
    elif kind == 3:
        _zdec_q4_1(data, ro, panel, po)
    elif kind == 7:
        _zdec_q5_1(data, ro, panel, po)
    elif kind == 12:
        _zdec_q4_k(data, ro, panel, po)
    elif kind == 13:
        _zdec_q5_k(data, ro, panel, po)
    else:
        _zdec_q6_k(data, ro, panel, po)


@njit(inline="always", **JIT)
def _tile_z(kind, accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx):
    if kind == 8:
        return _ztile_q8_0(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)
    elif kind == 6:
        return _ztile_q5_0(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)
    elif kind == 3:
        return _ztile_q4_1(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)
    elif kind == 7:
        return _ztile_q5_1(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)
    elif kind == 12:
        return _ztile_q4_k(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)
    elif kind == 13:
        return _ztile_q5_k(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)
    return _ztile_q6_k(accs, panel, po, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)


@njit(**JIT)
def panel_f32z(kind, data, g, x, xsum, ib, ie, n, out, facc, panel, accb):
    """Exact mode on an AVX-512 VNNI host, groups ``g`` and ``g + 1``, activation rows ``ib .. ib +
    T ROWS_Z - 1`` (``T = (ie - ib) // ROWS_Z``; returns the first row not done): as
    :func:`~.ggml_gemm.panel_f32` with the two groups' records decoded into one interleaved
    panel (``panel`` float32 [>= 2 panel_floats]) and tiles of :data:`ROWS_Z` rows in float32 x
    16 vectors (:func:`_emit_tile_z`; accumulators kept in ``accb`` float32 [>= 16 T ROWS_Z]
    between panels); every output row bitwise ``ggml_packed._row_f32``'s."""
    nrec = data.shape[1]
    rb = data.shape[2]
    ns = 1 if kind == 3 or kind == 6 or kind == 7 or kind == 8 else 8
    rf = 256 * ns
    cr = panel_floats(kind) // rf
    kx = x.shape[1]
    kbx = xsum.shape[1]
    nr = (ie - ib) // ROWS_Z * ROWS_Z
    for v in range(nr * 16):
        accb[v] = 0.0
    base0 = g * nrec
    base1 = (g + 1) * nrec
    for s0 in range(0, nrec, cr):
        s1 = min(nrec, s0 + cr)
        for gi in range(2):
            for s in range(s0, s1):
                ro = ((g + gi) * nrec + s) * rb
                for p in range(0, rb, 64):
                    prefetch(data, ro + cr * rb + p)
                _decode_z(kind, data, ro, panel, (s - s0) * 2 * rf + 8 * gi)
        last = s1 == nrec
        for i0 in range(ib, ib + nr, ROWS_Z):
            ao = (i0 - ib) * 16
            accs = _load_accs_z(accb, ao)
            for s in range(s0, s1):
                accs = _tile_z(kind, accs, panel, (s - s0) * 2 * rf, data, (base0 + s) * rb,
                               (base1 + s) * rb, x, i0 * kx + 32 * ns * s, kx, xsum,
                               i0 * kbx + ns * s, kbx)
            for r in range(ROWS_Z):
                if last:
                    lo, hi = _halves_z(accs[r])
                    store_group(lo, facc, g, i0 + r, n, out)
                    store_group(hi, facc, g + 1, i0 + r, n, out)
                else:
                    fstore(accb, ao + r * 16, accs[r])
    return ib + nr
