"""LLVM-IR intrinsics of the paged attention kernel (:mod:`.paged_attention`).

Raw pointers from block-table addresses (:func:`_f32p` ...), float16 <-> float32 conversion,
a software prefetch, and the vector kernels written as IR: the integer scores of 16 INT8/INT4 key
rows against an int8 query (:func:`_qk16_i8`, AVX2 ``vpmaddwd`` or AVX-512 VNNI ``vpdpbusd``),
the VNNI block scores of all query heads of a group (:func:`_qkblk_i8`), and ``p @ V`` over
float32 (:func:`_make_pv`) or INT8/INT4 value rows decoded in registers (:func:`_make_pvq`).

The 512-bit VNNI instructions are emitted only where the host has them (:data:`HOST_VNNI`, read
at codegen): on another CPU LLVM cannot even compile them, so those paths are left out (the
scores) or become a trap that the callers never reach (the block scores).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .packed_i8 import HOST_VNNI


# -- raw block addresses -------------------------------------------------------------------------
def _ptr_intrinsic(nbty):
    @intrinsic
    def ptr(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None
        sig = types.CPointer(nbty)(addr)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return sig, codegen
    return ptr


_f32p = _ptr_intrinsic(types.float32)
_u8p = _ptr_intrinsic(types.uint8)
_u16p = _ptr_intrinsic(types.uint16)


@intrinsic
def _half_to_f32(typingctx, bits):
    """float16 bits (uint16) -> float32 (``fpext``: ``vcvtph2ps`` once vectorised)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if sig.args[0].bitwidth != 16:
            v = builder.trunc(v, ir.IntType(16))
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _f32_to_half(typingctx, x):
    """float32 -> float16 bits (uint16), round to nearest even (``fptrunc``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(h, ir.IntType(16))
    return types.uint16(x), codegen


_i8p = _ptr_intrinsic(types.int8)


#: ``llvm.prefetch`` locality of :func:`_prefetch` (3: ``prefetcht0``, into L1).
_PF_LOCALITY = 3


@intrinsic
def _prefetch(typingctx, addr):
    """Software prefetch of the cache line at address ``addr`` (``prefetcht0``; never faults)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
        ptr = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), i8p)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, _PF_LOCALITY),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(addr), codegen


# -- integer scores of INT8 / INT4 key blocks against an int8 query (int8-activation mode) ------
_I8T, _I16T, _I32T = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V64I8 = ir.VectorType(_I8T, 64)
_V32I8 = ir.VectorType(_I8T, 32)
_V16I8 = ir.VectorType(_I8T, 16)
_V16I16 = ir.VectorType(_I16T, 16)
_V8I32 = ir.VectorType(_I32T, 8)
_V16I32 = ir.VectorType(_I32T, 16)


def _vsplat(builder, val, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), val, ir.Constant(_I32T, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32T, vty.count), [0] * vty.count))


def _concat32(builder, a, b):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32T, 64), list(range(64))))


def _key_rows16(builder, kbase, row0_v, nrows_v, last, rb):
    """Addresses (16 ``i8*``) of the key rows ``row0 + j``, ``j < 16``, ``rb`` bytes apart from
    ``kbase``; rows ``j >= nrows`` repeat the last one (``last = nrows - 1``): never out of
    bounds."""
    i64 = ir.IntType(64)
    rowptrs = []
    for j in range(16):
        jj = ir.Constant(i64, j)
        r = builder.select(builder.icmp_signed("<", jj, nrows_v), jj, last)
        rowptrs.append(builder.gep(kbase, [builder.mul(builder.add(row0_v, r), rb)]))
    return rowptrs


def _key_bytes(builder, rowptr, c, fmt4, unsigned):
    """The 64 bytes (``<64 x i8>``) of features ``64 c .. 64 c + 63`` of the key row at
    ``rowptr`` in the query's order: INT8 the stored codes, INT4 (32 bytes) the 32 low nibbles
    then the 32 high ones, sign-extended; ``unsigned``: ``k + 128`` (INT8) / ``k + 8`` (INT4)."""
    i64 = ir.IntType(64)
    if not fmt4:
        off = builder.mul(c, ir.Constant(i64, 64))
        kv = builder.load(builder.bitcast(builder.gep(rowptr, [off]), _V64I8.as_pointer()),
                          align=1)
        return builder.xor(kv, ir.Constant(_V64I8, [-128] * 64)) if unsigned else kv
    off = builder.mul(c, ir.Constant(i64, 32))
    b = builder.load(builder.bitcast(builder.gep(rowptr, [off]), _V32I8.as_pointer()), align=1)
    four = ir.Constant(_V32I8, [4] * 32)
    if unsigned:
        eight = ir.Constant(_V32I8, [8] * 32)
        lo = builder.xor(builder.and_(b, ir.Constant(_V32I8, [15] * 32)), eight)
        hi = builder.xor(builder.lshr(b, four), eight)
    else:
        lo = builder.ashr(builder.shl(b, four), four)
        hi = builder.ashr(b, four)
    return _concat32(builder, lo, hi)


def _sum_tree16(builder, vecs):
    """Horizontal sums of 16 ``<16 x i32>`` vectors in one: lane ``j`` of the result is the sum
    of the lanes of ``vecs[j]`` (a tree of two-source shuffles and adds, 15 adds in all)."""
    w = 16
    while len(vecs) > 1:
        half = w // 2
        m = 16 // w
        lo_idx = [g * w + i for g in range(m) for i in range(half)]
        hi_idx = [g * w + half + i for g in range(m) for i in range(half)]
        lo_m = ir.Constant(ir.VectorType(_I32T, 16), lo_idx + [16 + x for x in lo_idx])
        hi_m = ir.Constant(ir.VectorType(_I32T, 16), hi_idx + [16 + x for x in hi_idx])
        vecs = [builder.add(builder.shuffle_vector(a, b, lo_m),
                            builder.shuffle_vector(a, b, hi_m))
                for a, b in zip(vecs[0::2], vecs[1::2])]
        w = half
    return vecs[0]


def _qk16_vnni(builder, rowptrs, qbase, nch, qs, optr, fmt4):
    """The 16 exact sums into ``optr`` (``<16 x i32>*``) by ``vpdpbusd``: per key one 16-lane
    accumulator over the ``nch`` chunks of 64 features (unsigned keys ``k + 128`` / ``k + 8``
    against the signed query at ``qbase``), summed across lanes, minus ``128 * qs`` /
    ``8 * qs``. AVX-512 VNNI only (emitted where :data:`HOST_VNNI`)."""
    i64 = ir.IntType(64)
    dp = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16I32, [_V16I32, _V64I8, _V64I8]),
        "llvm.x86.avx512.vpdpbusd.512")
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16I32, [0] * 16))
            for _ in range(16)]
    with cgutils.for_range(builder, nch) as loop:
        c = loop.index
        qv = builder.load(builder.bitcast(builder.gep(qbase, [builder.mul(
            c, ir.Constant(i64, 64))]), _V64I8.as_pointer()), align=1)
        for j in range(16):
            u = _key_bytes(builder, rowptrs[j], c, fmt4, True)
            builder.store(builder.call(dp, [builder.load(accs[j]), u, qv]), accs[j])
    tot = _sum_tree16(builder, [builder.load(a) for a in accs])
    corr = builder.mul(qs, ir.Constant(_I32T, 8 if fmt4 else 128))
    builder.store(builder.sub(tot, _vsplat(builder, corr, _V16I32)), optr)


def _qk16_avx2(builder, rowptrs, qbase, nch, optr, fmt4):
    """The 16 exact sums into ``optr`` (``<16 x i32>*``) by ``vpmaddwd``: keys and query
    sign-extended to int16, per key one 8-lane accumulator over the ``nch`` chunks of 64
    features, then its 8 lanes added in order."""
    i64 = ir.IntType(64)
    mwd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8I32, [_V16I16, _V16I16]),
        "llvm.x86.avx2.pmadd.wd")
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8I32, [0] * 8))
            for _ in range(16)]
    with cgutils.for_range(builder, nch) as loop:
        c = loop.index
        qv = builder.load(builder.bitcast(builder.gep(qbase, [builder.mul(
            c, ir.Constant(i64, 64))]), _V64I8.as_pointer()), align=1)
        q16 = [builder.sext(builder.shuffle_vector(
            qv, ir.Constant(_V64I8, ir.Undefined),
            ir.Constant(ir.VectorType(_I32T, 16), list(range(16 * p, 16 * p + 16)))),
            _V16I16) for p in range(4)]
        for j in range(16):
            kv = _key_bytes(builder, rowptrs[j], c, fmt4, False)
            a = builder.load(accs[j])
            for p in range(4):
                k16 = builder.sext(builder.shuffle_vector(
                    kv, ir.Constant(_V64I8, ir.Undefined),
                    ir.Constant(ir.VectorType(_I32T, 16),
                                list(range(16 * p, 16 * p + 16)))), _V16I16)
                a = builder.add(a, builder.call(mwd, [k16, q16[p]]))
            builder.store(a, accs[j])
    res = ir.Constant(_V16I32, [0] * 16)
    for j in range(16):
        a = builder.load(accs[j])
        t = builder.extract_element(a, ir.Constant(_I32T, 0))
        for e in range(1, 8):
            t = builder.add(t, builder.extract_element(a, ir.Constant(_I32T, e)))
        res = builder.insert_element(res, t, ir.Constant(_I32T, j))
    builder.store(res, optr)


def _hmax16(builder, cur):
    """The max of the 16 lanes of ``cur`` (``<16 x float>``; halving shuffles, ``>`` selects):
    a float."""
    v16f = ir.VectorType(ir.FloatType(), 16)
    w = 16
    while w > 1:
        half = w // 2
        hi = builder.shuffle_vector(cur, ir.Constant(v16f, ir.Undefined), ir.Constant(
            ir.VectorType(_I32T, 16), [half + i if i < half else 0 for i in range(16)]))
        cur = builder.select(builder.fcmp_ordered(">", hi, cur), hi, cur)
        w = half
    return builder.extract_element(cur, ir.Constant(_I32T, 0))


def _qk16_epilogue(builder, optr, ra, oa, row0_v, off_v, nrows_v, qm):
    """``out[off + j] = float32(S_j) * (qmul * rmul[row0 + j])`` in 16 lanes (the same two
    multiplies per key as the scalar form) from the sums at ``optr``, stored; returns the max
    over the first ``nrows`` lanes (``ra``, ``oa``: the ``rmul`` and ``out`` array structs)."""
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    v16f = ir.VectorType(f32, 16)
    sf = builder.sitofp(builder.load(optr), v16f)
    rp = builder.gep(builder.bitcast(ra.data, f32.as_pointer()), [row0_v])
    rm = builder.load(builder.bitcast(rp, v16f.as_pointer()), align=4)
    val = builder.fmul(sf, builder.fmul(_vsplat(builder, qm, v16f), rm))
    op = builder.gep(builder.bitcast(oa.data, f32.as_pointer()), [off_v])
    builder.store(val, builder.bitcast(op, v16f.as_pointer()), align=4)
    lanes = ir.Constant(ir.VectorType(i64, 16), list(range(16)))
    live = builder.icmp_signed("<", lanes, _vsplat(builder, nrows_v, ir.VectorType(i64, 16)))
    cur = builder.select(live, val, ir.Constant(v16f, [float("-inf")] * 16))
    return _hmax16(builder, cur)


def _make_qk16_int(fmt4):
    """The score intrinsic of INT8 (``fmt4`` False: ``_qk16_i8``) or INT4 key rows
    (``_qk16_i4``)."""

    @intrinsic
    def qk16(typingctx, q, kaddr, row0, nrows, rowbytes, qsum, qmul, rmul, out, off, vnni):
        """Scores of 16 keys against an int8 query: ``out[off + j] = float32(S_j) *
        (qmul * rmul[row0 + j])`` for ``j < 16``, ``S_j = sum_i k[row0 + j, i] * q[i]`` (exact
        int32) over the rows of an INT8 (``D`` signed bytes per row) or INT4 block side (``D/2``
        bytes per row, two's complement nibbles, low nibble first) whose first row is at
        address ``kaddr``, rows ``rowbytes`` apart; ``q`` int8 [D] (for INT4 in the nibble order
        of :func:`_quantize_heads`: per 64 features the even ones, then the odd ones),
        ``D % 64 == 0``, ``qsum = sum(q)``. Rows ``>= nrows`` repeat the last row (never read out
        of bounds); all 16 results are written (``out`` needs 16 slots from ``off``, ``rmul`` 16
        from ``row0``); returns the max of the first ``nrows`` scores. ``vnni`` (where the host
        has AVX-512 VNNI): one ``vpdpbusd`` per key and 64 features on the unsigned form
        ``k + 128`` (INT8) / ``k + 8`` (INT4), minus ``128 * qsum`` / ``8 * qsum``; else
        ``vpmaddwd`` on the sign-extended values. Both give the exact sums (bitwise equal)."""
        if not (isinstance(q, types.Array) and q.dtype == types.int8
                and isinstance(out, types.Array) and out.dtype == types.float32 and isinstance(rmul, types.Array)
                and rmul.dtype == types.float32 and qmul == types.float32):
            return None
        sig = types.float32(q, kaddr, row0, nrows, rowbytes, qsum, qmul, rmul, out, off, vnni)

        def codegen(context, builder, sig, args):
            qa = context.make_array(sig.args[0])(context, builder, args[0])
            ra = context.make_array(sig.args[7])(context, builder, args[7])
            oa = context.make_array(sig.args[8])(context, builder, args[8])
            i64 = ir.IntType(64)
            d = builder.extract_value(qa.shape, 0)
            nch = builder.udiv(d, ir.Constant(i64, 64))
            kaddr_v = context.cast(builder, args[1], sig.args[1], types.int64)
            row0_v = context.cast(builder, args[2], sig.args[2], types.int64)
            nrows_v = context.cast(builder, args[3], sig.args[3], types.int64)
            rb = context.cast(builder, args[4], sig.args[4], types.int64)
            qs = context.cast(builder, args[5], sig.args[5], types.int32)
            qm = args[6]
            off_v = context.cast(builder, args[9], sig.args[9], types.int64)
            isvnni = context.cast(builder, args[10], sig.args[10], types.boolean)
            last = builder.sub(nrows_v, ir.Constant(i64, 1))
            qbase = builder.bitcast(qa.data, _I8T.as_pointer())
            kbase = builder.inttoptr(kaddr_v, _I8T.as_pointer())
            rowptrs = _key_rows16(builder, kbase, row0_v, nrows_v, last, rb)
            optr = cgutils.alloca_once(builder, _V16I32)  # the exact sums (either path)
            if HOST_VNNI:
                with builder.if_else(isvnni) as (then, otherwise):
                    with then:
                        _qk16_vnni(builder, rowptrs, qbase, nch, qs, optr, fmt4)
                    with otherwise:
                        _qk16_avx2(builder, rowptrs, qbase, nch, optr, fmt4)
            else:  # the VNNI instruction cannot even be compiled here
                _qk16_avx2(builder, rowptrs, qbase, nch, optr, fmt4)
            return _qk16_epilogue(builder, optr, ra, oa, row0_v, off_v, nrows_v, qm)
        return sig, codegen
    return qk16


_qk16_i8 = _make_qk16_int(False)
_qk16_i4 = _make_qk16_int(True)


# -- all query heads of a group against one block of INT8 / INT4 keys (VNNI) --------------------
#: Largest head size of :func:`_qkblk_i8` (its transposed block lives in a 4 KiB stack buffer).
QKBLK_MAX_D = 256


def _transpose16(builder, rows):
    """16 x 16 int32 transpose of 16 ``<16 x i32>`` rows: returns ``cols`` with
    ``cols[c][j] = rows[j][c]`` (unpack 32 / unpack 64 within 128-bit lanes, then two rounds of
    128-bit lane shuffles: 64 two-source shuffles)."""
    def shuf(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32T, 16), idx))

    def lanes(pick):  # pick: 4 (source 0/1, 128-bit lane) pairs -> dword mask
        return [src * 16 + 4 * ln + e for src, ln in pick for e in range(4)]

    lo32 = [x for ln in range(4) for x in (4 * ln, 16 + 4 * ln, 4 * ln + 1, 16 + 4 * ln + 1)]
    hi32 = [x for ln in range(4) for x in (4 * ln + 2, 16 + 4 * ln + 2, 4 * ln + 3, 16 + 4 * ln + 3)]
    lo64 = [x for ln in range(4) for x in (4 * ln, 4 * ln + 1, 16 + 4 * ln, 16 + 4 * ln + 1)]
    hi64 = [x for ln in range(4) for x in (4 * ln + 2, 4 * ln + 3, 16 + 4 * ln + 2, 16 + 4 * ln + 3)]
    # t[r][k]: rows 4r..4r+3, lane L = dwords 4L+k of those rows
    t = []
    for r in range(4):
        a = [shuf(rows[4 * r], rows[4 * r + 1], m) for m in (lo32, hi32)]
        b = [shuf(rows[4 * r + 2], rows[4 * r + 3], m) for m in (lo32, hi32)]
        t.append([shuf(a[0], b[0], lo64), shuf(a[0], b[0], hi64),
                  shuf(a[1], b[1], lo64), shuf(a[1], b[1], hi64)])
    cols = [None] * 16
    for k in range(4):
        u = [t[r][k] for r in range(4)]
        a01 = shuf(u[0], u[1], lanes([(0, 0), (0, 1), (1, 0), (1, 1)]))
        b01 = shuf(u[0], u[1], lanes([(0, 2), (0, 3), (1, 2), (1, 3)]))
        a23 = shuf(u[2], u[3], lanes([(0, 0), (0, 1), (1, 0), (1, 1)]))
        b23 = shuf(u[2], u[3], lanes([(0, 2), (0, 3), (1, 2), (1, 3)]))
        cols[k] = shuf(a01, a23, lanes([(0, 0), (0, 2), (1, 0), (1, 2)]))
        cols[4 + k] = shuf(a01, a23, lanes([(0, 1), (0, 3), (1, 1), (1, 3)]))
        cols[8 + k] = shuf(b01, b23, lanes([(0, 0), (0, 2), (1, 0), (1, 2)]))
        cols[12 + k] = shuf(b01, b23, lanes([(0, 1), (0, 3), (1, 1), (1, 3)]))
    return cols


def _row_ptr(builder, arr, row, i8=False):
    """Address of ``arr[row, 0]`` of a 2-D array struct (any row stride; unit inner stride)."""
    base = builder.ptrtoint(arr.data, ir.IntType(64))
    st = builder.extract_value(arr.strides, 0)
    return builder.add(base, builder.mul(row, st))


def _qkblk_keys(builder, rowptrs, nch, fmt4, tbuf):
    """Stage 1 of :func:`_make_qkblk`: the 16 key rows at ``rowptrs`` as unsigned bytes
    (``k + 128`` / ``k + 8``), transposed into ``tbuf`` (``<16 x i32>`` [16 nch]):
    ``tbuf[16 c + e]`` lane ``j`` = dword ``e`` of chunk ``c`` (64 features) of key ``j``."""
    i64 = ir.IntType(64)
    with cgutils.for_range(builder, nch) as loop:
        c = loop.index
        rows = [builder.bitcast(_key_bytes(builder, rowptrs[j], c, fmt4, True), _V16I32)
                for j in range(16)]
        cols = _transpose16(builder, rows)
        base = builder.mul(c, ir.Constant(i64, 16))
        for e in range(16):
            builder.store(cols[e], builder.gep(tbuf, [builder.add(base, ir.Constant(i64, e))]))


def _qkblk_heads(builder, arrs, ng_v, row0_v, nrows_v, off_v, nch, tbuf, fmt4):
    """Stage 2 of :func:`_make_qkblk`, per query head ``h < ng``: 16 ``vpdpbusd`` per 64
    features (4 accumulators) against the transposed keys in ``tbuf``, minus the unsigned
    offset times ``qsum[h]``, the float epilogue of :func:`_qk16_epilogue` into
    ``sc[h, off:off + 16]`` and the running max ``mx[h]``. ``arrs``: the array structs of
    ``q, qsum, qmul, rmul, sc, mx``."""
    qa, qsa, qma, ra, sca, mxa = arrs
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    v16f = ir.VectorType(f32, 16)
    dp = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16I32, [_V16I32, _V64I8, _V64I8]),
        "llvm.x86.avx512.vpdpbusd.512")
    rp = builder.gep(builder.bitcast(ra.data, f32.as_pointer()), [row0_v])
    rm = builder.load(builder.bitcast(rp, v16f.as_pointer()), align=4)
    lanes = ir.Constant(ir.VectorType(i64, 16), list(range(16)))
    live = builder.icmp_signed("<", lanes, _vsplat(builder, nrows_v, ir.VectorType(i64, 16)))
    qsp = builder.bitcast(qsa.data, _I32T.as_pointer())
    qmp = builder.bitcast(qma.data, f32.as_pointer())
    mxp = builder.bitcast(mxa.data, f32.as_pointer())
    accs = [cgutils.alloca_once(builder, _V16I32) for _ in range(4)]
    with cgutils.for_range(builder, ng_v) as hl:
        h = hl.index
        qrow = builder.inttoptr(_row_ptr(builder, qa, h), _I8T.as_pointer())
        for a in accs:
            builder.store(ir.Constant(_V16I32, [0] * 16), a)
        with cgutils.for_range(builder, nch) as loop:
            c = loop.index
            qc = builder.gep(qrow, [builder.mul(c, ir.Constant(i64, 64))])
            base = builder.mul(c, ir.Constant(i64, 16))
            for e in range(16):
                qd = builder.load(builder.bitcast(builder.gep(qc, [ir.Constant(i64, 4 * e)]),
                                                  _I32T.as_pointer()), align=1)
                qv = builder.bitcast(_vsplat(builder, qd, _V16I32), _V64I8)
                kv = builder.bitcast(builder.load(builder.gep(
                    tbuf, [builder.add(base, ir.Constant(i64, e))])), _V64I8)
                a = accs[e % 4]
                builder.store(builder.call(dp, [builder.load(a), kv, qv]), a)
        tot = builder.add(builder.add(builder.load(accs[0]), builder.load(accs[1])),
                          builder.add(builder.load(accs[2]), builder.load(accs[3])))
        qs = builder.load(builder.gep(qsp, [h]))
        corr = builder.mul(qs, ir.Constant(_I32T, 8 if fmt4 else 128))
        tot = builder.sub(tot, _vsplat(builder, corr, _V16I32))
        sf = builder.sitofp(tot, v16f)
        qm = builder.load(builder.gep(qmp, [h]))
        val = builder.fmul(sf, builder.fmul(_vsplat(builder, qm, v16f), rm))
        srow = builder.inttoptr(_row_ptr(builder, sca, h), f32.as_pointer())
        builder.store(val, builder.bitcast(builder.gep(srow, [off_v]), v16f.as_pointer()),
                      align=4)
        cur = builder.select(live, val, ir.Constant(v16f, [float("-inf")] * 16))
        bm = _hmax16(builder, cur)
        mp = builder.gep(mxp, [h])
        mo = builder.load(mp)
        builder.store(builder.select(builder.fcmp_ordered(">", bm, mo), bm, mo), mp)


def _make_qkblk(fmt4):
    """The block score intrinsic of INT8 (``fmt4`` False: ``_qkblk_i8``) or INT4 key rows
    (``_qkblk_i4``), AVX-512 VNNI only."""

    @intrinsic
    def qkblk(typingctx, q, ng, kaddr, row0, nrows, rowbytes, qsum, qmul, rmul, sc, off, mx):
        """Scores of 16 keys against ``ng`` int8 query heads at once: ``sc[h, off + j] =
        float32(S_hj) * (qmul[h] * rmul[row0 + j])`` for ``h < ng``, ``j < 16``, ``S_hj`` the
        exact int32 dot product of ``q[h]`` (int8 [ng, D], for INT4 in the nibble order of
        :func:`_quantize_heads`) with key row ``row0 + j`` of an INT8 / INT4 block side at
        ``kaddr`` (rows ``rowbytes`` apart; rows ``>= nrows`` repeat the last one, never read out
        of bounds); ``mx[h]`` becomes the max of itself and the first ``nrows`` scores. The 16
        key rows are loaded once (as unsigned bytes ``k + 128`` / ``k + 8``), transposed in
        registers (lane ``j`` = key ``j``, one vector per 4 features) and each head takes one
        ``vpdpbusd`` per 4 features with its 4 query bytes broadcast: no horizontal sums; minus
        ``128 * qsum[h]`` / ``8 * qsum[h]``. ``D % 64 == 0``, ``D <= QKBLK_MAX_D``. The sums
        and the float epilogue are those of :func:`_qk16_i8` (bitwise equal results)."""
        if not (isinstance(q, types.Array) and q.dtype == types.int8 and q.ndim == 2
                and isinstance(sc, types.Array) and sc.dtype == types.float32 and sc.ndim == 2
                and all(isinstance(a, types.Array) and a.ndim == 1 for a in (qsum, qmul, rmul, mx))
                and qsum.dtype == types.int32 and qmul.dtype == types.float32
                and rmul.dtype == types.float32 and mx.dtype == types.float32):
            return None
        sig = types.void(q, ng, kaddr, row0, nrows, rowbytes, qsum, qmul, rmul, sc, off, mx)

        def codegen(context, builder, sig, args):
            if not HOST_VNNI:
                # callers take this path only where use_vnni() (never on this CPU): the
                # 512-bit VNNI instruction cannot even be compiled here, so the body is a trap
                trap = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    ir.VoidType(), []), "llvm.trap")
                builder.call(trap, [])
                return context.get_dummy_value()
            i64 = ir.IntType(64)
            # q, qsum, qmul, rmul, sc, mx
            arrs = [context.make_array(sig.args[k])(context, builder, args[k])
                    for k in (0, 6, 7, 8, 9, 11)]
            ng_v = context.cast(builder, args[1], sig.args[1], types.int64)
            kaddr_v = context.cast(builder, args[2], sig.args[2], types.int64)
            row0_v = context.cast(builder, args[3], sig.args[3], types.int64)
            nrows_v = context.cast(builder, args[4], sig.args[4], types.int64)
            rb = context.cast(builder, args[5], sig.args[5], types.int64)
            off_v = context.cast(builder, args[10], sig.args[10], types.int64)
            d = builder.extract_value(arrs[0].shape, 1)
            nch = builder.udiv(d, ir.Constant(i64, 64))
            last = builder.sub(nrows_v, ir.Constant(i64, 1))
            kbase = builder.inttoptr(kaddr_v, _I8T.as_pointer())
            rowptrs = _key_rows16(builder, kbase, row0_v, nrows_v, last, rb)
            tbuf = cgutils.alloca_once(builder, _V16I32, size=QKBLK_MAX_D // 4)
            _qkblk_keys(builder, rowptrs, nch, fmt4, tbuf)
            _qkblk_heads(builder, arrs, ng_v, row0_v, nrows_v, off_v, nch, tbuf, fmt4)
            return context.get_dummy_value()
        return sig, codegen
    return qkblk


_qkblk_i8 = _make_qkblk(False)
_qkblk_i4 = _make_qkblk(True)


# -- p @ V over INT8 / INT4 value rows, decoded in registers -------------------------------------
def _make_pvq(nh, fmt4):
    """Intrinsic ``o[orow + h] += sum_{j < nrows} p[prow + h, pcol + j] * (rmul[j] * code_j)``
    for ``h < nh`` query heads over the value rows of an INT8 (``fmt4`` False: ``D`` signed bytes
    per row) or INT4 block side (``D/2`` bytes, two's complement nibbles, low nibble first) at
    ``vaddr``, rows ``rowbytes`` apart, ``D % 16 == 0``: per key and 16 features the codes are
    sign-extended, converted to float32 and multiplied by the row's scale ``rmul[j]`` (the
    decoded value, as :func:`_load_row`) in registers, then one fused multiply-add per head;
    the accumulators of the ``nh`` heads stay in registers over the keys (no decoded copy of
    the block)."""

    @intrinsic
    def pvq(typingctx, p, prow, pcol, vaddr, rowbytes, rmul, nrows, o, orow):
        if not (all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2
                    for a in (p, o)) and isinstance(rmul, types.Array)
                and rmul.dtype == types.float32):
            return None
        sig = types.void(p, prow, pcol, vaddr, rowbytes, rmul, nrows, o, orow)

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            f32 = ir.FloatType()
            v16 = ir.VectorType(f32, 16)
            pa = context.make_array(sig.args[0])(context, builder, args[0])
            ra = context.make_array(sig.args[5])(context, builder, args[5])
            oa = context.make_array(sig.args[7])(context, builder, args[7])
            d = builder.extract_value(oa.shape, 1)
            prow_v = context.cast(builder, args[1], sig.args[1], types.int64)
            pcol_v = context.cast(builder, args[2], sig.args[2], types.int64)
            va = context.cast(builder, args[3], sig.args[3], types.int64)
            rb = context.cast(builder, args[4], sig.args[4], types.int64)
            nr = context.cast(builder, args[6], sig.args[6], types.int64)
            orow_v = context.cast(builder, args[8], sig.args[8], types.int64)
            rbase = builder.bitcast(ra.data, f32.as_pointer())
            vbase = builder.inttoptr(va, _I8T.as_pointer())
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                v16, [v16, v16, v16]), "llvm.fma.v16f32")
            prows = [builder.gep(builder.inttoptr(_row_ptr(builder, pa, builder.add(
                prow_v, ir.Constant(i64, h))), f32.as_pointer()), [pcol_v]) for h in range(nh)]
            orows = [builder.inttoptr(_row_ptr(builder, oa, builder.add(
                orow_v, ir.Constant(i64, h))), f32.as_pointer()) for h in range(nh)]
            nch = builder.udiv(d, ir.Constant(i64, 16))
            v8i8 = ir.VectorType(_I8T, 8)
            with cgutils.for_range(builder, nch) as cl:
                c16 = builder.mul(cl.index, ir.Constant(i64, 16))
                optrs = [builder.bitcast(builder.gep(orows[h], [c16]), v16.as_pointer())
                         for h in range(nh)]
                accs = [cgutils.alloca_once_value(builder, builder.load(op, align=4))
                        for op in optrs]
                with cgutils.for_range(builder, nr) as kl:
                    j = kl.index
                    row = builder.gep(vbase, [builder.mul(j, rb)])
                    if not fmt4:
                        cv = builder.load(builder.bitcast(builder.gep(row, [c16]),
                                                          _V16I8.as_pointer()), align=1)
                    else:
                        b = builder.load(builder.bitcast(builder.gep(row, [builder.udiv(
                            c16, ir.Constant(i64, 2))]), v8i8.as_pointer()), align=1)
                        four = ir.Constant(v8i8, [4] * 8)
                        lo = builder.ashr(builder.shl(b, four), four)
                        hi = builder.ashr(b, four)
                        cv = builder.shuffle_vector(lo, hi, ir.Constant(
                            ir.VectorType(_I32T, 16), [x for i in range(8) for x in (i, 8 + i)]))
                    vf = builder.sitofp(builder.sext(cv, _V16I32), v16)
                    vv = builder.fmul(vf, _vsplat(builder, builder.load(builder.gep(rbase, [j])), v16))
                    for h in range(nh):
                        pj = builder.load(builder.gep(prows[h], [j]))
                        builder.store(builder.call(fma, [_vsplat(builder, pj, v16), vv,
                                                         builder.load(accs[h])]), accs[h])
                for h in range(nh):
                    builder.store(builder.load(accs[h]), optrs[h], align=4)
            return context.get_dummy_value()
        return sig, codegen
    return pvq


_pv8_1, _pv8_2, _pv8_3, _pv8_4, _pv8_5, _pv8_6, _pv8_7, _pv8_8 = (_make_pvq(n, False)
                                                                 for n in range(1, 9))
_pv4_1, _pv4_2, _pv4_3, _pv4_4, _pv4_5, _pv4_6, _pv4_7, _pv4_8 = (_make_pvq(n, True)
                                                                 for n in range(1, 9))


def _make_pv(nh):
    """Intrinsic ``_pv{nh}(p, prow, pcol, v, nrows, o, orow)``: ``o[orow + h] += sum_{j < nrows}
    p[prow + h, pcol + j] * v[j]`` for ``h < nh`` query heads (float32, ``D % 16 == 0``), the
    accumulators of ``nh`` heads x 16 features held in registers over the keys (one load of
    each value vector serves the ``nh`` heads), keys in order, one fused multiply-add per key."""

    @intrinsic
    def pv(typingctx, p, prow, pcol, v, nrows, o, orow):
        if not all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2
                   for a in (p, v, o)):
            return None
        sig = types.void(p, prow, pcol, v, nrows, o, orow)

        def codegen(context, builder, sig, args):
            i64 = ir.IntType(64)
            f32 = ir.FloatType()
            v16 = ir.VectorType(f32, 16)
            pa = context.make_array(sig.args[0])(context, builder, args[0])
            va = context.make_array(sig.args[3])(context, builder, args[3])
            oa = context.make_array(sig.args[5])(context, builder, args[5])
            ps = builder.extract_value(pa.shape, 1)
            d = builder.extract_value(oa.shape, 1)
            vs = builder.extract_value(va.shape, 1)
            prow_v = context.cast(builder, args[1], sig.args[1], types.int64)
            pcol_v = context.cast(builder, args[2], sig.args[2], types.int64)
            nr = context.cast(builder, args[4], sig.args[4], types.int64)
            orow_v = context.cast(builder, args[6], sig.args[6], types.int64)
            pbase = builder.bitcast(pa.data, f32.as_pointer())
            vbase = builder.bitcast(va.data, f32.as_pointer())
            obase = builder.bitcast(oa.data, f32.as_pointer())
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                v16, [v16, v16, v16]), "llvm.fma.v16f32")
            prows = [builder.gep(pbase, [builder.add(builder.mul(builder.add(
                prow_v, ir.Constant(i64, h)), ps), pcol_v)]) for h in range(nh)]
            nch = builder.udiv(d, ir.Constant(i64, 16))
            with cgutils.for_range(builder, nch) as cl:
                c16 = builder.mul(cl.index, ir.Constant(i64, 16))
                optrs = [builder.bitcast(builder.gep(obase, [builder.add(builder.mul(
                    builder.add(orow_v, ir.Constant(i64, h)), d), c16)]), v16.as_pointer())
                    for h in range(nh)]
                accs = [cgutils.alloca_once_value(builder, builder.load(op, align=4))
                        for op in optrs]
                with cgutils.for_range(builder, nr) as kl:
                    j = kl.index
                    vp = builder.gep(vbase, [builder.add(builder.mul(j, vs), c16)])
                    vv = builder.load(builder.bitcast(vp, v16.as_pointer()), align=4)
                    for h in range(nh):
                        pj = builder.load(builder.gep(prows[h], [j]))
                        builder.store(builder.call(fma, [_vsplat(builder, pj, v16), vv,
                                                         builder.load(accs[h])]), accs[h])
                for h in range(nh):
                    builder.store(builder.load(accs[h]), optrs[h], align=4)
            return context.get_dummy_value()
        return sig, codegen
    return pv


_pv1, _pv2, _pv3, _pv4 = (_make_pv(n) for n in (1, 2, 3, 4))


# -- AVX2: the query heads of a group in the lanes, one pass over each key row --------------------
#: Query heads scored per key row by :func:`_qkg_i8` / :func:`_qkg_f16` (one 8-lane vector).
QKG_LANES = 8

_V8F = ir.VectorType(ir.FloatType(), 8)


def _sum_tree(builder, vecs, n, add):
    """Horizontal sums of ``n`` vectors of ``n`` lanes in one (``n`` a power of two): lane
    ``j`` of the result is the sum of the lanes of ``vecs[j]`` (a tree of two-source shuffles
    and ``add``s, ``n - 1`` adds per level pair)."""
    w = n
    while len(vecs) > 1:
        half = w // 2
        m = n // w
        lo_idx = [g * w + i for g in range(m) for i in range(half)]
        hi_idx = [g * w + half + i for g in range(m) for i in range(half)]
        lo_m = ir.Constant(ir.VectorType(_I32T, n), lo_idx + [n + x for x in lo_idx])
        hi_m = ir.Constant(ir.VectorType(_I32T, n), hi_idx + [n + x for x in hi_idx])
        vecs = [add(builder.shuffle_vector(a, b, lo_m), builder.shuffle_vector(a, b, hi_m))
                for a, b in zip(vecs[0::2], vecs[1::2])]
        w = half
    return vecs[0]


def _transpose8(builder, rows):
    """8 x 8 transpose of 8 ``<8 x float>`` rows (unpack, 64-bit shuffles, 128-bit lane
    shuffles: 24 two-source shuffles): ``cols[c][j] = rows[j][c]``."""
    def shuf(a, b, idx):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32T, 8), idx))

    t = []
    for r in range(0, 8, 2):
        t.append(shuf(rows[r], rows[r + 1], [0, 8, 1, 9, 4, 12, 5, 13]))
        t.append(shuf(rows[r], rows[r + 1], [2, 10, 3, 11, 6, 14, 7, 15]))
    lo, hi = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    u = [shuf(t[0], t[2], lo), shuf(t[0], t[2], hi), shuf(t[1], t[3], lo), shuf(t[1], t[3], hi),
         shuf(t[4], t[6], lo), shuf(t[4], t[6], hi), shuf(t[5], t[7], lo), shuf(t[5], t[7], hi)]
    cols = [None] * 8
    for k in range(4):
        cols[k] = shuf(u[k], u[4 + k], [0, 1, 2, 3, 8, 9, 10, 11])
        cols[4 + k] = shuf(u[k], u[4 + k], [4, 5, 6, 7, 12, 13, 14, 15])
    return cols


def _qkg_store(builder, vals, live, h0, nh, sca, off_v, mxv):
    """Epilogue of 8 keys of :func:`_make_qkg`: ``vals[j]`` (lanes = heads ``h0 ..``) of keys
    ``j`` with ``live[j]`` (``i1``) into the running max vector ``mxv`` (``>`` selects, as
    :func:`_hmax16`), then transposed and stored as ``sc[h0 + h, off : off + 8]`` for
    ``h < nh``; returns the new max vector."""
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    for j in range(8):
        gt = builder.fcmp_ordered(">", vals[j], mxv)
        nm = builder.select(gt, vals[j], mxv)
        mxv = builder.select(live[j], nm, mxv)
    cols = _transpose8(builder, vals)
    for h in range(QKG_LANES):
        with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, h), nh)):
            srow = builder.inttoptr(_row_ptr(builder, sca, builder.add(h0, ir.Constant(i64, h))),
                                    f32.as_pointer())
            builder.store(cols[h], builder.bitcast(builder.gep(srow, [off_v]),
                                                   _V8F.as_pointer()), align=4)
    return mxv


def _qkg_key_i8(builder, row, nch, qbuf, nd16, qmv, rm):
    """Scores of one INT8 key row (at ``row``) against the 8 heads of a pass: per head one
    ``vpmaddwd`` accumulator over the ``nch`` chunks of 64 features (the key sign-extended once,
    the heads' int16 queries from ``qbuf``), summed across lanes in one tree, then
    ``float32(S) * (qmul * rmul)`` (``qmv`` the heads' ``qmul``, ``rm`` the row's scale)."""
    i64 = ir.IntType(64)
    mwd = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8I32, [_V16I16, _V16I16]), "llvm.x86.avx2.pmadd.wd")
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8I32, [0] * 8)) for _ in range(8)]
    with cgutils.for_range(builder, nch) as cl:
        c = cl.index
        ks = [builder.sext(builder.load(builder.bitcast(builder.gep(row, [builder.add(
            builder.mul(c, ir.Constant(i64, 64)), ir.Constant(i64, 16 * p))]),
            _V16I8.as_pointer()), align=1), _V16I16) for p in range(4)]
        for h in range(QKG_LANES):
            a = builder.load(accs[h])
            for p in range(4):
                qv = builder.load(builder.gep(qbuf, [builder.add(
                    builder.mul(ir.Constant(i64, h), nd16),
                    builder.add(builder.mul(c, ir.Constant(i64, 4)), ir.Constant(i64, p)))]))
                a = builder.add(a, builder.call(mwd, [ks[p], qv]))
            builder.store(a, accs[h])
    tot = _sum_tree(builder, [builder.load(a) for a in accs], 8, builder.add)
    return builder.fmul(builder.sitofp(tot, _V8F), builder.fmul(qmv, _vsplat(builder, rm, _V8F)))


def _qkg_key_f16(builder, row, nch, qrows, mult):
    """Scores of one float16 key row (at ``row``) against the float32 query rows ``qrows`` of
    the 8 heads of a pass: the row converted in registers (``fpext``), one fused multiply-add
    per 8 features and head, summed across lanes in one tree, times ``mult``."""
    i64 = ir.IntType(64)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(8)]
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        _V8F, [_V8F, _V8F, _V8F]), "llvm.fma.v8f32")
    hrow = builder.bitcast(row, ir.IntType(16).as_pointer())
    v8h = ir.VectorType(ir.HalfType(), 8)
    with cgutils.for_range(builder, nch) as cl:
        c64 = builder.mul(cl.index, ir.Constant(i64, 64))
        kf = [builder.fpext(builder.load(builder.bitcast(builder.gep(hrow, [builder.add(
            c64, ir.Constant(i64, 8 * s))]), v8h.as_pointer()), align=2), _V8F)
            for s in range(8)]
        for h in range(QKG_LANES):
            a = builder.load(accs[h])
            for s in range(8):
                qv = builder.load(builder.bitcast(builder.gep(qrows[h], [builder.add(
                    c64, ir.Constant(i64, 8 * s))]), _V8F.as_pointer()), align=4)
                a = builder.call(fma, [kf[s], qv, a])
            builder.store(a, accs[h])
    tot = _sum_tree(builder, [builder.load(a) for a in accs], 8, builder.fadd)
    return builder.fmul(tot, _vsplat(builder, mult, _V8F))


def _qkg_heads(builder, kind, qa, h0, nh, mxp, qmp, qbuf, nd16):
    """Set-up of one pass over 8 heads ``h0 ..`` of :func:`_make_qkg` (``nh`` heads left):
    their row pointers (the spare lanes repeat the last head), the running max and ``qmul``
    vectors, and for ``i8`` the heads' query codes sign-extended into ``qbuf``."""
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    hmax = builder.sub(nh, ir.Constant(i64, 1))
    hidx = [builder.add(h0, builder.select(builder.icmp_signed("<", ir.Constant(i64, h), nh),
                                           ir.Constant(i64, h), hmax))
            for h in range(QKG_LANES)]
    mxv = ir.Constant(_V8F, ir.Undefined)
    qmv = ir.Constant(_V8F, ir.Undefined)
    for h in range(QKG_LANES):
        mxv = builder.insert_element(mxv, builder.load(builder.gep(mxp, [hidx[h]])),
                                     ir.Constant(_I32T, h))
        if kind == "i8":
            qmv = builder.insert_element(qmv, builder.load(builder.gep(qmp, [hidx[h]])),
                                         ir.Constant(_I32T, h))
    qrows = [builder.inttoptr(_row_ptr(builder, qa, hidx[h]),
                              (_I8T if kind == "i8" else f32).as_pointer())
             for h in range(QKG_LANES)]
    if kind == "i8":
        with cgutils.for_range(builder, nd16) as ql:
            for h in range(QKG_LANES):
                qv = builder.load(builder.bitcast(builder.gep(qrows[h], [builder.mul(
                    ql.index, ir.Constant(i64, 16))]), _V16I8.as_pointer()), align=1)
                builder.store(builder.sext(qv, _V16I16), builder.gep(qbuf, [
                    builder.add(builder.mul(ir.Constant(i64, h), nd16), ql.index)]))
    return qrows, mxv, qmv


def _qkg_body(builder, kind, arrs, ng_v, kaddr_v, nrows_v, rb, off0):
    """The body of :func:`_make_qkg` (``arrs``: the array structs of ``q, qmul, rmul, sc,
    mx``)."""
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    qa, qma, ra, sca, mxa = arrs
    d = builder.extract_value(qa.shape, 1)
    nch = builder.udiv(d, ir.Constant(i64, 64))
    nd16 = builder.udiv(d, ir.Constant(i64, 16))
    last = builder.sub(nrows_v, ir.Constant(i64, 1))
    kbase = builder.inttoptr(kaddr_v, _I8T.as_pointer())
    qmp = builder.bitcast(qma.data, f32.as_pointer())
    rmp = builder.bitcast(ra.data, f32.as_pointer())
    mxp = builder.bitcast(mxa.data, f32.as_pointer())
    # the sign-extended queries of the 8 heads of a pass: [8 heads][D / 16]
    qbuf = (cgutils.alloca_once(builder, _V16I16, size=QKBLK_MAX_D // 16 * 8)
            if kind == "i8" else None)
    with cgutils.for_range_slice(builder, ir.Constant(i64, 0), ng_v,
                                 ir.Constant(i64, QKG_LANES)) as (h0, _):
        nh = builder.sub(ng_v, h0)
        qrows, mxv, qmv = _qkg_heads(builder, kind, qa, h0, nh, mxp, qmp, qbuf, nd16)
        mxa_ptr = cgutils.alloca_once_value(builder, mxv)
        for half in range(2):
            j0 = 8 * half
            cond = (ir.Constant(ir.IntType(1), 1) if half == 0 else
                    builder.icmp_signed(">", nrows_v, ir.Constant(i64, 8)))
            with builder.if_then(cond):
                vals, live = [], []
                for jj in range(8):
                    j = ir.Constant(i64, j0 + jj)
                    jl = builder.icmp_signed("<", j, nrows_v)
                    r = builder.select(jl, j, last)
                    row = builder.gep(kbase, [builder.mul(r, rb)])
                    if kind == "i8":
                        vals.append(_qkg_key_i8(builder, row, nch, qbuf, nd16, qmv,
                                                builder.load(builder.gep(rmp, [r]))))
                    else:
                        vals.append(_qkg_key_f16(builder, row, nch, qrows, builder.load(qmp)))
                    live.append(jl)
                m = _qkg_store(builder, vals, live, h0, nh, sca,
                               builder.add(off0, ir.Constant(i64, j0)), builder.load(mxa_ptr))
                builder.store(m, mxa_ptr)
        mxv = builder.load(mxa_ptr)
        for h in range(QKG_LANES):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, h), nh)):
                builder.store(builder.extract_element(mxv, ir.Constant(_I32T, h)),
                              builder.gep(mxp, [builder.add(h0, ir.Constant(i64, h))]))


def _make_qkg(kind):
    """The grouped score intrinsic of INT8 key rows against int8 queries (``kind`` "i8":
    ``_qkg_i8``) or float16 key rows against float32 queries ("f16": ``_qkg_f16``), AVX2."""

    @intrinsic
    def qkg(typingctx, q, ng, kaddr, nrows, rowbytes, qmul, rmul, sc, off, mx):
        """Scores of up to 16 key rows (``nrows``, at ``kaddr``, ``rowbytes`` apart; rows
        ``>= nrows`` repeat the last one, never read out of bounds) against ``ng`` query heads
        ``q [ng, D]``, :data:`QKG_LANES` heads per pass in the lanes of one vector, so each key
        row is loaded (and sign-extended / converted) once per 8 heads: ``sc[h, off + j]`` for
        ``h < ng``, ``j < 16`` (all 16 written when ``nrows > 8``, else 8); ``mx[h]`` becomes
        the max of itself and the first ``nrows`` scores. ``D % 64 == 0``.

        ``i8``: ``q`` int8 codes (:func:`_quantize_heads`), INT8 key codes; per key and head one
        8-lane ``vpmaddwd`` accumulator over the features (both sides sign-extended to int16),
        the 8 heads' accumulators summed across lanes in one shuffle tree: the exact int32 sums
        ``S`` of :func:`_qk16_i8`, and the same epilogue ``float32(S) * (qmul[h] * rmul[j])``
        (bitwise equal scores). ``D <= QKBLK_MAX_D`` (the sign-extended queries of 8 heads live
        in a stack buffer).

        ``f16``: ``q`` float32, float16 key rows converted in registers (``fpext``:
        ``vcvtph2ps``), one fused multiply-add per 8 features and head, summed across lanes in
        a shuffle tree, times ``qmul[0]`` (the attention scale); ``rmul`` unused."""
        qdt = types.int8 if kind == "i8" else types.float32
        if not (isinstance(q, types.Array) and q.dtype == qdt and q.ndim == 2
                and isinstance(sc, types.Array) and sc.dtype == types.float32 and sc.ndim == 2
                and all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32
                        for a in (qmul, rmul, mx))):
            return None
        sig = types.void(q, ng, kaddr, nrows, rowbytes, qmul, rmul, sc, off, mx)

        def codegen(context, builder, sig, args):
            arrs = [context.make_array(sig.args[k])(context, builder, args[k])
                    for k in (0, 5, 6, 7, 9)]
            ng_v, kaddr_v, nrows_v, rb, off0 = (
                context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 2, 3, 4, 8))
            _qkg_body(builder, kind, arrs, ng_v, kaddr_v, nrows_v, rb, off0)
            return context.get_dummy_value()
        return sig, codegen
    return qkg


_qkg_i8 = _make_qkg("i8")
_qkg_f16 = _make_qkg("f16")
