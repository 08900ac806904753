"""Register-blocked prefill kernels for the ggml group records (Q8_0, Q5_0, Q4_1, Q5_1, Q4_K,
Q5_K, Q6_K).

The one-row kernels of :mod:`.ggml_packed` (``_row_i8``) decode every record of a group once per
activation row, so prefill with M rows decodes each record M times. Here a record is decoded once
(its float16 scales, 6-bit / int8 sub-block scales and the 8 chunk vectors ``U_t`` of each
32-block, the values of :func:`~.ggml_ir.chunks`) and used for :data:`ROWS` activation rows
whose float32 accumulators stay in registers across the group's records (the technique of
register-blocked quantized GEMMs such as ik_llama.cpp's ``iqk`` kernels: decode a weight tile
once, reuse it for several activation rows).

Bitwise equality with the one-row kernel: per activation row the int32 block sums are exact on
both paths, and the float32 operations per (row, block) are those of ``_row_i8`` in the same
order (module docstring of :mod:`.ggml_packed`), so every output row has the same bits.

Integer sums, per activation row and 32-block (``X_t`` = the row's 4 int8 activations of chunk
``t`` broadcast to the 8 lanes):

* ``avx2`` -- ``vpmaddubsw`` per chunk, then the int16 pair sums of up to :data:`I16_TERMS`
  chunks added (``vpaddw``) before one ``vpmaddwd``: a pair sum is ``<= 2 * max(u) * 127``
  (activations in [-127, 127]; Q4_1 and Q4_K ``u <= 15``: 3810; Q5_0, Q5_1 and Q5_K ``u <= 31``:
  7874; Q6_K 16002; Q8_0 with the sign trick 32512), so 8 / 4 / 2 / 1 of them (8 x 3810 = 30480,
  4 x 7874 = 31496, 2 x 16002 = 32004 <= 32767) stay within int16 (the one-row kernel widens every chunk; the integers are the same). Q8_0's
  ``|q|`` (sign trick) is computed once per record, ``sign(x, q)`` per row.
* ``avx512vnni`` -- ``vpdpbusd`` chains as in the one-row kernel, one per row (``vnni`` flag at
  run time; compiled only on a VNNI host).

Emission order (AVX2, 16 ymm): chunk-outer -- chunk ``t`` is decoded (Q8_0: ``vpabsb``), then
used by every row (``vpbroadcastd`` of the row's 4 activations, Q8_0 ``vpsignb``,
``vpmaddubsw``, ``vpaddw``), so one chunk vector is live beside the :data:`ROWS` float32
accumulators and the rows' running int16 / int32 sums (an order that decodes all 8 chunks first
spilled on every record). :data:`ROWS` = 4 measured best or within noise of 3 for every kind
(1, 2, 3, 4, 6, 8 tried in one process, one thread, cache-resident weights, a shared Zen 3:
1.3-1.8x the same emitter with one row); past 3-4 rows the per-row work (broadcast, multiply,
float epilogue per 32-block) dominates and the registers run out.

Exact mode (float32 activations, :func:`rows_f32`): each code is converted to float32 once and
used by :data:`ROWS_F32` rows, each with the 4 FMA chains per half 32-block and the per-block
combination of ``ggml_packed._make_rec_f32`` in the same order (bitwise its results).

Exact mode, float panel (:func:`panel_f32`, kinds of :func:`use_fpanel`): the conversion to
float32 is the cost of :func:`rows_f32` (shift, and, subtract, convert per code vector for 2
rows). Here a group's records are decoded once per L2 row block (:func:`block_rows` rows) into a
float32 panel of :data:`PANEL_BYTES` per group (L1), and every tile of rows reads it: two groups
x :data:`ROWS_P2` rows per tile (each panel vector loaded once for the tile's rows, each
broadcast activation used by both groups), the 4 chains of a (row, group) per half 32-block
emitted as pairs ``j = 0, 1`` then ``j = 2, 3`` (12 chains live), each pair's zero start passed
through an empty inline asm that reads the previous pair's sums (:func:`_after`: without it the
compiler started every chain of the record at once and spilled about one vector per FMA;
measured 44 -> 59 GFLOP/s for 2 x 2, L1-resident). The operations per (row, group, block) and
their order are those of ``ggml_packed._make_rec_f32``, so every row is bitwise the one-row
kernel's (tests/kernels/test_ggml_gemm.py). Accumulators stay in registers over the records of
a panel and in a small buffer between panels. Measured, one thread, L1-resident panel and
activations (Q8_0, 16 records): 2 groups x 3 rows 62 GFLOP/s, 2 x 2 59, 1 x 4 55, of a ~95
GFLOP/s thread peak: the broadcasts, the panel loads and the spilled half sums stay the limit.

Exact mode on an AVX-512 VNNI host: pairs of groups in float32 x 16 vectors,
:mod:`.ggml_zpanel` (built on this module's emitters, the same operations per lane).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .config import JIT
from .ggml_ir import (
    F32,
    I32,
    LV8F32,
    LV8I32,
    LV16F32,
    LV16I16,
    LV32I8,
    OFFSET,
    PF_BYTES,
    KQ,
    MIN32,
    Emit,
    concat,
    idx,
    k4_scales,
    load_f32,
    load_i32,
    nsub,
    sub_layout,
    xbcast,
)
from .packed_i8_gemm import V16F32
from .packed_i8 import (
    HOST_VNNI,
    V8F32,
    check_array_arg,
    elem_ptr,
    fstore,
    prefetch,
    splat,
    store_group,
)

__all__ = ["BLOCK_BYTES", "I16_TERMS", "PANEL_BYTES", "ROWS", "ROWS_F32", "ROWS_P", "ROWS_P2",
           "block_rows", "chunks_f32", "chunks_i8", "panel_f32", "panel_floats", "rows_f32",
           "rows_i8", "use_fpanel"]

#: activation rows per decoded record.
ROWS = 4
#: activation rows per decoded record in exact mode (float32 activations): 4 FMA chains per row
#: and 32-block half, so 2 rows (8 chains) with the decoded codes and accumulators in 16 ymm.
ROWS_F32 = 2
#: exact mode, float panel of one group (:func:`panel_f32`, the odd group of a task): activation
#: rows per tile (the panel vector of each code is loaded once per tile; 2 of the 4 chains of
#: each row live at a time).
ROWS_P = 4
#: exact mode, float panel of 2 groups: activation rows per tile (each broadcast activation used
#: by both groups; 4 chains per (row, group) of which 2 live at a time: 12 ymm).
ROWS_P2 = 3
#: exact mode: bytes of decoded float32 codes per group's panel (two groups' panels in L1 beside
#: the tile's activations: 8 Q8_0 / Q5_0 records, 1 k-quant record).
PANEL_BYTES = 1 << 13
#: bytes of activation codes per row block of a task (half of Zen 3's 512 KiB L2): a block's
#: rows stay in L2 while the task's groups stream past them.
BLOCK_BYTES = 1 << 18
#: AVX2: ``vpmaddubsw`` results (int16 pair sums) added in int16 before ``vpmaddwd``, per kind.
I16_TERMS = {8: 1, 6: 4, 12: 8, 14: 2, 3: 8, 7: 4, 13: 4}


def _chunk(e, kind, sub, t):
    """Chunk vector ``U_t`` of 32-block ``sub`` of the record, decoded on its own (the values of
    :func:`~.ggml_ir.chunks`; emitted where it is used, so that only one chunk is live)."""
    if kind == 8:
        return e.v32(16 + 32 * t)
    nib, high, bits = sub_layout(kind, sub)
    v = e.v32(nib + 32 * (t % 4))
    u = e.and8(v if t < 4 else e.srl16(v, 4), 15)
    if not bits:
        return u
    per = 8 // bits
    hv = e.v32(high + 32 * (t // per))
    h = e.and8(e.srl16(hv, bits * (t % per)), (1 << bits) - 1)
    b = e.b
    return b.or_(u, b.bitcast(b.shl(b.bitcast(h, LV16I16), ir.Constant(LV16I16, [4] * 16)),
                              LV32I8))


def _order(groups):
    """Chunk order within each group: a nibble load's low and high halves one after the other."""
    return [sorted(grp, key=lambda t: (t % 4, t)) for grp in groups]


def _avx2_rows(builder, chunk, xrow, nrows, groups, signed, terms):
    """Per row, per group of chunks: exact int32 ``sum_t dot4(U_t, X_t)`` (``vpmaddubsw``, up to
    ``terms`` int16 results summed with ``vpaddw``, ``vpmaddwd`` with ones). Chunk-outer: each
    ``U_t`` is decoded once (``chunk(t)``) and used for the ``nrows`` rows (``xrow(r, t)``).
    ``signed`` (Q8_0): ``|q|`` and ``sign(x, q)`` (``vpabsb``, ``vpsignb``, ``q = u ^ 0x80``)."""
    def fn(name, ret, args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)
    mub = fn("llvm.x86.avx2.pmadd.ub.sw", LV16I16, [LV32I8, LV32I8])
    mwd = fn("llvm.x86.avx2.pmadd.wd", LV8I32, [LV16I16, LV16I16])
    psign = fn("llvm.x86.avx2.psign.b", LV32I8, [LV32I8, LV32I8])
    absb = fn("llvm.abs.v32i8", LV32I8, [LV32I8, ir.IntType(1)])
    ones = ir.Constant(LV16I16, [1] * 16)
    out = [[None] * len(groups) for _ in range(nrows)]
    for gi, grp in enumerate(_order(groups)):
        s16 = [None] * nrows
        for c, t in enumerate(grp):
            u = chunk(t)
            if signed:
                q = builder.xor(u, ir.Constant(LV32I8, [0x80] * 32))
                u = builder.call(absb, [q, ir.Constant(ir.IntType(1), 0)])
            for r in range(nrows):
                x = xrow(r, t)
                if signed:
                    x = builder.call(psign, [x, q])
                p = builder.call(mub, [u, x])
                s16[r] = p if s16[r] is None else builder.add(s16[r], p)
                if (c + 1) % terms == 0 or c + 1 == len(grp):
                    w = builder.call(mwd, [s16[r], ones])
                    out[r][gi] = w if out[r][gi] is None else builder.add(out[r][gi], w)
                    s16[r] = None
    return out


def _vnni_rows(builder, chunk, xrow, nrows, groups, signed, xsums):
    """As :func:`_avx2_rows` with ``vpdpbusd`` (Q8_0: chains start at ``-128 sum(xq)``)."""
    dp = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(LV8I32, [LV8I32, LV32I8, LV32I8]),
        "llvm.x86.avx512.vpdpbusd.256")
    out = [[None] * len(groups) for _ in range(nrows)]
    for gi, grp in enumerate(_order(groups)):
        acc = [splat(builder, builder.sub(ir.Constant(I32, 0), xsums[r]), LV8I32) if signed
               else ir.Constant(LV8I32, [0] * 8) for r in range(nrows)]
        for t in grp:
            u = chunk(t)
            for r in range(nrows):
                acc[r] = builder.call(dp, [acc[r], u, xrow(r, t)])
        for r in range(nrows):
            out[r][gi] = acc[r]
    return out


def _row_sums(builder, kind, chunk, xrow, nrows, vnni, groups, xsums=None):
    """``[row][group]`` int32 sums on the path chosen by ``vnni`` at run time (VNNI host)."""
    signed = kind == 8
    if not HOST_VNNI:  # the VNNI instruction cannot even be compiled here
        return _avx2_rows(builder, chunk, xrow, nrows, groups, signed, I16_TERMS[kind])
    pred = builder.icmp_unsigned("!=", vnni, ir.Constant(vnni.type, 0))
    with builder.if_else(pred) as (then, otherwise):
        with then:
            r_v = _vnni_rows(builder, chunk, xrow, nrows, groups, signed, xsums)
            b_v = builder.block
        with otherwise:
            r_a = _avx2_rows(builder, chunk, xrow, nrows, groups, signed, I16_TERMS[kind])
            b_a = builder.block
    out = []
    for row_v, row_a in zip(r_v, r_a):
        row = []
        for x1, x2 in zip(row_v, row_a):
            phi = builder.phi(LV8I32)
            phi.add_incoming(x1, b_v)
            phi.add_incoming(x2, b_a)
            row.append(phi)
        out.append(row)
    return out


def _emit_rows_i8(kind, nrows, context, builder, sig, args):
    """IR of one record for ``nrows`` activation rows (``xo + r kx``, ``bo + r kbx``): the
    record decoded once, per row the float32 operations of ``ggml_packed._make_rec_i8``."""
    accs, dat, ro, xqa, xoff, kx, xda, s8a, s16a, boff, kbx, vn = args
    at = sig.args
    a = [builder.extract_value(accs, r) for r in range(nrows)]
    e = Emit(context, builder, at[1], dat, ro)
    d = e.f16x8(0)
    dmin = e.f16x8(16) if kind in KQ or kind in MIN32 else None  # (Q4_1/Q5_1: m)
    xo_r = [builder.add(xoff, builder.mul(kx, ir.Constant(kx.type, r))) for r in range(nrows)]
    bo_r = [builder.add(boff, builder.mul(kbx, ir.Constant(kbx.type, r))) for r in range(nrows)]
    for sub in range(nsub(kind)):
        xo_s = [idx(builder, xo, 32 * sub) for xo in xo_r]

        def chunk(t, sub=sub):
            return _chunk(e, kind, sub, t)

        def xrow(r, t, xo_s=xo_s):
            return xbcast(context, builder, at[3], xqa, xo_s[r], t)
        bo_s = [idx(builder, bo, sub) for bo in bo_r]
        xd_s = [splat(builder, load_f32(context, builder, at[6], xda, b), LV8F32) for b in bo_s]
        if kind == 14:
            sums = _row_sums(builder, kind, chunk, xrow, nrows, vn, ((0, 1, 2, 3), (4, 5, 6, 7)))
            sc0 = e.bytes8(16 + 8 * (2 * sub), signed=True)
            sc1 = e.bytes8(16 + 8 * (2 * sub + 1), signed=True)
            c32 = ir.Constant(I32, 32)
            for r in range(nrows):
                s0, s1 = sums[r]
                i16 = builder.mul(bo_s[r], ir.Constant(bo_s[r].type, 2))
                t0 = load_i32(context, builder, at[8], s16a, i16)
                t1 = load_i32(context, builder, at[8], s16a, idx(builder, i16, 1))
                s0 = builder.sub(s0, splat(builder, builder.mul(t0, c32), LV8I32))
                s1 = builder.sub(s1, splat(builder, builder.mul(t1, c32), LV8I32))
                tot = builder.add(builder.mul(sc0, s0), builder.mul(sc1, s1))
                f = builder.sitofp(tot, LV8F32)
                a[r] = builder.fadd(a[r], builder.fmul(f, builder.fmul(d, xd_s[r])))
            continue
        x8 = [load_i32(context, builder, at[7], s8a, b) for b in bo_s]  # 8 * sum(xq)
        xsums = [builder.shl(v, ir.Constant(I32, 4)) for v in x8] if kind == 8 else None
        sums = _row_sums(builder, kind, chunk, xrow, nrows, vn, (tuple(range(8)),), xsums)
        if kind in KQ:
            sc, mn = k4_scales(e, sub)
            big_d = builder.fmul(d, builder.sitofp(sc, LV8F32))
            big_m = builder.fmul(dmin, builder.sitofp(mn, LV8F32))
        for r in range(nrows):
            (s,) = sums[r]
            if kind == 6:
                s = builder.sub(s, splat(builder, builder.shl(x8[r], ir.Constant(I32, 1)),
                                         LV8I32))
            if kind in (6, 8):
                a[r] = builder.fadd(a[r], builder.fmul(builder.sitofp(s, LV8F32),
                                                       builder.fmul(d, xd_s[r])))
                continue
            sx = builder.sitofp(builder.ashr(x8[r], ir.Constant(I32, 3)), F32)
            if kind in MIN32:  # Q4_1, Q5_1: dmin is m
                f = builder.fadd(builder.fmul(builder.sitofp(s, LV8F32),
                                              builder.fmul(d, xd_s[r])),
                                 builder.fmul(dmin, builder.fmul(
                                     xd_s[r], splat(builder, sx, LV8F32))))
                a[r] = builder.fadd(a[r], f)
                continue
            f = builder.fsub(builder.fmul(big_d, builder.sitofp(s, LV8F32)),
                             builder.fmul(big_m, splat(builder, sx, LV8F32)))
            a[r] = builder.fadd(a[r], builder.fmul(f, xd_s[r]))
    return context.make_tuple(builder, sig.return_type, a)


def _make_rows_i8(kind, nrows):
    tup = types.UniTuple(V8F32, nrows)

    @intrinsic
    def rec(typingctx, accs, data, roff, xq, xo, kx, xd, xs8, xs16, bo, kbx, vnni):
        if not (accs == tup and check_array_arg(data, types.uint8)
                and check_array_arg(xq, types.int8) and check_array_arg(xd, types.float32)
                and check_array_arg(xs8, types.int32) and check_array_arg(xs16, types.int32)):
            return None
        sig = tup(tup, data, types.intp, xq, types.intp, types.intp, xd, xs8, xs16, types.intp,
                  types.intp, types.boolean)
        return sig, (lambda context, builder, sig, args:
                     _emit_rows_i8(kind, nrows, context, builder, sig, args))
    return rec


def _combine_f32(kind, es, builder, fma, d, dmin, sub, halves, a, sx):
    """Per row ``r``: the block combination of ``ggml_packed._make_rec_f32`` for 32-block ``sub``
    of the record: ``halves[r]`` = the row's two half sums, ``sx(r)`` its per-32 float32 sum of
    ``x`` (kinds with mins); returns the updated accumulators ``a``. ``es``: the record of each
    group whose 8 lanes the vectors hold (1 group: float32 x 8; 2 groups: x 16, lanes 0-7 the
    first; ``d`` / ``dmin`` already so), each lane's operations the same either way."""
    def per_group(fn):
        return concat(builder, [fn(e) for e in es])
    if kind == 14:
        sc0 = per_group(lambda e: builder.sitofp(e.bytes8(16 + 8 * (2 * sub), signed=True),
                                                 LV8F32))
        sc1 = per_group(lambda e: builder.sitofp(e.bytes8(16 + 8 * (2 * sub + 1), signed=True),
                                                 LV8F32))
        for r in range(len(a)):
            a[r] = builder.call(fma, [halves[r][0], builder.fmul(d, sc0), a[r]])
            a[r] = builder.call(fma, [halves[r][1], builder.fmul(d, sc1), a[r]])
        return a
    if kind in KQ:
        scs = [k4_scales(e, sub) for e in es]
        sc = concat(builder, [builder.sitofp(v[0], LV8F32) for v in scs])
        mn = concat(builder, [builder.sitofp(v[1], LV8F32) for v in scs])
        big_d = builder.fmul(d, sc)
        big_m = builder.fmul(dmin, mn)
    for r in range(len(a)):
        s = builder.fadd(halves[r][0], halves[r][1])
        if kind in (6, 8):
            a[r] = builder.call(fma, [s, d, a[r]])
            continue
        if kind in MIN32:  # Q4_1, Q5_1: dmin is m
            a[r] = builder.fadd(a[r], builder.fadd(builder.fmul(d, s),
                                                   builder.fmul(dmin, sx(r))))
            continue
        a[r] = builder.fadd(a[r], builder.fsub(builder.fmul(big_d, s),
                                               builder.fmul(big_m, sx(r))))
    return a


def _fma_fn(builder, vt=LV8F32):
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vt, [vt] * 3), f"llvm.fma.v{vt.count}f32")


def _codes_f32(builder, kind, u):
    """The 4 float32 code vectors ``u - offset`` (j = byte within the lane, k = 4t + j) of one
    chunk vector ``u``, decoded exactly (``(u >> 8j) & 255 - offset``, ``vcvtdq2ps``)."""
    v = builder.bitcast(u, LV8I32)
    m255 = ir.Constant(LV8I32, [255] * 8)
    out = []
    for j in range(4):
        w = builder.and_(builder.lshr(v, ir.Constant(LV8I32, [8 * j] * 8)),
                         m255) if j else builder.and_(v, m255)
        if OFFSET[kind]:
            w = builder.sub(w, ir.Constant(LV8I32, [OFFSET[kind]] * 8))
        out.append(builder.sitofp(w, LV8F32))
    return out


def _emit_rows_f32(kind, nrows, context, builder, sig, args):
    """IR of one record in exact mode for ``nrows`` activation rows (``xo + r kx``, ``bo + r
    kbx``): each code decoded to float32 once (``(u >> 8j) & 255 - offset``), per row the FMA
    chains and the float32 operations of ``ggml_packed._make_rec_f32`` in the same order."""
    accs, dat, ro, xa, xoff, kx, xsa, boff, kbx = args
    at = sig.args
    a = [builder.extract_value(accs, r) for r in range(nrows)]
    e = Emit(context, builder, at[1], dat, ro)
    d = e.f16x8(0)
    dmin = e.f16x8(16) if kind in KQ or kind in MIN32 else None  # (Q4_1/Q5_1: m)
    fma = _fma_fn(builder)
    zero = ir.Constant(LV8F32, [0.0] * 8)
    xo_r = [builder.add(xoff, builder.mul(kx, ir.Constant(kx.type, r))) for r in range(nrows)]
    bo_r = [builder.add(boff, builder.mul(kbx, ir.Constant(kbx.type, r))) for r in range(nrows)]
    for sub in range(nsub(kind)):
        xo_s = [idx(builder, xo, 32 * sub) for xo in xo_r]
        halves = [[] for _ in range(nrows)]
        for grp in ((0, 1, 2, 3), (4, 5, 6, 7)):
            ch = [[zero] * 4 for _ in range(nrows)]  # per row 4 chains (j = byte in the lane)
            for t in grp:
                for j, wf in enumerate(_codes_f32(builder, kind, _chunk(e, kind, sub, t))):
                    for r in range(nrows):
                        xv = load_f32(context, builder, at[3], xa, idx(builder, xo_s[r], 4 * t + j))
                        ch[r][j] = builder.call(fma, [wf, splat(builder, xv, LV8F32), ch[r][j]])
            for r in range(nrows):
                halves[r].append(builder.fadd(builder.fadd(ch[r][0], ch[r][1]),
                                              builder.fadd(ch[r][2], ch[r][3])))

        def sx(r, sub=sub):
            return splat(builder, load_f32(context, builder, at[6], xsa,
                                           idx(builder, bo_r[r], sub)), LV8F32)
        a = _combine_f32(kind, [e], builder, fma, d, dmin, sub, halves, a, sx)
    return context.make_tuple(builder, sig.return_type, a)


def _make_rows_f32(kind, nrows):
    tup = types.UniTuple(V8F32, nrows)

    @intrinsic
    def rec(typingctx, accs, data, roff, x, xo, kx, xsum, bo, kbx):
        if not (accs == tup and check_array_arg(data, types.uint8)
                and check_array_arg(x, types.float32) and check_array_arg(xsum, types.float32)):
            return None
        sig = tup(tup, data, types.intp, x, types.intp, types.intp, xsum, types.intp, types.intp)
        return sig, (lambda context, builder, sig, args:
                     _emit_rows_f32(kind, nrows, context, builder, sig, args))
    return rec


def _emit_decode(kind, context, builder, sig, args, stride=8):
    """IR: every code of one record decoded to float32 (:func:`_codes_f32`) and stored to
    ``panel[po + stride q : po + stride q + 8]``, ``q = 32 sub + 4 t + j`` (= k within the
    record; ``stride`` 16: two groups' records interleaved, the second at ``po + 8``)."""
    dat, ro, pan, po = args
    at = sig.args
    e = Emit(context, builder, at[0], dat, ro)
    for sub in range(nsub(kind)):
        for t in range(8):
            for j, wf in enumerate(_codes_f32(builder, kind, _chunk(e, kind, sub, t))):
                q = 32 * sub + 4 * t + j
                builder.store(wf, elem_ptr(context, builder, at[2], pan,
                                           idx(builder, po, stride * q), LV8F32), align=4)


def _make_decode(kind, stride=8):
    @intrinsic
    def dec(typingctx, data, roff, panel, po):
        if not (check_array_arg(data, types.uint8) and check_array_arg(panel, types.float32)):
            return None
        sig = types.none(data, types.intp, panel, types.intp)

        def codegen(context, builder, sig, args):
            _emit_decode(kind, context, builder, sig, args, stride)
            return context.get_dummy_value()
        return sig, codegen
    return dec


def _emit_tile_f32(kind, nrows, ngrp, context, builder, sig, args):
    """IR of one record of each of ``ngrp`` groups (1 or 2; panels at ``po_g``, records at
    ``ro_g``) in exact mode for ``nrows`` activation rows, the codes read from the float panel
    (:func:`_emit_decode`), the scales from the records: per (row, group) the operations of
    :func:`_emit_rows_f32` (bitwise ``ggml_packed._make_rec_f32``); accumulator ``g nrows + r``.
    Emission order: per half 32-block the chains ``j = 0, 1`` of all (row, group), then
    ``j = 2, 3``: each panel vector is loaded once for the ``nrows`` rows, each broadcast
    activation used by the ``ngrp`` groups."""
    accs, pan, po0, po1, dat, ro0, ro1, xa, xoff, kx, xsa, boff, kbx = args
    at = sig.args
    pos = (po0, po1)[:ngrp]
    a = [[builder.extract_value(accs, gi * nrows + r) for r in range(nrows)]
         for gi in range(ngrp)]
    es = [Emit(context, builder, at[4], dat, ro) for ro in (ro0, ro1)[:ngrp]]
    ds = [e.f16x8(0) for e in es]
    dmins = [e.f16x8(16) if kind in KQ or kind in MIN32 else None for e in es]
    fma = _fma_fn(builder)
    zero = ir.Constant(LV8F32, [0.0] * 8)
    xo_r = [builder.add(xoff, builder.mul(kx, ir.Constant(kx.type, r))) for r in range(nrows)]
    bo_r = [builder.add(boff, builder.mul(kbx, ir.Constant(kbx.type, r))) for r in range(nrows)]
    prev = []
    for sub in range(nsub(kind)):
        xo_s = [idx(builder, xo, 32 * sub) for xo in xo_r]
        halves = [[[] for _ in range(nrows)] for _ in range(ngrp)]
        for grp in ((0, 1, 2, 3), (4, 5, 6, 7)):
            pair = []
            for jp in ((0, 1), (2, 3)):
                z = _after(builder, zero, prev) if BARRIER else zero
                ch = [[[z] * 2 for _ in range(nrows)] for _ in range(ngrp)]
                for t in grp:
                    for c, j in enumerate(jp):
                        q = 32 * sub + 4 * t + j
                        ws = [builder.load(elem_ptr(context, builder, at[1], pan,
                                                    idx(builder, po, 8 * q), LV8F32), align=4)
                              for po in pos]
                        for r in range(nrows):
                            xv = splat(builder, load_f32(context, builder, at[7], xa,
                                                         idx(builder, xo_s[r], 4 * t + j)),
                                       LV8F32)
                            for gi in range(ngrp):
                                ch[gi][r][c] = builder.call(fma, [ws[gi], xv, ch[gi][r][c]])
                pair.append([[builder.fadd(ch[gi][r][0], ch[gi][r][1]) for r in range(nrows)]
                             for gi in range(ngrp)])
                prev = [v for row in pair[-1] for v in row]
            for gi in range(ngrp):
                for r in range(nrows):
                    halves[gi][r].append(builder.fadd(pair[0][gi][r], pair[1][gi][r]))

        def sx(r, sub=sub):
            return splat(builder, load_f32(context, builder, at[10], xsa,
                                           idx(builder, bo_r[r], sub)), LV8F32)
        for gi in range(ngrp):
            a[gi] = _combine_f32(kind, [es[gi]], builder, fma, ds[gi], dmins[gi], sub, halves[gi],
                                 a[gi], sx)
    return context.make_tuple(builder, sig.return_type, [v for row in a for v in row])


#: order the chain pairs of a tile with :func:`_after` (False: let the compiler schedule them).
BARRIER = True


def _after(builder, zero, deps):
    """``zero`` (a float32 x 8 or x 16 register) returned through an empty inline asm that reads
    ``deps``: the chains started from it cannot be scheduled before ``deps`` are computed (the
    compiler otherwise starts every chain of a tile at once and spills them); the value is
    unchanged, so the arithmetic is too."""
    if not deps:
        return zero
    ft = ir.FunctionType(zero.type, [zero.type] * (1 + len(deps)))
    reg = "v" if zero.type.count == 16 else "x"  # zmm: any of the 32 AVX-512 registers
    cons = f"={reg},0" + f",{reg}" * len(deps)
    return builder.asm(ft, "", cons, [zero] + list(deps), True)


def _make_tile_f32(kind, nrows, ngrp):
    tup = types.UniTuple(V8F32, nrows * ngrp)

    @intrinsic
    def tile(typingctx, accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo, kbx):
        if not (accs == tup and check_array_arg(panel, types.float32)
                and check_array_arg(data, types.uint8)
                and check_array_arg(x, types.float32) and check_array_arg(xsum, types.float32)):
            return None
        sig = tup(tup, panel, types.intp, types.intp, data, types.intp, types.intp, x,
                  types.intp, types.intp, xsum, types.intp, types.intp)
        return sig, (lambda context, builder, sig, args:
                     _emit_tile_f32(kind, nrows, ngrp, context, builder, sig, args))
    return tile


def _make_load_accs(nrows, w=8):
    tup = types.UniTuple(V16F32 if w == 16 else V8F32, nrows)
    lv = LV16F32 if w == 16 else LV8F32

    @intrinsic
    def load_accs(typingctx, arr, off):
        """``nrows`` float32 x ``w`` vectors from ``arr[off + w r : off + w r + w]``."""
        if not check_array_arg(arr, types.float32):
            return None

        def codegen(context, builder, sig, args):
            vs = [builder.load(elem_ptr(context, builder, sig.args[0], args[0],
                                        idx(builder, args[1], w * r), lv), align=4)
                  for r in range(nrows)]
            return context.make_tuple(builder, tup, vs)
        return tup(arr, types.intp), codegen
    return load_accs


def _make_zeros(nrows):
    @intrinsic
    def zeros(typingctx):
        """``nrows`` float32 x 8 zero accumulators."""
        tup = types.UniTuple(V8F32, nrows)

        def codegen(context, builder, sig, args):
            z = ir.Constant(LV8F32, [0.0] * 8)
            return context.make_tuple(builder, tup, [z] * nrows)
        return tup(), codegen
    return zeros


_zeros = _make_zeros(ROWS)
_zeros_f32 = _make_zeros(ROWS_F32)


_rows_q8_0 = _make_rows_i8(8, ROWS)
_rows_q5_0 = _make_rows_i8(6, ROWS)
_rows_q4_k = _make_rows_i8(12, ROWS)
_rows_q6_k = _make_rows_i8(14, ROWS)
_rows_q4_1 = _make_rows_i8(3, ROWS)
_rows_q5_1 = _make_rows_i8(7, ROWS)
_rows_q5_k = _make_rows_i8(13, ROWS)
_rows_f32_q8_0 = _make_rows_f32(8, ROWS_F32)
_rows_f32_q5_0 = _make_rows_f32(6, ROWS_F32)
_rows_f32_q4_k = _make_rows_f32(12, ROWS_F32)
_rows_f32_q6_k = _make_rows_f32(14, ROWS_F32)
_rows_f32_q4_1 = _make_rows_f32(3, ROWS_F32)
_rows_f32_q5_1 = _make_rows_f32(7, ROWS_F32)
_rows_f32_q5_k = _make_rows_f32(13, ROWS_F32)
_load_accs_p = _make_load_accs(ROWS_P)
_load_accs_p2 = _make_load_accs(2 * ROWS_P2)
_dec_q8_0 = _make_decode(8)
_dec_q5_0 = _make_decode(6)
_dec_q4_k = _make_decode(12)
_dec_q6_k = _make_decode(14)
_dec_q4_1 = _make_decode(3)
_dec_q5_1 = _make_decode(7)
_dec_q5_k = _make_decode(13)
_tile_q8_0 = _make_tile_f32(8, ROWS_P, 1)
_tile2_q8_0 = _make_tile_f32(8, ROWS_P2, 2)
_tile_q5_0 = _make_tile_f32(6, ROWS_P, 1)
_tile2_q5_0 = _make_tile_f32(6, ROWS_P2, 2)
_tile_q4_k = _make_tile_f32(12, ROWS_P, 1)
_tile2_q4_k = _make_tile_f32(12, ROWS_P2, 2)
_tile_q6_k = _make_tile_f32(14, ROWS_P, 1)
_tile2_q6_k = _make_tile_f32(14, ROWS_P2, 2)
_tile_q4_1 = _make_tile_f32(3, ROWS_P, 1)
_tile2_q4_1 = _make_tile_f32(3, ROWS_P2, 2)
_tile_q5_1 = _make_tile_f32(7, ROWS_P, 1)
_tile2_q5_1 = _make_tile_f32(7, ROWS_P2, 2)
_tile_q5_k = _make_tile_f32(13, ROWS_P, 1)
_tile2_q5_k = _make_tile_f32(13, ROWS_P2, 2)


@njit(**JIT)
def block_rows(row_bytes):
    """Activation rows per block: ``BLOCK_BYTES // row_bytes`` rounded down to a multiple of
    :data:`ROWS` (at least ROWS)."""
    return max(ROWS, BLOCK_BYTES // row_bytes // ROWS * ROWS)


@njit(inline="always", **JIT)
def rows_i8(kind, data, g, xq, xd, xs8, xs16, i0, vnni):
    """Group ``g`` (8 output rows) of activation rows ``i0 .. i0 + ROWS - 1``: a tuple of
    :data:`ROWS` float32 x 8 accumulators, each bitwise equal to ``ggml_packed._row_i8`` of its
    row. Every record of the group is read and decoded once."""
    nrec = data.shape[1]
    rb = data.shape[2]
    kx = xq.shape[1]
    kbx = xd.shape[1]
    xo = i0 * kx
    bo = i0 * kbx
    acc = _zeros()
    base = g * nrec
    if kind == 8:
        for s in range(nrec):
            ro = (base + s) * rb
            for p in range(0, 320, 64):
                prefetch(data, ro + PF_BYTES + p)
            acc = _rows_q8_0(acc, data, ro, xq, xo + 32 * s, kx, xd, xs8, xs16, bo + s, kbx,
                             vnni)
    elif kind == 6:
        for s in range(nrec):
            ro = (base + s) * rb
            for p in range(0, 192, 64):
                prefetch(data, ro + PF_BYTES + p)
            acc = _rows_q5_0(acc, data, ro, xq, xo + 32 * s, kx, xd, xs8, xs16, bo + s, kbx,
                             vnni)
    elif kind == 3:
        for s in range(nrec):
            ro = (base + s) * rb
            for p in range(0, 192, 64):
                prefetch(data, ro + PF_BYTES + p)
            acc = _rows_q4_1(acc, data, ro, xq, xo + 32 * s, kx, xd, xs8, xs16, bo + s, kbx,
                             vnni)
    elif kind == 7:
        for s in range(nrec):
            ro = (base + s) * rb
            for p in range(0, 192, 64):
                prefetch(data, ro + PF_BYTES + p)
            acc = _rows_q5_1(acc, data, ro, xq, xo + 32 * s, kx, xd, xs8, xs16, bo + s, kbx,
                             vnni)
    elif kind == 12:
        for s in range(nrec):
            ro = (base + s) * rb
            acc = _rows_q4_k(acc, data, ro, xq, xo + 256 * s, kx, xd, xs8, xs16, bo + 8 * s,
                             kbx, vnni)
    elif kind == 13:
        for s in range(nrec):
            ro = (base + s) * rb
            acc = _rows_q5_k(acc, data, ro, xq, xo + 256 * s, kx, xd, xs8, xs16, bo + 8 * s,
                             kbx, vnni)
    else:
        for s in range(nrec):
            ro = (base + s) * rb
            acc = _rows_q6_k(acc, data, ro, xq, xo + 256 * s, kx, xd, xs8, xs16, bo + 8 * s,
                             kbx, vnni)
    return acc


@njit(inline="always", **JIT)
def rows_f32(kind, data, g, x, xsum, i0):
    """Exact mode: group ``g`` of activation rows ``i0 .. i0 + ROWS_F32 - 1`` (float32 ``x``
    [M, K], ``xsum`` float32 [M, K / 32] per-32 sums of ``x``, read by the kinds with mins:
    Q4_1, Q5_1, Q4_K, Q5_K): a tuple of
    :data:`ROWS_F32` float32 x 8 accumulators, each bitwise equal to ``ggml_packed._row_f32`` of
    its row."""
    nrec = data.shape[1]
    rb = data.shape[2]
    kx = x.shape[1]
    kbx = xsum.shape[1]
    xo = i0 * kx
    bo = i0 * kbx
    acc = _zeros_f32()
    base = g * nrec
    for s in range(nrec):
        ro = (base + s) * rb
        for p in range(0, rb, 64):
            prefetch(data, ro + PF_BYTES + p)
        if kind == 8:
            acc = _rows_f32_q8_0(acc, data, ro, x, xo + 32 * s, kx, xsum, bo + s, kbx)
        elif kind == 6:
            acc = _rows_f32_q5_0(acc, data, ro, x, xo + 32 * s, kx, xsum, bo + s, kbx)
        elif kind == 3:
            acc = _rows_f32_q4_1(acc, data, ro, x, xo + 32 * s, kx, xsum, bo + s, kbx)
        elif kind == 7:
            acc = _rows_f32_q5_1(acc, data, ro, x, xo + 32 * s, kx, xsum, bo + s, kbx)
        elif kind == 12:
            acc = _rows_f32_q4_k(acc, data, ro, x, xo + 256 * s, kx, xsum, bo + 8 * s, kbx)
        elif kind == 13:
            acc = _rows_f32_q5_k(acc, data, ro, x, xo + 256 * s, kx, xsum, bo + 8 * s, kbx)
        else:
            acc = _rows_f32_q6_k(acc, data, ro, x, xo + 256 * s, kx, xsum, bo + 8 * s, kbx)
    return acc


@njit(inline="always", **JIT)
def _store_rows(accs, nrows, g, i0, n, out, facc):
    """Row ``i0 + r`` of group ``g`` from ``accs[r]``, ``r < nrows``: a full group by one vector
    store, the partial last group through ``facc``."""
    r0 = g * 8
    if r0 + 8 <= n:
        for r in range(nrows):
            fstore(out, (i0 + r) * n + r0, accs[r])
    else:
        for r in range(nrows):
            store_group(accs[r], facc, g, i0 + r, n, out)


@njit(**JIT)
def chunks_i8(kind, data, g, xq, xd, xs8, xs16, ib, ie, n, out, facc, vnni):
    """Group ``g`` of activation rows ``ib ..`` in chunks of :data:`ROWS` (:func:`rows_i8`,
    inlined) while a whole chunk is left before ``ie``; returns the first row not done. One call
    per (group, row block), not per chunk: a call per chunk, with its stores through
    ``store_group`` and the array reference counts of each call, cost ~20 % of a K = 896 GEMM
    (Q8_0 4864 x 896, M = 128, one thread: 37.8 -> 48.7 GMAC/s, bench/bench_gemm_calls.py)."""
    i0 = ib
    while ie - i0 >= ROWS:
        accs = rows_i8(kind, data, g, xq, xd, xs8, xs16, i0, vnni)
        _store_rows(accs, ROWS, g, i0, n, out, facc)
        i0 += ROWS
    return i0


@njit(**JIT)
def chunks_f32(kind, data, g, x, xsum, ib, ie, n, out, facc):
    """Exact mode: :func:`chunks_i8` with :func:`rows_f32` in chunks of :data:`ROWS_F32`."""
    i0 = ib
    while ie - i0 >= ROWS_F32:
        accs = rows_f32(kind, data, g, x, xsum, i0)
        _store_rows(accs, ROWS_F32, g, i0, n, out, facc)
        i0 += ROWS_F32
    return i0


@njit(**JIT)
def _decode(kind, data, ro, panel, po):
    if kind == 8:
        _dec_q8_0(data, ro, panel, po)
    elif kind == 6:
        _dec_q5_0(data, ro, panel, po)
    elif kind == 3:
        _dec_q4_1(data, ro, panel, po)
    elif kind == 7:
        _dec_q5_1(data, ro, panel, po)
    elif kind == 12:
        _dec_q4_k(data, ro, panel, po)
    elif kind == 13:
        _dec_q5_k(data, ro, panel, po)
    else:
        _dec_q6_k(data, ro, panel, po)


@njit(**JIT)
def _tile(kind, accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo, kbx):
    if kind == 8:
        return _tile_q8_0(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                     kbx)
    elif kind == 6:
        return _tile_q5_0(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                     kbx)
    elif kind == 3:
        return _tile_q4_1(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                     kbx)
    elif kind == 7:
        return _tile_q5_1(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                     kbx)
    elif kind == 12:
        return _tile_q4_k(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                     kbx)
    elif kind == 13:
        return _tile_q5_k(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                     kbx)
    return _tile_q6_k(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)


@njit(**JIT)
def _tile2(kind, accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo, kbx):
    if kind == 8:
        return _tile2_q8_0(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                      kbx)
    elif kind == 6:
        return _tile2_q5_0(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                      kbx)
    elif kind == 3:
        return _tile2_q4_1(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                      kbx)
    elif kind == 7:
        return _tile2_q5_1(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                      kbx)
    elif kind == 12:
        return _tile2_q4_k(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                      kbx)
    elif kind == 13:
        return _tile2_q5_k(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo,
                      kbx)
    return _tile2_q6_k(accs, panel, po0, po1, data, ro0, ro1, x, xo, kx, xsum, bo, kbx)


@njit(**JIT)
def use_fpanel(kind, vnni):
    """Exact mode: whether the float panel (:func:`panel_f32`, on the ``vnni`` path of an
    AVX-512 VNNI host first :func:`~.ggml_zpanel.panel_f32z`) runs the kind's prefill rather
    than :func:`rows_f32` (all bitwise the one-row kernel). Measured, one thread, % of the
    thread's FMA peak (``python bench/bench_ggml_exact.py --rounds 3``, Qwen2.5-0.5B gate/up and
    down at M = 128 / 512): on the AVX2 Zen 3, rows_f32 -> panel_f32 Q5_0 27-29 -> 29-38, Q6_K
    21-24 -> 26-32, Q8_0 34-38 -> 36-43 (down equal), Q4_K 28-34 -> 29-31 (down slower), so Q4_K,
    Q4_1, Q5_1 and Q5_K keep :func:`rows_f32` there; on the AVX-512 Zen 4 every kind takes the
    panel, rows_f32 -> panel_f32z at M = 128 (gate/up, down): Q8_0 50-52 -> 64-69, Q4_K 49-53 ->
    64 (the shipped build, empty cache), and in a first build that called the tile per record
    instead of inlining it, Q5_0 41-42 -> 50-54, Q4_1 48-51 -> 50-53, Q5_1 43-45 -> 49-53, Q5_K
    45-46 -> 62-64, Q6_K 41-43 -> 61-66."""
    return vnni or kind == 14 or kind == 6 or kind == 8


@njit(**JIT)
def panel_floats(kind):
    """float32 elements of the panel buffer of :func:`panel_f32` for ``kind`` (the decoded codes
    of whole records, at most :data:`PANEL_BYTES`, at least one record)."""
    rf = 256 if kind == 3 or kind == 6 or kind == 7 or kind == 8 else 2048
    return max(1, PANEL_BYTES // 4 // rf) * rf


@njit(**JIT)
def panel_f32(kind, data, g, ng, x, xsum, ib, ie, n, out, facc, panel, accb):
    """Exact mode, groups ``g .. g + ng - 1`` (``ng`` = 1 or 2), activation rows ``ib .. ib +
    T ROWS_P - 1`` (``T = (ie - ib) // ROWS_P``; returns the first row not done): each group's
    records decoded to float32 (:func:`panel_floats` elements of ``panel`` per group, ``panel``
    float32 [>= 2 panel_floats]) a panel at a time, each panel used by every tile of rows
    (:data:`ROWS_P` rows of one group, or :data:`ROWS_P2` rows of two groups; accumulators in
    registers, kept in ``accb`` float32 [>= 16 T ROWS_P] between panels); every output row
    bitwise ``ggml_packed._row_f32``'s."""
    nrec = data.shape[1]
    rb = data.shape[2]
    ns = 1 if kind == 3 or kind == 6 or kind == 7 or kind == 8 else 8
    rf = 256 * ns
    pf = panel_floats(kind)
    cr = pf // rf
    kx = x.shape[1]
    kbx = xsum.shape[1]
    rt = ROWS_P2 if ng == 2 else ROWS_P
    nr = (ie - ib) // rt * rt
    for v in range(nr * 8 * ng):
        accb[v] = 0.0
    base0 = g * nrec
    base1 = (g + ng - 1) * nrec
    for s0 in range(0, nrec, cr):
        s1 = min(nrec, s0 + cr)
        for gi in range(ng):
            for s in range(s0, s1):
                ro = ((g + gi) * nrec + s) * rb
                for p in range(0, rb, 64):
                    prefetch(data, ro + cr * rb + p)
                _decode(kind, data, ro, panel, gi * pf + (s - s0) * rf)
        last = s1 == nrec
        if ng == 2:
            for i0 in range(ib, ib + nr, ROWS_P2):
                ao = (i0 - ib) * 16
                accs2 = _load_accs_p2(accb, ao)
                for s in range(s0, s1):
                    accs2 = _tile2(kind, accs2, panel, (s - s0) * rf, pf + (s - s0) * rf, data,
                                   (base0 + s) * rb, (base1 + s) * rb, x, i0 * kx + 32 * ns * s,
                                   kx, xsum, i0 * kbx + ns * s, kbx)
                for gi in range(2):
                    for r in range(ROWS_P2):
                        if last:
                            store_group(accs2[gi * ROWS_P2 + r], facc, g + gi, i0 + r, n, out)
                        else:
                            fstore(accb, ao + (gi * ROWS_P2 + r) * 8, accs2[gi * ROWS_P2 + r])
        else:
            for i0 in range(ib, ib + nr, ROWS_P):
                ao = (i0 - ib) * 8
                accs = _load_accs_p(accb, ao)
                for s in range(s0, s1):
                    accs = _tile(kind, accs, panel, (s - s0) * rf, 0, data, (base0 + s) * rb, 0,
                                 x, i0 * kx + 32 * ns * s, kx, xsum, i0 * kbx + ns * s, kbx)
                for r in range(ROWS_P):
                    if last:
                        store_group(accs[r], facc, g, i0 + r, n, out)
                    else:
                        fstore(accb, ao + r * 8, accs[r])
    return ib + nr

