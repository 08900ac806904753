"""LLVM-IR building blocks of the ggml group-record kernels (:mod:`.ggml_packed`,
:mod:`.ggml_gemm`).

The record layout, the integer math of the two instruction paths and the float combination per
block are described in :mod:`.ggml_packed`'s module docstring. These helpers emit, for one record
of ``data`` (uint8 array) at byte offset ``roff``: its float16 scales, the 8 chunk vectors ``U_t``
of each 32-block (``chunks``), and the exact int32 sums ``sum_t dot4(U_t, X_t)``
(``dot_sums``). They live in their own module so that both the one-row kernels
(:mod:`.ggml_packed`) and the multi-row prefill kernels (:mod:`.ggml_gemm`) build on them
without an import cycle.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .packed_i8 import HOST_VNNI, elem_ptr, splat

#: exact mode: ``u - OFFSET[kind]`` is the signed code of a chunk byte ``u``.
OFFSET = {8: 128, 6: 16, 12: 0, 14: 32, 3: 0, 7: 0, 13: 0}
#: kinds with a per-32-block float16 minimum ``m`` (Q4_1, Q5_1: ``w = d u + m``) at record byte 16.
MIN32 = (3, 7)
#: k-quant kinds with 6-bit sub-block scales and mins (Q4_K, Q5_K: ``w = (d sc) u - dmin m``).
KQ = (12, 13)
#: prefetch distance (bytes ahead in a group's record stream) of the int8 record loops.
PF_BYTES = 2048

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
F32 = ir.FloatType()
LV32I8 = ir.VectorType(I8, 32)
LV16I16 = ir.VectorType(I16, 16)
LV8I32 = ir.VectorType(I32, 8)
LV8F32 = ir.VectorType(F32, 8)
LV16F32 = ir.VectorType(F32, 16)
LV8I16 = ir.VectorType(I16, 8)
LV8I8 = ir.VectorType(I8, 8)
LV8F16 = ir.VectorType(ir.HalfType(), 8)


# ------------------------------------------------------------------------------------------------
# IR building blocks
# ------------------------------------------------------------------------------------------------
def concat(builder, vs):
    """One vector of the lanes of ``vs`` (1 or 2 vectors of the same type) in order: the 8 lanes
    of two groups' records side by side in a 16-lane vector."""
    if len(vs) == 1:
        return vs[0]
    n = vs[0].type.count
    return builder.shuffle_vector(vs[0], vs[1], ir.Constant(ir.VectorType(I32, 2 * n),
                                                            list(range(2 * n))))


class Emit:
    """IR helpers over one record: ``data`` (uint8 array) at byte offset ``roff``."""

    def __init__(self, context, builder, dty, data, roff):
        self.c, self.b = context, builder
        self.dty, self.data, self.roff = dty, data, roff

    def const(self, v, ty=None):
        return ir.Constant(ty or self.roff.type, v)

    def ptr(self, off, vty):
        o = self.b.add(self.roff, self.const(off))
        return elem_ptr(self.c, self.b, self.dty, self.data, o, vty)

    def v32(self, off):
        return self.b.load(self.ptr(off, LV32I8), align=1)

    def f16x8(self, off):
        h = self.b.bitcast(self.b.load(self.ptr(off, LV8I16), align=1), LV8F16)
        return self.b.fpext(h, LV8F32)

    def bytes8(self, off, signed):
        v = self.b.load(self.ptr(off, LV8I8), align=1)
        return self.b.sext(v, LV8I32) if signed else self.b.zext(v, LV8I32)

    def srl16(self, v, s):
        if s == 0:
            return v
        w = self.b.bitcast(v, LV16I16)
        return self.b.bitcast(self.b.lshr(w, ir.Constant(LV16I16, [s] * 16)), LV32I8)

    def and8(self, v, m):
        return self.b.and_(v, ir.Constant(LV32I8, [m] * 32))

    def nibbles(self, off):
        """Chunk vectors U_0..U_7 (low 4 bits) of the 128 nibble bytes at ``off``."""
        vs = [self.v32(off + 32 * c) for c in range(4)]
        return [self.and8(v, 15) for v in vs] + [self.and8(self.srl16(v, 4), 15) for v in vs]

    def with_high(self, lo, hvecs, bits):
        """U_t |= (high bits of chunk t) << 4; ``hvecs``: vectors holding ``8 // per`` chunks."""
        per = 8 // bits  # chunks per high-bit vector
        out = []
        mask = (1 << bits) - 1
        for t, u in enumerate(lo):
            h = self.and8(self.srl16(hvecs[t // per], bits * (t % per)), mask)
            out.append(self.b.or_(u, self.b.bitcast(
                self.b.shl(self.b.bitcast(h, LV16I16), ir.Constant(LV16I16, [4] * 16)),
                LV32I8)))
        return out


def xbcast(context, builder, xty, xq, xo, t):
    """The 4 int8 activations ``xq[xo + 4t : xo + 4t + 4]`` repeated in the 8 lanes."""
    o = builder.add(xo, ir.Constant(xo.type, 4 * t))
    p = elem_ptr(context, builder, xty, xq, o, I32)
    return builder.bitcast(splat(builder, builder.load(p, align=1), LV8I32), LV32I8)


def sign_trick(builder, us, xs):
    """Signed codes ``q = u ^ 0x80`` -> (``|q|``, ``sign(x, q)``): ``|q| * sign(x, q) = q * x``
    with ``|q| <= 128`` unsigned, so ``vpmaddubsw`` pair sums stay within int16."""
    zero = ir.Constant(LV32I8, [0] * 32)
    su, sx = [], []
    for u, x in zip(us, xs):
        q = builder.xor(u, ir.Constant(LV32I8, [0x80] * 32))
        neg = builder.icmp_signed("<", q, zero)
        su.append(builder.select(neg, builder.sub(zero, q), q))
        xn = builder.select(neg, builder.sub(zero, x), x)
        sx.append(builder.select(builder.icmp_signed("==", q, zero), zero, xn))
    return su, sx


def dot_sums(builder, us, xs, vnni, groups, signed=False, xsum=None):
    """Exact int32 lanes ``sum_{t in group} dot4(U_t, X_t)`` for each group of chunk indices, on
    the VNNI path (``vpdpbusd``) when ``vnni`` is true at run time (and the host has it), else
    ``vpmaddubsw`` + ``vpmaddwd``. ``signed``: the sums of ``q = u - 128`` (Q8_0, stored as
    ``u = q ^ 0x80``): VNNI subtracts ``128 * sum(x)`` (``xsum`` = that int32 value), AVX2
    uses the sign trick on ``q``."""

    def avx2():
        u2, x2 = sign_trick(builder, us, xs) if signed else (us, xs)
        mub = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(LV16I16, [LV32I8, LV32I8]),
            "llvm.x86.avx2.pmadd.ub.sw")
        mwd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(LV8I32, [LV16I16, LV16I16]),
            "llvm.x86.avx2.pmadd.wd")
        ones = ir.Constant(LV16I16, [1] * 16)
        res = []
        for grp in groups:
            acc = None
            for t in grp:
                p = builder.call(mwd, [builder.call(mub, [u2[t], x2[t]]), ones])
                acc = p if acc is None else builder.add(acc, p)
            res.append(acc)
        return res

    def avx512vnni():
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(LV8I32, [LV8I32, LV32I8, LV32I8]),
            "llvm.x86.avx512.vpdpbusd.256")
        res = []
        for grp in groups:
            acc = (splat(builder, builder.sub(ir.Constant(I32, 0), xsum), LV8I32) if signed
                   else ir.Constant(LV8I32, [0] * 8))
            for t in grp:
                acc = builder.call(dp, [acc, us[t], xs[t]])
            res.append(acc)
        return res

    if not HOST_VNNI:  # the VNNI instruction cannot even be compiled here
        return avx2()
    pred = builder.icmp_unsigned("!=", vnni, ir.Constant(vnni.type, 0))
    with builder.if_else(pred) as (then, otherwise):
        with then:
            r_v = avx512vnni()
            b_v = builder.block
        with otherwise:
            r_a = avx2()
            b_a = builder.block
    out = []
    for x1, x2 in zip(r_v, r_a):
        phi = builder.phi(LV8I32)
        phi.add_incoming(x1, b_v)
        phi.add_incoming(x2, b_a)
        out.append(phi)
    return out


def load_i32(context, builder, aty, arr, off):
    return builder.load(elem_ptr(context, builder, aty, arr, off, I32))


def load_f32(context, builder, aty, arr, off):
    return builder.load(elem_ptr(context, builder, aty, arr, off, F32))


def idx(builder, base, k):
    return builder.add(base, ir.Constant(base.type, k))


def k4_scales(e, b):
    """(sc_b, m_b) lanes (int32, one per row) of sub-block ``b`` from the packed 6-bit scales
    (record bytes 32..127, byte ``8j + r``)."""
    bl = e.b

    def s(j):
        return e.bytes8(32 + 8 * j, signed=False)

    def c(v):
        return ir.Constant(LV8I32, [v] * 8)
    if b < 4:
        return bl.and_(s(b), c(63)), bl.and_(s(b + 4), c(63))
    sc = bl.or_(bl.and_(s(b + 4), c(15)), bl.shl(bl.lshr(s(b - 4), c(6)), c(4)))
    mn = bl.or_(bl.lshr(s(b + 4), c(4)), bl.shl(bl.lshr(s(b), c(6)), c(4)))
    return sc, mn


def sub_layout(kind, sub):
    """Record byte offsets of 32-block ``sub``'s nibbles (128 B) and high-bit vectors (None
    without), and the high bits per code (0, 1 or 2); not Q8_0."""
    if kind == 3:
        return 32, None, 0
    if kind == 6:
        return 48, 16, 1
    if kind == 7:
        return 64, 32, 1
    if kind == 12:
        return 128 + 128 * sub, None, 0
    if kind == 13:
        o = 128 + 160 * sub  # Q5_K sub-block: 128 nibble bytes, then 32 high-bit bytes
        return o, o + 128, 1
    o = 144 + 192 * sub  # Q6_K sub-block: 128 nibble bytes, then 64 high-bit bytes
    return o, o + 128, 2


def chunks(e, kind, sub):
    """Chunk vectors U_0..U_7 of 32-block ``sub`` of the record."""
    if kind == 8:
        return [e.v32(16 + 32 * t) for t in range(8)]
    nib, high, bits = sub_layout(kind, sub)
    if not bits:
        return e.nibbles(nib)
    return e.with_high(e.nibbles(nib), [e.v32(high + 32 * v) for v in range(bits)], bits)


def nsub(kind):
    """32-blocks per record."""
    return 1 if kind in (3, 6, 7, 8) else 8
