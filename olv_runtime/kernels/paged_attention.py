"""Fused attention over a paged KV cache whose blocks have heterogeneous encodings.

Source: ONNX ``Attention`` (opset 23) semantics (GQA: query head ``h`` reads kv head
``h // (H / KVH)``; bottom-right aligned causal mask: the query at absolute position ``p`` attends
keys at positions ``<= p``; softmax in float32), seed 000 "Quantized and paged caches use the same
feedback" (no full-cache copy or dequantization), online softmax (Milakov & Gimelshein 2018;
FlashAttention's streaming form).

Block storage (see :mod:`olv_runtime.kv.paged`): block slots live in *chunks*; one chunk holds
``capacity`` slots of one (key format, value format) pair. The kernel sees one chunk side (K or V)
as five arrays, only those of its format being real (the others are 1-element dummies):

============ ============================================ =======================================
format       arrays                                       element ``(slot, g, t, i)``
============ ============================================ =======================================
0 float32    ``f32``  float32 [cap, KVH, BS, D]            ``f32[slot, g, t, i]``
1 float16    ``u16``  uint16  [cap, KVH, BS, D] (bits)     ``table[u16[...]]`` (65536-entry LUT)
2 int8       ``codes`` uint8 [cap, KVH, BS, 1, D],         ``int8(codes[slot, g, t, 0, i]) *
             ``scale`` float32 [cap, KVH, SB, 1]            scale[slot, g, t or 0, 0]``
3 int4       ``codes`` uint8 [cap, KVH, BS, 1, D/2]        signed nibble ``i % 2`` (low first)
             (two codes per byte, low nibble first)          of byte ``i // 2``, times the scale
4 codebook2  ``codes`` uint8 [cap, KVH, BS, D/32, 8]       ``table[index] * scale[slot, g, t, i//32]``
             (32 x 2-bit indices, LSB first), ``scale``     with ``index`` = bits ``2*(i%4)`` of
             float32 [cap, KVH, BS, D/32], ``table`` [4]     byte ``(i % 32) // 4`` (type 1102)
============ ============================================ =======================================

``SB`` is ``BS`` (scales per token and head) or 1 (per block and head).

The attention kernel reads blocks through a *block table*: an int64 array with one row per block
(:data:`TABLE_COLS`: per side the format code, the slot's raw address, the scale address and a
per-token-scale flag; then the block's first position and its valid tokens; :func:`table_row`).
The table is plain data, so a compiled decode step takes it as an argument
(:mod:`olv_runtime.kernels.decoder_layers`). Each (kv head, query) task makes one pass over the
blocks for every query head of its group (GQA): consecutive blocks fill one softmax tile of up to
:func:`tile_width` keys. Scores of float32 rows are read straight from the block; a side of
another format is decoded one block and kv head at a time (``BS x D`` floats, 4 KiB for 16 x 64)
into a private scratch that stays in L1 -- INT8/INT4 codes converted by one vector loop and
multiplied by the token's (or block's) scale, float16 by ``fpext``, codebook indices by table
lookup -- and used at once by every query head of the group, then overwritten by the next block.
Then one online-softmax update per head and tile with vectorised exponentials
(:func:`~.attention._softmax_tile`), then ``o += p @ V`` (the value side decoded the same way,
its scales folded into the probabilities; with ``D % 16 == 0`` the output rows of four query
heads stay in registers over a block's keys, :func:`_make_pv`).

With ``int8_query`` (the compiled decode step in int8-activation mode) the scores of INT8/INT4
key blocks are integer dot products: each query head is quantized to int8 once per call (one
scale per head), 16 keys at a time are scored by ``vpdpbusd`` (AVX-512 VNNI) or ``vpmaddwd``
(AVX2; chosen at run time by :func:`~.packed_i8.isa`, bitwise equal) on the block's own codes,
and the exact integer sum times ``(query scale * attention scale) * key scale`` is the score
(:func:`_qk16_i8`). On the VNNI path (``D <= 256``) the 16 key rows are loaded and transposed in
registers once for all the query heads of the group, each head then taking one ``vpdpbusd`` per
4 features with no horizontal sums (:func:`_qkblk_i8`). INT8/INT4 value rows are decoded in
registers inside ``p @ V`` (codes sign-extended, converted, times the row's scale; up to eight
query heads per pass, :func:`_make_pvq`): no decoded copy of a quantized value block. The block format -- codes and scales -- is read as it is. The cache is never dequantized into a buffer
(``bytes_dequantized`` stays 0): the workspace of a call (:func:`workspace_bytes`) depends on the
query and head counts and the block size only.

A query with no attendable key gets zeros (fully masked rows are defined). Sealing (conversion of
a full block into a quantized format) is :func:`convert_block`.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from olv_runtime.errors import InvalidArgument

from .attention import (
    _FM,
    SLACK,
    _accum_rows,
    _dot,
    _scores_rows,
    _softmax_tile,
    _state_finish,
    _state_init,
    _tile_max_init,
)
from .config import JIT, PJIT, lazy_njit
from .packed_i8 import HOST_VNNI, use_vnni

__all__ = ["FORMAT_CODES", "ChunkSide", "paged_attention", "convert_block", "F16_TABLE",
           "dummy_side"]

#: Block format name -> kernel code.
FORMAT_CODES = {"float32": 0, "float16": 1, "int8": 2, "int4": 3, "codebook2": 4}

#: float16 bits -> float32, exact (numba has no float16 arithmetic).
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_F32 = types.Array(types.float32, 4, "A")
_U16 = types.Array(types.uint16, 4, "A")
_COD = types.Array(types.uint8, 5, "A")
_SCL = types.Array(types.float32, 4, "A")
_TAB = types.Array(types.float32, 1, "A")
_SIDE = (types.int64, _F32, _U16, _COD, _SCL, _TAB)


@njit(inline="always", **JIT)
def _load_row(fmt, f32, u16, codes, scale, table, slot, g, t, row):
    """Dequantize token ``t`` of kv head ``g`` of block ``slot`` into ``row[D]`` (registers/L1)."""
    d = row.shape[0]
    if fmt == 0:
        for i in range(d):
            row[i] = f32[slot, g, t, i]
    elif fmt == 1:
        for i in range(d):
            row[i] = table[u16[slot, g, t, i]]
    elif fmt == 2:
        st = t if scale.shape[2] > 1 else 0
        s = scale[slot, g, st, 0]
        for i in range(d):
            c = np.int32(codes[slot, g, t, 0, i])
            row[i] = np.float32((c ^ 128) - 128) * s
    elif fmt == 3:
        st = t if scale.shape[2] > 1 else 0
        s = scale[slot, g, st, 0]
        for i in range(d):
            b = np.int32(codes[slot, g, t, 0, i >> 1])
            n = (b >> ((i & 1) * 4)) & 15
            row[i] = np.float32((n ^ 8) - 8) * s
    else:
        for i in range(d):
            grp = i >> 5
            j = i & 31
            b = np.int32(codes[slot, g, t, grp, j >> 2])
            idx = (b >> ((j & 3) * 2)) & 3
            row[i] = table[idx] * scale[slot, g, t, grp]


# -- raw block addresses -------------------------------------------------------------------------
#: Columns of a block-table row (int64): format and slot addresses of the key and value sides,
#: position of the block's first token, valid tokens.
T_KFMT, T_KADDR, T_KSADDR, T_KPT, T_VFMT, T_VADDR, T_VSADDR, T_VPT, T_START, T_LEN = range(10)
TABLE_COLS = 10


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


@njit(**JIT)
def _block_f32(addr, g, bs, d):
    """The float32 [BS, D] rows of kv head ``g`` of a float32 block slot at ``addr``."""
    return carray(_f32p(addr + g * bs * d * 4), (bs, d))


_i8p = _ptr_intrinsic(types.int8)


@njit(**_FM)
def _dequant_block(fmt, addr, saddr, pt, g, bs, d, nk, mult, out, rmul):
    """The first ``nk`` tokens of kv head ``g`` of a float16/int8/int4/codebook2 block slot into
    ``out[:nk, :D]`` (a private L1 scratch of one block and head) so that the decoded row ``t``
    is ``out[t] * rmul[t]``: float16 and codebook2 rows decoded in full (``rmul = mult``),
    INT8/INT4 as their integer codes (one vector conversion) with the token's (or block's)
    scale folded into ``rmul[t] = mult * scale``."""
    if fmt == 1:
        src = carray(_u16p(addr + g * bs * d * 2), (nk * d,))
        flat = out.reshape(out.shape[0] * d)
        for i in range(nk * d):
            flat[i] = _half_to_f32(src[i])
        for t in range(nk):
            rmul[t] = mult
    elif fmt == 2 or fmt == 3:
        if pt:
            sc = carray(_f32p(saddr + g * bs * 4), (nk,))
            for t in range(nk):
                rmul[t] = mult * sc[t]
        else:
            s = carray(_f32p(saddr + g * 4), (1,))[0] * mult
            for t in range(nk):
                rmul[t] = s
        flat = out.reshape(out.shape[0] * d)
        if fmt == 2:
            src8 = carray(_i8p(addr + g * bs * d), (nk * d,))
            for i in range(nk * d):
                flat[i] = np.float32(src8[i])
        else:
            h = nk * d // 2
            srcu = carray(_u8p(addr + g * bs * (d // 2)), (h,))
            for i in range(h):  # 4-bit two's complement: sign-extend by shifts
                b = np.int32(srcu[i])
                flat[2 * i] = np.float32(np.int32(b << 28) >> 28)
                flat[2 * i + 1] = np.float32(np.int32(b << 24) >> 28)
    else:  # codebook2: records of 8 code bytes (32 x 2-bit indices) + float32 scale
        ng = d // 32
        table = carray(_f32p(saddr), (4,))
        for t in range(nk):
            rmul[t] = mult
            r = g * bs + t
            row = out[t]
            for grp in range(ng):
                rec = addr + (r * ng + grp) * 12
                codes = carray(_u8p(rec), (8,))
                s = carray(_f32p(rec + 8), (1,))[0]
                for j in range(32):
                    b = np.int32(codes[j >> 2])
                    row[grp * 32 + j] = table[(b >> ((j & 3) * 2)) & 3] * s


@njit(**_FM)
def _scale_rows(rows, n, rmul):
    d = rows.shape[1]
    for t in range(n):
        r = rows[t]
        m = rmul[t]
        for i in range(d):
            r[i] = r[i] * m


@njit(**JIT)
def _scores_rows_m(qg, ng, k, nt, rmul, sc, c0, mx):
    """``sc[hh, c0 + j] = (qg[hh] . k[j]) * rmul[j]``; ``mx[hh]`` tracks the max."""
    d = qg.shape[1]
    for j in range(nt):
        kr = k[j]
        m = rmul[j]
        for hh in range(ng):
            v = _dot(qg[hh], kr, d) * m
            sc[hh, c0 + j] = v
            if v > mx[hh]:
                mx[hh] = v


@njit(**_FM)
def _accum_rows_m(p, c0, ng, v, nt, o, rmul):
    """``o[hh] += sum_j (p[hh, c0 + j] * rmul[j]) * v[j]`` (four keys per pass over ``o``)."""
    d = o.shape[1]
    j = 0
    while j + 4 <= nt:
        v0 = v[j]
        v1 = v[j + 1]
        v2 = v[j + 2]
        v3 = v[j + 3]
        m0 = rmul[j]
        m1 = rmul[j + 1]
        m2 = rmul[j + 2]
        m3 = rmul[j + 3]
        for hh in range(ng):
            pr = p[hh]
            p0 = pr[c0 + j] * m0
            p1 = pr[c0 + j + 1] * m1
            p2 = pr[c0 + j + 2] * m2
            p3 = pr[c0 + j + 3] * m3
            oh = o[hh]
            for i in range(d):
                oh[i] += (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])
        j += 4
    while j < nt:
        vr = v[j]
        mj = rmul[j]
        for hh in range(ng):
            pj = p[hh, c0 + j] * mj
            oh = o[hh]
            for i in range(d):
                oh[i] += pj * vr[i]
        j += 1


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
            rowptrs = []
            for j in range(16):
                jj = ir.Constant(i64, j)
                r = builder.select(builder.icmp_signed("<", jj, nrows_v), jj, last)
                rowptrs.append(builder.gep(kbase, [builder.mul(builder.add(row0_v, r), rb)]))
            optr = cgutils.alloca_once(builder, _V16I32)  # the exact sums (either path)

            def key_bytes(j, c, fmt4, unsigned):
                """The 64 bytes of key j, chunk c (64 features) in q's order."""
                if not fmt4:
                    off = builder.mul(c, ir.Constant(i64, 64))
                    kv = builder.load(builder.bitcast(builder.gep(rowptrs[j], [off]),
                                                      _V64I8.as_pointer()), align=1)
                    return builder.xor(kv, ir.Constant(_V64I8, [-128] * 64)) if unsigned else kv
                off = builder.mul(c, ir.Constant(i64, 32))
                b = builder.load(builder.bitcast(builder.gep(rowptrs[j], [off]), _V32I8.as_pointer()),
                                 align=1)
                four = ir.Constant(_V32I8, [4] * 32)
                if unsigned:
                    eight = ir.Constant(_V32I8, [8] * 32)
                    lo = builder.xor(builder.and_(b, ir.Constant(_V32I8, [15] * 32)), eight)
                    hi = builder.xor(builder.lshr(b, four), eight)
                else:
                    lo = builder.ashr(builder.shl(b, four), four)
                    hi = builder.ashr(b, four)
                return _concat32(builder, lo, hi)

            def tree(vecs):
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

            def vnni_body(fmt4):
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
                        u = key_bytes(j, c, fmt4, True)
                        builder.store(builder.call(dp, [builder.load(accs[j]), u, qv]), accs[j])
                tot = tree([builder.load(a) for a in accs])
                corr = builder.mul(qs, ir.Constant(_I32T, 8 if fmt4 else 128))
                builder.store(builder.sub(tot, _vsplat(builder, corr, _V16I32)), optr)

            def avx2_body(fmt4):
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
                        kv = key_bytes(j, c, fmt4, False)
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

            if HOST_VNNI:
                with builder.if_else(isvnni) as (then, otherwise):
                    with then:
                        vnni_body(fmt4)
                    with otherwise:
                        avx2_body(fmt4)
            else:  # the VNNI instruction cannot even be compiled here
                avx2_body(fmt4)
            # float32(S) * (qmul * rmul[row0 + j]) in 16 lanes (the same two multiplies per key as
            # the scalar form), stored; the max over the first nrows lanes
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
            w = 16
            while w > 1:
                half = w // 2
                hi = builder.shuffle_vector(cur, ir.Constant(v16f, ir.Undefined), ir.Constant(
                    ir.VectorType(_I32T, 16), [half + i if i < half else 0 for i in range(16)]))
                cur = builder.select(builder.fcmp_ordered(">", hi, cur), hi, cur)
                w = half
            return builder.extract_element(cur, ir.Constant(_I32T, 0))
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
            f32 = ir.FloatType()
            v16f = ir.VectorType(f32, 16)
            qa = context.make_array(sig.args[0])(context, builder, args[0])
            qsa = context.make_array(sig.args[6])(context, builder, args[6])
            qma = context.make_array(sig.args[7])(context, builder, args[7])
            ra = context.make_array(sig.args[8])(context, builder, args[8])
            sca = context.make_array(sig.args[9])(context, builder, args[9])
            mxa = context.make_array(sig.args[11])(context, builder, args[11])
            ng_v = context.cast(builder, args[1], sig.args[1], types.int64)
            kaddr_v = context.cast(builder, args[2], sig.args[2], types.int64)
            row0_v = context.cast(builder, args[3], sig.args[3], types.int64)
            nrows_v = context.cast(builder, args[4], sig.args[4], types.int64)
            rb = context.cast(builder, args[5], sig.args[5], types.int64)
            off_v = context.cast(builder, args[10], sig.args[10], types.int64)
            d = builder.extract_value(qa.shape, 1)
            nch = builder.udiv(d, ir.Constant(i64, 64))
            last = builder.sub(nrows_v, ir.Constant(i64, 1))
            kbase = builder.inttoptr(kaddr_v, _I8T.as_pointer())
            rowptrs = []
            for j in range(16):
                jj = ir.Constant(i64, j)
                r = builder.select(builder.icmp_signed("<", jj, nrows_v), jj, last)
                rowptrs.append(builder.gep(kbase, [builder.mul(builder.add(row0_v, r), rb)]))
            tbuf = cgutils.alloca_once(builder, _V16I32, size=QKBLK_MAX_D // 4)
            # 1. the block's key bytes, transposed: tbuf[16 c + e] lane j = dword e of chunk c of key j
            with cgutils.for_range(builder, nch) as loop:
                c = loop.index
                rows = []
                for j in range(16):
                    if not fmt4:
                        kv = builder.load(builder.bitcast(builder.gep(rowptrs[j], [builder.mul(
                            c, ir.Constant(i64, 64))]), _V64I8.as_pointer()), align=1)
                        kv = builder.xor(kv, ir.Constant(_V64I8, [-128] * 64))
                    else:
                        b = builder.load(builder.bitcast(builder.gep(rowptrs[j], [builder.mul(
                            c, ir.Constant(i64, 32))]), _V32I8.as_pointer()), align=1)
                        eight = ir.Constant(_V32I8, [8] * 32)
                        lo = builder.xor(builder.and_(b, ir.Constant(_V32I8, [15] * 32)), eight)
                        hi = builder.xor(builder.lshr(b, ir.Constant(_V32I8, [4] * 32)), eight)
                        kv = _concat32(builder, lo, hi)
                    rows.append(builder.bitcast(kv, _V16I32))
                cols = _transpose16(builder, rows)
                base = builder.mul(c, ir.Constant(i64, 16))
                for e in range(16):
                    builder.store(cols[e], builder.gep(tbuf, [builder.add(base, ir.Constant(i64, e))]))
            # 2. per head: 16 vpdpbusd per 64 features, the float epilogue, the running max
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
                w = 16
                while w > 1:
                    half = w // 2
                    hi = builder.shuffle_vector(cur, ir.Constant(v16f, ir.Undefined), ir.Constant(
                        ir.VectorType(_I32T, 16), [half + i if i < half else 0 for i in range(16)]))
                    cur = builder.select(builder.fcmp_ordered(">", hi, cur), hi, cur)
                    w = half
                bm = builder.extract_element(cur, ir.Constant(_I32T, 0))
                mp = builder.gep(mxp, [h])
                mo = builder.load(mp)
                builder.store(builder.select(builder.fcmp_ordered(">", bm, mo), bm, mo), mp)
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


@njit(**JIT)
def _accum_pvq(p, c0, ng, fmt, vaddr, rb, rmul, nt, o):
    """``o[hh] += sum_{j < nt} p[hh, c0 + j] * rmul[j] * code_j`` over the value rows of an INT8
    (``fmt`` 2) or INT4 (3) block side at ``vaddr`` (``D % 16 == 0``): up to eight query heads
    per pass over the codes (:func:`_make_pvq`)."""
    hh = 0
    while hh < ng:
        r = min(ng - hh, 8)
        if fmt == 2:
            if r == 8:
                _pv8_8(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 7:
                _pv8_7(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 6:
                _pv8_6(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 5:
                _pv8_5(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 4:
                _pv8_4(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 3:
                _pv8_3(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 2:
                _pv8_2(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            else:
                _pv8_1(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
        else:
            if r == 8:
                _pv4_8(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 7:
                _pv4_7(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 6:
                _pv4_6(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 5:
                _pv4_5(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 4:
                _pv4_4(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 3:
                _pv4_3(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            elif r == 2:
                _pv4_2(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
            else:
                _pv4_1(p, hh, c0, vaddr, rb, rmul, nt, o, hh)
        hh += r


@njit(**JIT)
def _quantize_heads(q, h0, h1, scale, qi, qip, qmul, qsum):
    """Query heads ``q[h0:h1]`` (float32 [., D]) to int8, one scale per head (as the int8
    activations of the linears, :func:`~.packed._quantize_block`, over the head's ``D``
    features): ``d = max|q| / 127``, ``qi = rint(q / d)`` (half to even) clipped to
    [-127, 127], zeros when ``max|q| == 0``; ``qip`` the same codes in the nibble order of INT4
    rows (per 64 features: the even ones, then the odd ones); ``qmul = d * scale``,
    ``qsum = sum(qi)``."""
    d = q.shape[1]
    for hh in range(h0, h1):
        amax = np.float32(0.0)
        for i in range(d):
            a = abs(q[hh, i])
            if a > amax:
                amax = a
        dq = amax / np.float32(127.0)
        tot = 0
        if amax > np.float32(0.0):
            for i in range(d):
                v = np.rint(q[hh, i] / dq)
                if v > np.float32(127.0):
                    v = np.float32(127.0)
                elif v < np.float32(-127.0):
                    v = np.float32(-127.0)
                c = np.int32(v)
                qi[hh, i] = c
                tot += c
        else:
            for i in range(d):
                qi[hh, i] = 0
        for c0 in range(0, d - 63, 64):
            for j in range(32):
                qip[hh, c0 + j] = qi[hh, c0 + 2 * j]
                qip[hh, c0 + 32 + j] = qi[hh, c0 + 2 * j + 1]
        qmul[hh] = dq * scale
        qsum[hh] = tot


@njit(**JIT)
def _block_scores_i8(qi, qip, qmul, qsum, ng, fmt, addr, saddr, pt, g, bs, d, nk, sc, c0, mx,
                     rmul, vnni):
    """Scores of the first ``nk`` tokens of an INT8/INT4 key block side against the int8
    queries ``qi``/``qip [ng, D]`` into ``sc[:, c0:]``: ``float32(S) * (qmul[hh] * k_scale[t])``
    with ``S`` the exact integer dot product (:func:`_qk16_i8`; ``rmul`` needs 16 slots past
    the block's last multiple of 16)."""
    if pt:
        kst = carray(_f32p(saddr + g * bs * 4), (nk,))
        for t in range(nk):
            rmul[t] = kst[t]
    else:
        s = carray(_f32p(saddr + g * 4), (1,))[0]
        for t in range(nk):
            rmul[t] = s
    rb = d if fmt == 2 else d // 2
    base = addr + g * bs * rb
    is4 = fmt == 3
    if vnni and d <= QKBLK_MAX_D:  # every head of the group per load of 16 keys
        for jj in range(0, nk, 16):
            if is4:
                _qkblk_i4(qip, ng, base, jj, min(16, nk - jj), rb, qsum, qmul, rmul, sc, c0 + jj, mx)
            else:
                _qkblk_i8(qi, ng, base, jj, min(16, nk - jj), rb, qsum, qmul, rmul, sc, c0 + jj, mx)
        return
    for hh in range(ng):
        qv = qip[hh] if is4 else qi[hh]
        qm = qmul[hh]
        qs = qsum[hh]
        sr = sc[hh]
        m = mx[hh]
        for jj in range(0, nk, 16):
            if is4:
                bm = _qk16_i4(qv, base, jj, min(16, nk - jj), rb, qs, qm, rmul, sr, c0 + jj, vnni)
            else:
                bm = _qk16_i8(qv, base, jj, min(16, nk - jj), rb, qs, qm, rmul, sr, c0 + jj, vnni)
            if bm > m:
                m = bm
        mx[hh] = m


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


@njit(**JIT)
def _accum_pv(p, c0, ng, v, nt, o):
    """``o[hh] += sum_{j < nt} p[hh, c0 + j] * v[j]`` (float32 rows ``v [>= nt, D]``,
    ``D % 16 == 0``): four query heads at a time (:func:`_make_pv`)."""
    hh = 0
    while hh + 4 <= ng:
        _pv4(p, hh, c0, v, nt, o, hh)
        hh += 4
    r = ng - hh
    if r == 3:
        _pv3(p, hh, c0, v, nt, o, hh)
    elif r == 2:
        _pv2(p, hh, c0, v, nt, o, hh)
    elif r == 1:
        _pv1(p, hh, c0, v, nt, o, hh)


@njit(**JIT)
def _block_scores(qg, ng, fmt, addr, saddr, pt, g, bs, d, nk, scale, sc, c0, mx, scr, rmul):
    """Scores of the first ``nk`` tokens of one block side (any format) into ``sc[:, c0:]``."""
    if fmt == 0:
        _scores_rows(qg, ng, _block_f32(addr, g, bs, d), 0, nk, scale, sc, c0, mx)
    else:
        _dequant_block(fmt, addr, saddr, pt, g, bs, d, nk, np.float32(1.0), scr, rmul)
        if fmt == 2 or fmt == 3:  # the scales into the rows: decoded values
            _scale_rows(scr, nk, rmul)
        _scores_rows(qg, ng, scr, 0, nk, scale, sc, c0, mx)


@njit(**JIT)
def _block_accum(p, c0, ng, fmt, addr, saddr, pt, g, bs, d, nk, o, scr, rmul):
    """``o += p[:, c0:c0+nk] @ V`` for the first ``nk`` tokens of one block side (with
    ``D % 16 == 0``: a quantized side's row multipliers folded into ``p``, then
    :func:`_accum_pv`)."""
    if d % 16 == 0:
        if fmt == 0:
            _accum_pv(p, c0, ng, _block_f32(addr, g, bs, d), nk, o)
            return
        if fmt == 2 or fmt == 3:  # codes decoded in registers, times the row's scale
            if pt:
                sc = carray(_f32p(saddr + g * bs * 4), (nk,))
                for t in range(nk):
                    rmul[t] = sc[t]
            else:
                s = carray(_f32p(saddr + g * 4), (1,))[0]
                for t in range(nk):
                    rmul[t] = s
            rb = d if fmt == 2 else d // 2
            _accum_pvq(p, c0, ng, fmt, addr + g * bs * rb, rb, rmul, nk, o)
            return
        _dequant_block(fmt, addr, saddr, pt, g, bs, d, nk, np.float32(1.0), scr, rmul)
        for hh in range(ng):
            pr = p[hh]
            for j in range(nk):
                pr[c0 + j] = pr[c0 + j] * rmul[j]
        _accum_pv(p, c0, ng, scr, nk, o)
        return
    if fmt == 0:
        _accum_rows(p, c0, ng, _block_f32(addr, g, bs, d), 0, nk, o, np.float32(1.0))
    else:
        _dequant_block(fmt, addr, saddr, pt, g, bs, d, nk, np.float32(1.0), scr, rmul)
        _accum_rows_m(p, c0, ng, scr, nk, o, rmul)


@njit(**JIT)
def _flush(table, pend, npend, ng, g, bs, d, c, mx, m, l, o, sc, p, scr, rmul):
    _softmax_tile(sc, ng, c, mx, m, l, o, p)
    c0 = 0
    for k in range(npend):
        bi = pend[k, 0]
        nk = pend[k, 1]
        _block_accum(p, c0, ng, table[bi, T_VFMT], table[bi, T_VADDR], table[bi, T_VSADDR],
                     table[bi, T_VPT], g, bs, d, nk, o, scr, rmul)
        c0 += nk


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


#: Blocks ahead of the one being scored whose rows :func:`_prefetch_block` requests.
PREFETCH_BLOCKS = 2


@njit(**JIT)
def _row_bytes(fmt, d):
    if fmt == 0:
        return 4 * d
    if fmt == 1:
        return 2 * d
    if fmt == 2:
        return d
    if fmt == 3:
        return d // 2
    return 12 * (d // 32)


@njit(**JIT)
def _prefetch_block(table, bi, g, nh, bs, d):
    """Prefetch the key and value rows (and INT8/INT4 per-token scales) of kv heads
    ``g .. g + nh - 1`` of block ``bi``: the blocks of a cache sit in separate slots, so the
    hardware's stream prefetcher does not run ahead of the kernel across them."""
    for side in range(2):
        col = T_KFMT if side == 0 else T_VFMT
        fmt = table[bi, col]
        rb = _row_bytes(fmt, d)
        a = table[bi, col + 1] + g * bs * rb
        for off in range(0, nh * bs * rb, 64):
            _prefetch(a + off)
        if (fmt == 2 or fmt == 3) and table[bi, col + 3]:
            sa = table[bi, col + 2] + g * bs * 4
            for off in range(0, nh * bs * 4, 64):
                _prefetch(sa + off)


@njit(**JIT)
def _paged_rows(qg, ng, table, b0, b1, g, bs, qpos, causal, scale, m, l, o, sc, p, mx, scr,
                rmul, pend, iq, qi, qip, qmul, qsum, vnni, bmax, pfh):
    """Blocks ``table[b0:b1]`` of kv head ``g`` into the partial softmax state ``m, l, o`` of the
    ``ng`` query heads ``qg[ng, D]`` of the query at position ``qpos`` (keys at positions
    ``> qpos`` skipped when ``causal``). Consecutive blocks share one softmax tile of up to
    ``sc.shape[1] - SLACK`` keys. Scratch: ``sc, p`` float32 [ng, W + SLACK], W >= BS, ``mx`` [ng], ``scr``
    float32 [BS, D] (one block and head of a non-float32 side, decoded), ``rmul`` float32 [BS],
    ``pend`` int64 [W, 2] (the tile's blocks). ``iq``: scores of INT8/INT4 key blocks from the
    int8 queries ``qi``/``qip`` [ng, D] (``qmul``, ``qsum`` [ng]: :func:`_quantize_heads`;
    ``vnni`` the instruction path; ``rmul`` then [BS + 16]) when ``D % 64 == 0``. The rows of
    kv heads ``g .. g + pfh - 1`` of blocks before ``bmax`` are prefetched
    :data:`PREFETCH_BLOCKS` ahead (``pfh`` 0: none)."""
    d = qg.shape[1]
    iq = iq and d % 64 == 0
    w = sc.shape[1] - SLACK
    c = 0
    npend = 0
    _tile_max_init(mx, ng)
    for bi in range(b0, b1):
        nk = table[bi, T_LEN]
        if causal:
            nk = min(nk, qpos - table[bi, T_START] + 1)
        if nk <= 0:
            continue
        if pfh and bi + PREFETCH_BLOCKS < bmax:
            _prefetch_block(table, bi + PREFETCH_BLOCKS, g, pfh, bs, d)
        if c + nk > w:
            _flush(table, pend, npend, ng, g, bs, d, c, mx, m, l, o, sc, p, scr, rmul)
            c = 0
            npend = 0
            _tile_max_init(mx, ng)
        kf = table[bi, T_KFMT]
        if iq and (kf == 2 or kf == 3):
            _block_scores_i8(qi, qip, qmul, qsum, ng, kf, table[bi, T_KADDR],
                             table[bi, T_KSADDR], table[bi, T_KPT], g, bs, d, nk, sc, c, mx,
                             rmul, vnni)
        else:
            _block_scores(qg, ng, kf, table[bi, T_KADDR], table[bi, T_KSADDR],
                          table[bi, T_KPT], g, bs, d, nk, scale, sc, c, mx, scr, rmul)
        pend[npend, 0] = bi
        pend[npend, 1] = nk
        npend += 1
        c += nk
    if c:
        _flush(table, pend, npend, ng, g, bs, d, c, mx, m, l, o, sc, p, scr, rmul)


class ChunkSide:
    """The kernel arrays of one side (K or V) of one chunk (see the module table).

    Attributes
    ----------
    fmt : int
        Format code (:data:`FORMAT_CODES`).
    f32, u16, codes, scale, table : numpy.ndarray
        The format's arrays (dummies for the others).
    row_bytes : int
        Payload bytes the kernel reads per token and kv head (codes + its share of scales).
    """

    __slots__ = ("fmt", "f32", "u16", "codes", "scale", "table", "row_bytes", "addr", "stride",
                 "saddr", "sstride", "per_token")

    def __init__(self, fmt, f32=None, u16=None, codes=None, scale=None, table=None, row_bytes=0):
        self.fmt = int(fmt)
        self.f32 = _DUMMY_F32 if f32 is None else f32
        self.u16 = _DUMMY_U16 if u16 is None else u16
        self.codes = _DUMMY_COD if codes is None else codes
        self.scale = _DUMMY_SCL if scale is None else scale
        self.table = _DUMMY_TAB if table is None else table
        self.row_bytes = int(row_bytes)
        self._addresses()

    def _addresses(self):
        """Slot addresses for the block table (:func:`table_row`): ``addr + slot * stride`` is
        the slot's first byte (``[KVH, BS, ...]`` C-order inside a slot, checked), likewise
        ``saddr``/``sstride`` for INT8/INT4 scales (codebook2: ``saddr`` is the codebook)."""
        fmt = self.fmt
        main = (self.f32, self.u16, self.codes, self.codes, self.codes)[fmt]
        if fmt != 4 and not _slot_contiguous(main):
            raise InvalidArgument(f"block storage: expected C-ordered slots, got strides "
                                  f"{main.strides} for shape {list(main.shape)}")
        self.addr = int(main.__array_interface__["data"][0])
        self.stride = int(main.strides[0])
        self.saddr, self.sstride, self.per_token = 0, 0, 0
        if fmt in (2, 3):
            if not _slot_contiguous(self.scale):
                raise InvalidArgument("block scales: expected C-ordered slots")
            self.saddr = int(self.scale.__array_interface__["data"][0])
            self.sstride = int(self.scale.strides[0])
            self.per_token = int(self.scale.shape[2] > 1)
        elif fmt == 4:
            if self.codes.strides[1:] != (self.codes.shape[2] * self.codes.shape[3] * 12,
                                          self.codes.shape[3] * 12, 12, 1):
                raise InvalidArgument("codebook blocks: expected contiguous 12-byte records")
            self.table = np.ascontiguousarray(self.table, np.float32)
            self.saddr = int(self.table.__array_interface__["data"][0])

    def slot_row(self, slot: int):
        """(format, slot address, scale address, per-token flag) of one slot."""
        return (self.fmt, self.addr + slot * self.stride, self.saddr + slot * self.sstride,
                self.per_token)

    def args(self):
        return (self.fmt, self.f32, self.u16, self.codes, self.scale, self.table)


_DUMMY_F32 = np.zeros((1, 1, 1, 1), np.float32)
_DUMMY_U16 = np.zeros((1, 1, 1, 1), np.uint16)
_DUMMY_COD = np.zeros((1, 1, 1, 1, 1), np.uint8)
_DUMMY_SCL = np.zeros((1, 1, 1, 1), np.float32)
_DUMMY_TAB = np.zeros(1, np.float32)


def _slot_contiguous(a: np.ndarray) -> bool:
    """True when every ``a[i]`` is C-contiguous (the leading stride may be anything)."""
    st = a.itemsize
    for n, s in zip(reversed(a.shape[1:]), reversed(a.strides[1:])):
        if n > 1 and s != st:
            return False
        st *= n
    return True


def dummy_side() -> ChunkSide:
    return ChunkSide(0)


#: Keys per softmax tile of the paged kernel (16 blocks of 16): per tile and kv head one call
#: over its blocks, one online-softmax update per query head (:func:`_softmax_tile`). Wider than
#: the contiguous kernel's :data:`~.attention.TILE` (64): the paged kernel's per-tile costs
#: (block list, rescales, calls) are paid 4x less often -- one layer of 4096 INT8 keys and 14
#: query heads, 1 thread: 204-217 us against 261 us at 64 keys (bench-only run, 2026-12-01).
PAGED_TILE = 256


def tile_width(block_size: int) -> int:
    """Keys per softmax tile of the paged kernel: :data:`PAGED_TILE`, or the block size if
    larger."""
    return max(PAGED_TILE, int(block_size))


def workspace_bytes(s: int, h: int, kvh: int, d: int, block_size: int = 16) -> int:
    """Bytes of the attention workspace of one call for ``S`` queries: per (kv head, query) task
    the running max/sum and output accumulator of the group's heads, two tiles of scores, four
    decoded block and head with its row multipliers and the tile's block list -- independent of
    the context length."""
    g = h // kvh
    w = tile_width(block_size)
    bs = int(block_size)
    per_task = 4 * (3 * g + g * d + 2 * g * (w + SLACK) + bs * d + bs) + 16 * w
    return s * kvh * per_task


@njit(**JIT)
def _paged_task(t, q, table, nblocks, past_len, scale, causal, kvh, bs, w, iq, vnni, out):
    s_n, h_n, d = q.shape
    ng = h_n // kvh
    s = t // kvh
    g = t - s * kvh
    m = np.empty(ng, np.float32)
    l = np.empty(ng, np.float32)
    mx = np.empty(ng, np.float32)
    sc = np.empty((ng, w + SLACK), np.float32)
    p = np.empty((ng, w + SLACK), np.float32)
    scr = np.empty((bs, d), np.float32)
    rmul = np.zeros(bs + SLACK, np.float32)
    pend = np.empty((w, 2), np.int64)
    qi = np.zeros((ng, d), np.int8)
    qip = np.zeros((ng, d), np.int8)
    qmul = np.zeros(ng, np.float32)
    qsum = np.zeros(ng, np.int32)
    qg = q[s, g * ng:(g + 1) * ng]
    if iq:
        _quantize_heads(qg, 0, ng, scale, qi, qip, qmul, qsum)
    o = out[s, g * ng:(g + 1) * ng]
    _state_init(m, l, o, ng)
    _paged_rows(qg, ng, table, 0, nblocks, g, bs, past_len + s, causal,
                scale, m, l, o, sc, p, mx, scr, rmul, pend, iq, qi, qip, qmul, qsum, vnni, nblocks, 1)
    _state_finish(l, o, ng, o)


_PAGED_SIG = types.void(
    types.Array(types.float32, 3, "C"),   # q [S, H, D]
    types.Array(types.int64, 2, "C"),     # table [>= n, TABLE_COLS]
    types.int64, types.int64, types.float32, types.boolean,  # n blocks, past_len, scale, causal
    types.int64, types.int64, types.int64,  # KVH, BS, tile width
    types.boolean, types.boolean,         # int8 queries, VNNI path
    types.Array(types.float32, 3, "C"),   # out [S, H, D]
)


@lazy_njit(_PAGED_SIG, **PJIT)
def _paged_par(q, table, nblocks, past_len, scale, causal, kvh, bs, w, iq, vnni, out):
    for t in prange(q.shape[0] * kvh):
        _paged_task(t, q, table, nblocks, past_len, scale, causal, kvh, bs, w, iq, vnni, out)


def table_row(kside: ChunkSide, kslot: int, vside: ChunkSide, vslot: int, start: int,
              length: int) -> tuple:
    """One block-table row (see :data:`TABLE_COLS`)."""
    return (*kside.slot_row(kslot), *vside.slot_row(vslot), int(start), int(length))


def paged_attention(q: np.ndarray, table: np.ndarray, nblocks: int, past_len: int, scale: float,
                    is_causal: bool, kv_heads: int, block_size: int, out: np.ndarray,
                    keepalive=None, int8_query: bool = False) -> np.ndarray:
    """Attention of ``S`` new queries over paged KV blocks (GQA, online softmax, fused dequant).

    Parameters
    ----------
    q : ndarray of float32, shape [S, H, D], C-contiguous
        Queries of one sequence (batch 1), RoPE applied.
    table : ndarray of int64, shape [>= nblocks, TABLE_COLS], C-contiguous
        Block table: per block the key and value side's format code (:data:`FORMAT_CODES`), the
        slot's address, its scale address and per-token-scale flag, then the absolute position
        of the block's first token and its valid tokens (rows from :func:`table_row`). The
        addresses are raw: the caller keeps the chunks alive (``keepalive``) for the call.
        Blocks may come in any order (the online softmax is order independent up to rounding).
    nblocks : int
        Rows of ``table`` read.
    past_len : int
        Tokens before the new ones; query ``s`` sits at position ``past_len + s``.
    scale : float
        Multiplies ``q . k``.
    is_causal : bool
        Query at position ``p`` attends keys at positions ``<= p``; otherwise all keys.
    kv_heads : int
        ``KVH``; ``H % KVH == 0``.
    block_size : int
        ``BS``, tokens per block slot.
    out : ndarray of float32, shape [S, H, D], C-contiguous
    int8_query : bool
        Scores of INT8/INT4 key blocks as integer dot products (``D % 64 == 0``; other blocks
        and head sizes as without it): each query head is quantized to int8 once per call
        (``d = max|q| / 127``, codes ``rint(q / d)`` clipped to [-127, 127], as the int8
        activations of the linears), the score of key ``t`` is
        ``float32(sum_i qcode_i * kcode_{t,i}) * ((d * scale) * kscale_t)`` -- the key codes and
        scales of the block format used as they are. The compiled decode step does this in
        int8-activation mode (``SessionOptions(quantize_activations=True)``).

    Returns
    -------
    ndarray
        ``out``.

    Raises
    ------
    InvalidArgument
        Shapes or dtypes that do not match, ``H`` not a multiple of ``KVH``.
    """
    if q.dtype != np.float32 or q.ndim != 3 or not q.flags.c_contiguous:
        raise InvalidArgument(f"q: expected a C-contiguous float32 [S, H, D] array, got "
                              f"{q.dtype} {list(q.shape)}")
    s, h, d = q.shape
    if kv_heads <= 0 or h % kv_heads:
        raise InvalidArgument(f"kv_heads: expected a divisor of the {h} query heads, got {kv_heads}")
    if out.shape != q.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InvalidArgument(f"out: expected float32 {list(q.shape)}, got {out.dtype} "
                              f"{list(out.shape)}")
    if (table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != TABLE_COLS
            or table.shape[0] < nblocks or not table.flags.c_contiguous):
        raise InvalidArgument(f"table: expected a C-contiguous int64 [>= {nblocks}, "
                              f"{TABLE_COLS}] array, got {table.dtype} {list(table.shape)}")
    if s:
        _paged_par(q, table, int(nblocks), int(past_len), np.float32(scale), bool(is_causal),
                   int(kv_heads), int(block_size), tile_width(block_size), bool(int8_query),
                   use_vnni(), out)
    return out


# -- sealing: conversion of one block into another format ---------------------------------------
_CONV_SIG = types.void(*_SIDE, types.int64, types.int64,          # source side, slot, tokens
                       types.int64, _COD, _SCL, _TAB, types.int64,  # dest fmt, codes, scale, table, slot
                       types.Array(types.float32, 1, "C"))          # row scratch [D]


@lazy_njit(_CONV_SIG, **JIT)
def _convert_block(sfmt, sf32, su16, scodes, sscale, stable, sslot, ntok,
                   dfmt, dcodes, dscale, dtable, dslot, row):
    """Quantize block ``sslot`` (any format) into ``dslot`` of an int8/int4/codebook2 side.

    Symmetric: int8 codes round(x / s) with s = absmax / 127; int4 s = absmax / 7 (codes in
    [-7, 7]); codebook2 s = absmax of the 32-group, index = nearest codebook entry of x / s.
    Scales per token and head when ``dscale.shape[2] > 1``, else per block and head (absmax over
    the block's valid tokens). Tokens past ``ntok`` get code 0 (and scale 0 per token).
    """
    kvh = dscale.shape[1]
    bs = dcodes.shape[2]
    d = row.shape[0]
    per_token = dscale.shape[2] > 1
    qmax = np.float32(127.0) if dfmt == 2 else np.float32(7.0)
    for g in range(kvh):
        if dfmt != 4 and not per_token:
            amax = np.float32(0.0)
            bad = np.float32(0.0)  # NaN once a NaN/inf is seen (``a > amax`` skips NaN)
            for t in range(ntok):
                _load_row(sfmt, sf32, su16, scodes, sscale, stable, sslot, g, t, row)
                for i in range(d):
                    a = abs(row[i])
                    bad += a - a
                    if a > amax:
                        amax = a
            bscale = (amax + bad) / qmax
            dscale[dslot, g, 0, 0] = bscale
        for t in range(bs):
            if t >= ntok:
                for gi in range(dcodes.shape[3]):
                    for j in range(dcodes.shape[4]):
                        dcodes[dslot, g, t, gi, j] = 0
                if per_token or dfmt == 4:
                    for gi in range(dscale.shape[3]):
                        dscale[dslot, g, t, gi] = 0.0
                continue
            _load_row(sfmt, sf32, su16, scodes, sscale, stable, sslot, g, t, row)
            if dfmt == 4:
                for grp in range(d >> 5):
                    amax = np.float32(0.0)
                    bad = np.float32(0.0)
                    for j in range(32):
                        a = abs(row[grp * 32 + j])
                        bad += a - a
                        if a > amax:
                            amax = a
                    amax += bad
                    dscale[dslot, g, t, grp] = amax
                    inv = np.float32(1.0) / amax if amax > 0 else np.float32(0.0)
                    for jb in range(8):
                        byte = 0
                        for k in range(4):
                            x = row[grp * 32 + jb * 4 + k] * inv
                            best = 0
                            bd = abs(x - dtable[0])
                            for c in range(1, 4):
                                dd = abs(x - dtable[c])
                                if dd < bd:
                                    bd = dd
                                    best = c
                            byte |= best << (2 * k)
                        dcodes[dslot, g, t, grp, jb] = byte
                continue
            if per_token:
                amax = np.float32(0.0)
                bad = np.float32(0.0)
                for i in range(d):
                    a = abs(row[i])
                    bad += a - a
                    if a > amax:
                        amax = a
                s = (amax + bad) / qmax
                dscale[dslot, g, t, 0] = s
            else:
                s = dscale[dslot, g, 0, 0]
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            if dfmt == 2:
                for i in range(d):
                    c = np.int32(np.rint(row[i] * inv))
                    c = min(max(c, -127), 127)
                    dcodes[dslot, g, t, 0, i] = np.uint8(c & 255)
            else:
                for i in range(0, d, 2):
                    c0 = min(max(np.int32(np.rint(row[i] * inv)), -7), 7)
                    c1 = min(max(np.int32(np.rint(row[i + 1] * inv)), -7), 7)
                    dcodes[dslot, g, t, 0, i >> 1] = np.uint8((c0 & 15) | ((c1 & 15) << 4))


def convert_block(src: ChunkSide, src_slot: int, ntok: int, dst: ChunkSide, dst_slot: int,
                  head_dim: int) -> None:
    """Convert one block side into a quantized format (int8, int4 or codebook2).

    Parameters
    ----------
    src : ChunkSide
        Source chunk side (any format), block ``src_slot`` with ``ntok`` valid tokens.
    dst : ChunkSide
        Destination chunk side of format int8, int4 or codebook2; slot ``dst_slot`` is written.
    head_dim : int
        ``D`` (int4 needs it even, codebook2 a multiple of 32).
    """
    if dst.fmt not in (2, 3, 4):
        raise InvalidArgument(f"dst: expected an int8/int4/codebook2 side, got format {dst.fmt}")
    row = np.empty(head_dim, np.float32)
    _convert_block(*src.args(), int(src_slot), int(ntok), dst.fmt, dst.codes, dst.scale,
                   dst.table, int(dst_slot), row)
