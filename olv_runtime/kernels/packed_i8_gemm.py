"""Register-blocked INT4 x int8 GEMM for prefill and batched decode: AVX-512 VNNI and AVX2 tiles.

The math is that of :func:`~.packed_i8_gemm.linear_packed_i8` (module docstring there): activation rows
quantized per 32-block to int8 once per call, exact int32 block sums ``S = sum q * xq``, and per
(row, block) the same float32 operations ``acc + float32(S - 8 sum xq) * (scale * d)`` (blocks in
order, no FMA), so results are bitwise equal to :mod:`.packed_i8`'s group kernels on either
instruction path (and to ``tests/reference.py::linear_int4_int8``).

Tile (the technique of register-blocked Q4 x Q8 GEMMs such as ik_llama.cpp's ``iqk`` kernels:
decode a weight tile once, reuse it for several activation rows from registers): 16 output rows
(two 8-row groups of the :class:`~.packed_i8.PackedInt4I8` layout side by side in one zmm:
lanes 0..7 group ``g``, lanes 8..15 group ``g + 1``) x :data:`TILE_ROWS` = 8 activation rows.
Per block (32 codes) the 16 x 32 codes are loaded and split into nibbles once (4 ``vinserti64x4``
pairs of 32-byte chunks, ``vpand``/``vpsrlw``: 8 zmm of unsigned codes), then per activation row
8 ``vpdpbusd zmm`` whose signed operand is the row's 4 int8 activations broadcast from memory
(``{1to16}``): 8 independent int32 chains, one per activation row, cover the instruction's
latency. The float epilogue per (activation row, block) is ``vpsubd``, ``vcvtdq2ps``, 2
``vmulps``, ``vaddps`` on 16 lanes. Accumulators: 8 float32 zmm (one per activation row), live
across the block loop.

Loop nest per task (a contiguous range of group pairs): activation rows in chunks of
:data:`CHUNK_BYTES` of int8 codes (kept in L2), then group pairs, then 8-row tiles, then blocks,
all in one call (:func:`_pairs_tiles`). Rows left over (``M % 8``, or all of them below 8: the
engine's rows step at 2..7 sequences; one row runs the one-group kernels, one group after the
other, as the one-token step does) run one 16 x 4, 16 x 2 and 16 x 1 tile each as needed
(each row's 8 ``vpdpbusd`` as two chains of 4 there, for enough independent chains); an odd last
group runs the kernels of :mod:`.packed_i8`. The first tile of each pair issues the group
kernels' software prefetches for both groups' streams (the weights come from DRAM in a decode
step): without them the 151936 x 896 lm_head ran 0.57x (M = 1) .. 0.84x (M = 4) the group
kernels' speed, with them 1.35x .. 1.7x (bench/bench_vnni_tiles.py, one thread).

AVX2 tile (CPUs without AVX-512 VNNI, or ``OLV_ISA=avx2``; :func:`_tile2_block`): the same two
groups as two ymm of 8 lanes x :data:`AVX2_TILE_ROWS` = 4 activation rows, per 4-code chunk the
two groups' nibbles split once and each activation row's broadcast 4 bytes used for both groups
(``vpmaddubsw`` pair sums added in int16 over the block, one ``vpmaddwd`` per (row, group,
block)): half the broadcasts per multiply of :mod:`.packed_i8`'s one-group kernels, which kept the
shuffle ports busy (llvm-mca, znver3: 63 cycles per 2048 multiply-adds against ``group_r4``'s 39
per 1024). Same integers, same float operations per output: bitwise equal to the group kernels.

Entry points: :func:`linear_packed_i8` (from :func:`min_rows` activation rows: 8 with VNNI, 4 on
AVX2) and :func:`groups_tiles` (a range of groups with the activations already quantized: the
engine's compiled rows step). The drivers are compiled at their first call (prefill, a batched
step), never by the one-token decode step.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .config import JIT, PJIT
from .packed import prepare_call
from .packed_i8 import (
    BLOCK,
    GROUP_BLOCK_BYTES,
    GROUP_ROWS,
    HOST_VNNI,
    SERIAL_MAX_WORK,
    PackedI8Workspace,
    V8F32,
    PackedInt4I8,
    Vec,
    check_array_arg,
    elem_ptr,
    fast_call_rows,
    fstore,
    group_r1,
    group_r2,
    group_r4,
    is_scale_array,
    load_scales8,
    linear_par,
    linear_ser,
    make_workspace_i8,
    num_threads,
    prefetch_block,
    quantize_rows_i8,
    splat,
    store_group,
    use_vnni,
)

__all__ = ["TILE_ROWS", "AVX2_TILE_ROWS", "MIN_ROWS", "gemm_i8", "groups_tiles", "min_rows",
           "linear_packed_i8"]

TILE_ROWS = 8          # activation rows per tile (one zmm float accumulator each)
AVX2_TILE_ROWS = 4     # activation rows per AVX2 tile (two ymm float accumulators each)
MIN_ROWS = 8           # callers use this GEMM from this many activation rows
CHUNK_BYTES = 1 << 18  # int8 activation bytes per row chunk (kept in L2 while pairs stream)
PAIR_STREAM_BYTES = 8192  # VNNI, M < 4: pairs as tiles only while a group has <= this many codes bytes

V16F32 = Vec(32, 16, True)

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_LV32I8 = ir.VectorType(_I8, 32)
_LV64I8 = ir.VectorType(_I8, 64)
_LV32I16 = ir.VectorType(_I16, 32)
_LV16I32 = ir.VectorType(_I32, 16)
_LV16F32 = ir.VectorType(_F32, 16)
_LV8F32 = ir.VectorType(_F32, 8)
_LV8I16 = ir.VectorType(_I16, 8)
_LV16I16 = ir.VectorType(_I16, 16)
_LV8I32 = ir.VectorType(_I32, 8)
_LV8F16 = ir.VectorType(ir.HalfType(), 8)

TILE_SHAPES = (8, 4, 2, 1)  # activation rows of the VNNI tiles (16 output rows each)
_TILE2 = types.UniTuple(V8F32, 2 * AVX2_TILE_ROWS)


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n),
                                                    list(range(2 * n))))


def _scales16(context, builder, aty, arr, off0, off1):
    """16 float32 lanes: 8 scales at linear element ``off0`` then 8 at ``off1`` (float32, or
    float16 bits widened exactly)."""
    if aty.dtype == types.uint16:
        h = [builder.bitcast(builder.load(elem_ptr(context, builder, aty, arr, o, _LV8I16),
                                          align=2), _LV8F16) for o in (off0, off1)]
        return builder.fpext(_concat(builder, h[0], h[1]), _LV16F32)
    v = [builder.load(elem_ptr(context, builder, aty, arr, o, _LV8F32), align=4)
         for o in (off0, off1)]
    return _concat(builder, v[0], v[1])


def _tile_type(acc):
    """The row count R of a tile accumulator type ``UniTuple(V16F32, R)`` (R in
    :data:`TILE_SHAPES`), else 0."""
    if isinstance(acc, types.UniTuple) and acc.dtype == V16F32 and acc.count in TILE_SHAPES:
        return acc.count
    return 0


@intrinsic
def _tile_zero(typingctx, nrows):
    """Zero accumulators of a 16 x ``nrows`` tile (``nrows`` a literal in :data:`TILE_SHAPES`)."""
    if not (isinstance(nrows, types.IntegerLiteral) and nrows.literal_value in TILE_SHAPES):
        return None
    r = nrows.literal_value
    ty = types.UniTuple(V16F32, r)

    def codegen(context, builder, sig, args):
        z = ir.Constant(_LV16F32, [0.0] * 16)
        return context.make_tuple(builder, sig.return_type, [z] * r)
    return ty(nrows), codegen


@intrinsic
def _tile_block(typingctx, acc, codes, cb, gstride, scale, so, sstride, xq, xo, kx, xd, xs8,
                do, kbx):
    """One block of a 16 x R tile (R = len(acc), 8, 4, 2 or 1): ``acc[r] += float32(S_r -
    xs8) * (scale16 * xd)`` for activation rows r < R (xq bytes ``xo + r * kx``, xd / xs8
    elements ``do + r * kbx``) against the group pair whose codes start at byte ``cb`` (second
    group ``gstride`` bytes later) and scales at element ``so`` (second group ``sstride``
    later). Below 8 rows each row's 8 ``vpdpbusd`` run as two chains of 4 (chunks 0, 2 and 1,
    3; summed in int32: the same integers) so that >= 8 chains cover the latency."""
    nr = _tile_type(acc)
    if not (nr and check_array_arg(codes, types.uint8) and is_scale_array(scale)
            and check_array_arg(xq, types.int8) and check_array_arg(xd, types.float32)
            and check_array_arg(xs8, types.int32)):
        return None
    sig = acc(acc, codes, types.intp, types.intp, scale, types.intp, types.intp, xq,
              types.intp, types.intp, xd, xs8, types.intp, types.intp)
    nchain = 1 if nr >= 8 else 2

    def codegen(context, builder, sig, args):
        (acc_v, codes_v, cb_v, gs_v, sc_v, so_v, ss_v, xq_v, xo_v, kx_v, xd_v, xs_v, do_v,
         kbx_v) = args
        aty = sig.args
        accs = [builder.extract_value(acc_v, r) for r in range(nr)]
        if not HOST_VNNI:  # never called (the wrappers check use_vnni()); nothing to emit
            return context.make_tuple(builder, sig.return_type, accs)
        m0f = ir.Constant(_LV64I8, [0x0F] * 64)
        sh4 = ir.Constant(_LV32I16, [4] * 32)
        us = []  # us[2c + h]: chunk c, nibble h (0 low: k = 4c + j, 1 high: k = 16 + 4c + j)
        for c in range(4):
            o0 = builder.add(cb_v, ir.Constant(cb_v.type, 32 * c))
            o1 = builder.add(o0, gs_v)
            a = builder.load(elem_ptr(context, builder, aty[1], codes_v, o0, _LV32I8), align=1)
            b = builder.load(elem_ptr(context, builder, aty[1], codes_v, o1, _LV32I8), align=1)
            v = _concat(builder, a, b)
            us.append(builder.and_(v, m0f))
            vh = builder.bitcast(builder.lshr(builder.bitcast(v, _LV32I16), sh4), _LV64I8)
            us.append(builder.and_(vh, m0f))
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV16I32, [_LV16I32, _LV64I8, _LV64I8]),
            "llvm.x86.avx512.vpdpbusd.512")
        ws = _scales16(context, builder, aty[4], sc_v, so_v, builder.add(so_v, ss_v))
        out = []
        for r in range(nr):
            xr = builder.add(xo_v, builder.mul(kx_v, ir.Constant(kx_v.type, r)))
            s = [ir.Constant(_LV16I32, [0] * 16)] * nchain
            for c in range(4):
                for h in range(2):
                    off = builder.add(xr, ir.Constant(xr.type, 16 * h + 4 * c))
                    p = elem_ptr(context, builder, aty[7], xq_v, off, _I32)
                    xb = builder.bitcast(splat(builder, builder.load(p, align=1), _LV16I32),
                                         _LV64I8)
                    j = c % nchain
                    s[j] = builder.call(dp, [s[j], us[2 * c + h], xb])
            s = s[0] if nchain == 1 else builder.add(s[0], s[1])
            dr = builder.add(do_v, builder.mul(kbx_v, ir.Constant(kbx_v.type, r)))
            s8 = builder.load(elem_ptr(context, builder, aty[11], xs_v, dr, _I32))
            d = builder.load(elem_ptr(context, builder, aty[10], xd_v, dr, _F32))
            f = builder.sitofp(builder.sub(s, splat(builder, s8, _LV16I32)), _LV16F32)
            v = builder.fmul(ws, splat(builder, d, _LV16F32))
            out.append(builder.fadd(accs[r], builder.fmul(f, v)))
        return context.make_tuple(builder, sig.return_type, out)
    return sig, codegen


@intrinsic
def _tile2_block(typingctx, acc, codes, cb, gstride, scale, so, sstride, xq, xo, kx, xd, xs8,
                 do, kbx):
    """AVX2 tile, one block: 16 output rows (groups g, g + 1 as two ymm of 8 lanes) x
    :data:`AVX2_TILE_ROWS` activation rows; ``acc[2r + j]`` (group ``g + j``, activation row
    ``r``) ``+= float32(S - xs8) * (scale8 * xd)``, the float operations of
    :func:`~.packed_i8._block_acc32` in its order. Per 4-code chunk the two groups' nibbles
    are split once and each activation row's broadcast 4 bytes serve both groups (one
    ``vpbroadcastd`` per two ``vpmaddubsw``, half of the one-group kernels' broadcasts); the
    ``vpmaddubsw`` pair sums (<= 2 x 15 x 127) are added in int16 over the block's 8 chunks
    (<= 30480, no saturation) and widened once by ``vpmaddwd``: the exact integer sums of
    :func:`~.packed_i8.dot_r4`. Arguments as :func:`_tile_block`."""
    if not (acc == _TILE2 and check_array_arg(codes, types.uint8) and is_scale_array(scale)
            and check_array_arg(xq, types.int8) and check_array_arg(xd, types.float32)
            and check_array_arg(xs8, types.int32)):
        return None
    sig = _TILE2(_TILE2, codes, types.intp, types.intp, scale, types.intp, types.intp, xq,
                 types.intp, types.intp, xd, xs8, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        (acc_v, codes_v, cb_v, gs_v, sc_v, so_v, ss_v, xq_v, xo_v, kx_v, xd_v, xs_v, do_v,
         kbx_v) = args
        aty = sig.args
        mub = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV16I16, [_LV32I8, _LV32I8]),
            "llvm.x86.avx2.pmadd.ub.sw")
        mwd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV8I32, [_LV16I16, _LV16I16]),
            "llvm.x86.avx2.pmadd.wd")
        m0f = ir.Constant(_LV32I8, [0x0F] * 32)
        sh4 = ir.Constant(_LV16I16, [4] * 16)
        xr = [builder.add(xo_v, builder.mul(kx_v, ir.Constant(kx_v.type, r)))
              for r in range(AVX2_TILE_ROWS)]
        s16 = [[None, None] for _ in range(AVX2_TILE_ROWS)]
        for c in range(4):
            us = []
            for j in range(2):
                o = builder.add(cb_v, ir.Constant(cb_v.type, 32 * c))
                if j:
                    o = builder.add(o, gs_v)
                v = builder.load(elem_ptr(context, builder, aty[1], codes_v, o, _LV32I8),
                                 align=1)
                vh = builder.bitcast(builder.lshr(builder.bitcast(v, _LV16I16), sh4), _LV32I8)
                us.append((builder.and_(v, m0f), builder.and_(vh, m0f)))
            for r in range(AVX2_TILE_ROWS):
                xb = []
                for h in range(2):
                    off = builder.add(xr[r], ir.Constant(xr[r].type, 16 * h + 4 * c))
                    p = elem_ptr(context, builder, aty[7], xq_v, off, _I32)
                    xb.append(builder.bitcast(splat(builder, builder.load(p, align=1), _LV8I32),
                                              _LV32I8))
                for j in range(2):
                    t = builder.add(builder.call(mub, [us[j][0], xb[0]]),
                                    builder.call(mub, [us[j][1], xb[1]]))
                    s16[r][j] = t if s16[r][j] is None else builder.add(s16[r][j], t)
        ones = ir.Constant(_LV16I16, [1] * 16)
        ws = [load_scales8(context, builder, aty[4], sc_v, so_v),
              load_scales8(context, builder, aty[4], sc_v, builder.add(so_v, ss_v))]
        out = []
        for r in range(AVX2_TILE_ROWS):
            dr = builder.add(do_v, builder.mul(kbx_v, ir.Constant(kbx_v.type, r)))
            s8 = builder.load(elem_ptr(context, builder, aty[11], xs_v, dr, _I32))
            d = splat(builder, builder.load(elem_ptr(context, builder, aty[10], xd_v, dr, _F32)),
                      _LV8F32)
            for j in range(2):
                i32 = builder.sub(builder.call(mwd, [s16[r][j], ones]),
                                  splat(builder, s8, _LV8I32))
                f = builder.sitofp(i32, _LV8F32)
                v = builder.fmul(ws[j], d)
                out.append(builder.fadd(builder.extract_value(acc_v, 2 * r + j),
                                        builder.fmul(f, v)))
        return context.make_tuple(builder, sig.return_type, out)
    return sig, codegen


@intrinsic
def _tile2_zero(typingctx):
    def codegen(context, builder, sig, args):
        z = ir.Constant(_LV8F32, [0.0] * 8)
        return context.make_tuple(builder, sig.return_type, [z] * (2 * AVX2_TILE_ROWS))
    return _TILE2(), codegen


@intrinsic
def _tile_store(typingctx, out, off, ld, nvalid, acc):
    """Store row r of the tile (16 lanes, the first ``nvalid`` kept: a masked store) at linear
    element ``off + r * ld`` of ``out`` (float32)."""
    nr = _tile_type(acc)
    if not (check_array_arg(out, types.float32) and nr):
        return None
    sig = types.none(out, types.intp, types.intp, types.intp, acc)

    def codegen(context, builder, sig, args):
        out_v, off_v, ld_v, nv_v, acc_v = args
        lanes = ir.Constant(ir.VectorType(off_v.type, 16), list(range(16)))
        mask = builder.icmp_signed("<", lanes, splat(builder, nv_v,
                                                     ir.VectorType(off_v.type, 16)))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_LV16F32, _LV16F32.as_pointer(),
                                                            _I32, ir.VectorType(ir.IntType(1), 16)]),
            "llvm.masked.store.v16f32.p0")
        for r in range(nr):
            o = builder.add(off_v, builder.mul(ld_v, ir.Constant(ld_v.type, r)))
            p = elem_ptr(context, builder, sig.args[0], out_v, o, _LV16F32)
            builder.call(fn, [builder.extract_value(acc_v, r), p, ir.Constant(_I32, 4), mask])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _tile_fstore(typingctx, out, off, ld, acc):
    """Store row r of the tile (all 16 lanes, one plain vector store) at linear element
    ``off + r * ld`` of ``out`` (float32)."""
    nr = _tile_type(acc)
    if not (check_array_arg(out, types.float32) and nr):
        return None
    sig = types.none(out, types.intp, types.intp, acc)

    def codegen(context, builder, sig, args):
        out_v, off_v, ld_v, acc_v = args
        for r in range(nr):
            o = builder.add(off_v, builder.mul(ld_v, ir.Constant(ld_v.type, r)))
            p = elem_ptr(context, builder, sig.args[0], out_v, o, _LV16F32)
            builder.store(builder.extract_value(acc_v, r), p, align=4)
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always", **JIT)
def _pair_rows(codes, scale, g, xq, xd, xs8, i, n, out, nrows, pf):
    """Output rows 8g .. 8g+15 (groups g, g+1 exist) of activation rows i .. i+nrows-1 with one
    16 x ``nrows`` tile (``nrows`` a literal of :data:`TILE_SHAPES`); inlined into
    :func:`_pairs_tiles` once per tile shape. ``pf``: software-prefetch both groups' streams
    ahead (:func:`~.packed_i8.prefetch_block`; the pair's first tile, which reads it from
    DRAM)."""
    kb = codes.shape[1]
    kx = xq.shape[1]
    kbx = xd.shape[1]
    gstride = kb * GROUP_BLOCK_BYTES
    sstride = kb * GROUP_ROWS
    base = g * kb
    acc = _tile_zero(nrows)
    xo = i * kx
    do = i * kbx
    for b in range(kb):
        if pf:
            prefetch_block(codes, scale, base, b)
            prefetch_block(codes, scale, base + kb, b)
        acc = _tile_block(acc, codes, (base + b) * GROUP_BLOCK_BYTES, gstride, scale,
                          (base + b) * GROUP_ROWS, sstride, xq, xo + b * BLOCK, kx, xd, xs8,
                          do + b, kbx)
    r0 = g * GROUP_ROWS
    if r0 + 2 * GROUP_ROWS <= n:
        _tile_fstore(out, i * n + r0, n, acc)
    else:
        _tile_store(out, i * n + r0, n, n - r0, acc)


@njit(**JIT)
def _pairs_tiles(codes, scale, g0, g1, xq, xd, xs8, i0, i1, n, out):
    """VNNI: group pairs ``(g0, g0 + 1), (g0 + 2, g0 + 3), ...`` below ``g1`` (``g1 - g0``
    even) of activation rows i0 .. i1-1: per pair tiles of :data:`TILE_ROWS` rows, then the
    rest (``(i1 - i0) % 8``) by one 4-, one 2- and one 1-row tile as needed. One call for all
    the pairs and rows (a numba call passing these arrays costs a few hundred cycles, ~5 % of
    a 16 x 8 tile at K = 896); full pairs stored by plain vector stores, a partial last pair by
    masked ones."""
    for g in range(g0, g1, 2):
        i = i0
        while i1 - i >= TILE_ROWS:
            _pair_rows(codes, scale, g, xq, xd, xs8, i, n, out, 8, i == i0)
            i += TILE_ROWS
        if i1 - i >= 4:
            _pair_rows(codes, scale, g, xq, xd, xs8, i, n, out, 4, i == i0)
            i += 4
        if i1 - i >= 2:
            _pair_rows(codes, scale, g, xq, xd, xs8, i, n, out, 2, i == i0)
            i += 2
        if i1 - i >= 1:
            _pair_rows(codes, scale, g, xq, xd, xs8, i, n, out, 1, i == i0)


@njit(**JIT)
def _pair_tiles2(codes, scale, g, xq, xd, xs8, i0, i1, n, out, facc):
    """AVX2: output rows 8g .. 8g+15 (groups g, g+1 exist) of activation rows i0 .. i1-1 in
    tiles of :data:`AVX2_TILE_ROWS` (``i1 - i0`` a multiple of it). One call per group pair and
    row range: the per-call work (argument passing, array reference counts) is paid once per
    pair, not per tile -- it cost ~900 cycles per tile, a quarter of the time at K = 896."""
    kb = codes.shape[1]
    kx = xq.shape[1]
    kbx = xd.shape[1]
    gstride = kb * GROUP_BLOCK_BYTES
    sstride = kb * GROUP_ROWS
    base = g * kb
    r0 = g * GROUP_ROWS
    full = r0 + 2 * GROUP_ROWS <= n
    for it in range((i1 - i0) // AVX2_TILE_ROWS):
        i = i0 + it * AVX2_TILE_ROWS
        acc = _tile2_zero()
        xo = i * kx
        do = i * kbx
        for b in range(kb):
            acc = _tile2_block(acc, codes, (base + b) * GROUP_BLOCK_BYTES, gstride, scale,
                               (base + b) * GROUP_ROWS, sstride, xq, xo + b * BLOCK, kx, xd,
                               xs8, do + b, kbx)
        if full:
            for r in range(AVX2_TILE_ROWS):
                fstore(out, (i + r) * n + r0, acc[2 * r])
                fstore(out, (i + r) * n + r0 + GROUP_ROWS, acc[2 * r + 1])
        else:
            for r in range(AVX2_TILE_ROWS):
                store_group(acc[2 * r], facc, g, i + r, n, out)
                store_group(acc[2 * r + 1], facc, g + 1, i + r, n, out)


@njit(inline="always", **JIT)
def tile_rows(vnni):
    """Activation rows per tile: 8 (VNNI, zmm) or 4 (AVX2, ymm pairs)."""
    return TILE_ROWS if vnni else AVX2_TILE_ROWS


@njit(**JIT)
def groups_tiles(codes, scale, g0, g1, xq, xd, xs8, m, n, out, facc, vnni):
    """Groups g0..g1-1 of ``out[:m]`` (activations already quantized): group pairs
    ``(g0, g0 + 1), (g0 + 2, g0 + 3), ...`` in tiles of :func:`tile_rows` activation rows (VNNI:
    the rows left over by 16 x 4 / 2 / 1 tiles; AVX2: by the one-group kernels of
    :mod:`.packed_i8`), an odd last group by the one-group kernels; one row (and, VNNI, 2-3 rows
    of long groups) by the one-group kernels, one group after the other -- bitwise
    :func:`~.packed_i8.groups` (the same integers and float operations per output)."""
    tr = tile_rows(vnni)
    mt = m // tr * tr
    long_groups = codes.shape[1] * GROUP_BLOCK_BYTES > PAIR_STREAM_BYTES
    if vnni and (m == 1 or (m < 4 and long_groups)):
        # one row, or 1..3 rows of long groups: one group after the other (one sequential DRAM
        # stream; the pair's two streams ran 0.8x from DRAM at 896 x 4864, M = 1, 2; for one
        # row the 16 x 1 tile ran gate/up and the lm_head ~10 % slower than the one-token
        # step's group kernels in the engine's 2-task step, bench/rows_phases.py --batch 1
        # against bench/stack_phases.py)
        for g in range(g0, g1):
            _rows_tail(codes, scale, g, xq, xd, xs8, np.int64(0), m, n, out, facc, vnni)
        return
    if vnni:
        ge = g1 - (g1 - g0) % 2
        _pairs_tiles(codes, scale, g0, ge, xq, xd, xs8, np.int64(0), m, n, out)
        if ge < g1:
            _rows_tail(codes, scale, ge, xq, xd, xs8, np.int64(0), m, n, out, facc, vnni)
        return
    g = g0
    while g + 1 < g1:
        _pair_tiles2(codes, scale, g, xq, xd, xs8, np.int64(0), mt, n, out, facc)
        if mt < m:
            _rows_tail(codes, scale, g, xq, xd, xs8, mt, m, n, out, facc, vnni)
            _rows_tail(codes, scale, g + 1, xq, xd, xs8, mt, m, n, out, facc, vnni)
        g += 2
    if g < g1:
        _rows_tail(codes, scale, g, xq, xd, xs8, np.int64(0), m, n, out, facc, vnni)


@njit(**JIT)
def _rows_tail(codes, scale, g, xq, xd, xs8, i0, m, n, out, facc, vnni):
    """Group g for activation rows i0 .. m-1 with the :mod:`.packed_i8` kernels (4, 2, 1)."""
    while m - i0 >= 4:
        group_r4(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni)
        i0 += 4
    if m - i0 >= 2:
        group_r2(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni)
        i0 += 2
    if m - i0 >= 1:
        group_r1(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni)


@njit(**JIT)
def _task(codes, scale, p0, p1, xq, xd, xs8, m, n, out, facc, last_group, vnni):
    """Group pairs p0..p1-1 (groups 2p, 2p+1) for all m activation rows; ``last_group``: also
    the unpaired last group (odd group count)."""
    kx = xq.shape[1]
    tr = tile_rows(vnni)
    rows_chunk = max(tr, (CHUNK_BYTES // max(kx, 1)) // tr * tr)
    m8 = m // tr * tr
    if vnni:  # the rows left over by the 4 / 2 / 1-row tiles of the last chunk
        m8 = m
    c0 = np.int64(0)
    while c0 < m8:
        c1 = min(m8, c0 + rows_chunk)
        if vnni:
            _pairs_tiles(codes, scale, 2 * p0, 2 * p1, xq, xd, xs8, c0, c1, n, out)
        else:
            for p in range(p0, p1):
                _pair_tiles2(codes, scale, 2 * p, xq, xd, xs8, c0, c1, n, out, facc)
        c0 = c1
    if m8 < m:
        for p in range(p0, p1):
            _rows_tail(codes, scale, 2 * p, xq, xd, xs8, m8, m, n, out, facc, vnni)
            _rows_tail(codes, scale, 2 * p + 1, xq, xd, xs8, m8, m, n, out, facc, vnni)
    if last_group >= 0:
        _rows_tail(codes, scale, last_group, xq, xd, xs8, np.int64(0), m, n, out, facc, vnni)


@njit(**PJIT)
def _gemm_par(x, m, k, codes, scale, n, out, ntasks, xq, xd, xs8, facc, vnni):
    kb = codes.shape[1]
    # activation quantization once per call, rows split over the tasks
    for t in prange(ntasks):
        r0 = t * m // ntasks
        r1 = (t + 1) * m // ntasks
        if r1 > r0:
            quantize_rows_i8(x[r0:r1], r1 - r0, k, kb, xq[r0:r1], xd[r0:r1], xs8[r0:r1])
    ng = codes.shape[0]
    npair = ng // 2
    odd = ng - 2 * npair
    for t in prange(ntasks):
        p0 = t * npair // ntasks
        p1 = (t + 1) * npair // ntasks
        lg = np.int64(-1)
        if odd == 1 and t == ntasks - 1:
            lg = np.int64(ng - 1)
        _task(codes, scale, p0, p1, xq, xd, xs8, m, n, out, facc[t], lg, vnni)


def gemm_i8(x, m, k, packed, out, ws, ntasks, vnni):
    """Run the tile GEMM (arguments already checked by :func:`linear_packed_i8`, which calls
    this from :func:`min_rows` activation rows on): 8-row zmm tiles with ``vnni`` (the host
    must have AVX-512 VNNI), else 4-row AVX2 tiles."""
    assert HOST_VNNI or not vnni
    _gemm_par(x, m, k, packed.codes, packed.scale, packed.n, out, ntasks, ws.xq, ws.xd,
              ws.xs8, ws.facc, vnni)
    return out


def min_rows(vnni: bool) -> int:
    """Activation rows from which :func:`linear_packed_i8` runs the tile GEMM: :data:`MIN_ROWS`
    on the VNNI path, :data:`AVX2_TILE_ROWS` on AVX2."""
    return MIN_ROWS if vnni else AVX2_TILE_ROWS


def linear_packed_i8(x: np.ndarray, packed: PackedInt4I8, out: np.ndarray | None = None,
                     workspace: PackedI8Workspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` with int8-quantized activations for a weight from :func:`prepack_int4_i8`.

    Bitwise the arithmetic of the :mod:`.packed_i8` module docstring (per-32-block int8
    activations, exact integer block sums, the same float operations per block in order) on
    every path: serial or parallel, 1/2/4-row group kernels or the VNNI tile GEMM, either ISA.

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous (any M). From :func:`min_rows` rows on
        (prefill) runs the register-blocked tile GEMM of this module (same bits).
    packed : PackedInt4I8
    out : ndarray of float32, shape [M, N], C-contiguous, optional
    workspace : PackedI8Workspace, optional
        From :func:`make_workspace_i8` with ``m_max >= M`` and ``k_max >= K``. With ``out`` and
        ``workspace`` given the call allocates no array data. One workspace per concurrent call.
    """
    ws = workspace
    m = fast_call_rows(x, packed, out, ws, PackedInt4I8, PackedI8Workspace)
    if m < 0:
        m, out, ws = prepare_call(x, packed, PackedInt4I8, out, workspace, PackedI8Workspace,
                                  make_workspace_i8)
        if m == 0:
            return out
    k, n, kp = packed.k, packed.n, packed.k_padded
    vnni = use_vnni()
    if m >= min_rows(vnni) and m * n * kp >= SERIAL_MAX_WORK:
        # prefill: the register-blocked tile GEMM (same bits; compiled at its first use)
        ntasks = min(ws.n_tasks, num_threads(), packed.n_groups // 2)
        return gemm_i8(x, m, k, packed, out, ws, max(1, ntasks), vnni)
    ntasks = min(ws.n_tasks, num_threads())
    if m * n * kp < SERIAL_MAX_WORK or ntasks == 1 or packed.n_groups == 1:
        linear_ser(x, m, k, packed.codes, packed.scale, n, out, ws.xq, ws.xd, ws.xs8,
                   ws.facc[0], vnni)
    else:  # the driver takes min(ntasks, groups) tasks
        linear_par(x, m, k, packed.codes, packed.scale, n, out, ntasks, ws.xq, ws.xd,
                   ws.xs8, ws.facc, vnni)
    return out
