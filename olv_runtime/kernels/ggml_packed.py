"""GEMV/GEMM kernels that read ggml blocks (Q8_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K) at their own
bits per weight.

A GGUF weight of one of these types is repacked once, at session creation, from the file's
blocks (``[N, K / block_size, type_size]`` bytes) into *group records* (:class:`GGMLPacked`):
``G = 8`` consecutive output rows form a group (the 8 int32 / float32 lanes of a ymm), and every
group is a sequence of records along K, one per ggml block of the 8 rows. A record holds exactly
the bytes of the 8 rows' blocks, rearranged so that one 32-byte load gives 8 rows x 4
consecutive codes (lane ``r`` = row ``r``) -- the same bits per weight as the file (Q8_0 8.5,
Q5_0 5.5, Q4_1 5, Q5_1 6, Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625), never a float copy.

Codes are written unsigned, ``u`` (Q8_0: ``u = q + 128``, i.e. ``q ^ 0x80``); for every 32-element block
``b`` of a record the 8 *chunk vectors* ``U_t`` (``t = 0..7``) have byte ``4r + j`` = code of row
``r`` at ``k = 32b + 4t + j``. Record layouts (byte offsets; ``f16[8]`` = one float16 per row):

======  =====  ==========================================================================
type    bytes  record (8 rows x one ggml block)
======  =====  ==========================================================================
Q8_0    272    ``d f16[8]`` | 8 chunks x 32 B: byte ``32t + 4r + j`` = ``q[r, 4t+j] ^ 0x80``
Q5_0    176    ``d f16[8]`` | ``H`` 32 B: byte ``4r + j`` bit ``s`` = ``h[r, 4s + j]`` |
               nibbles 4 x 32 B: byte ``32c + 4r + j`` = ``lo[r, 4c+j] | lo[r, 16+4c+j] << 4``
Q4_1    160    ``d f16[8]`` | ``m f16[8]`` | nibbles 128 B (as Q5_0's, codes ``q``)
Q5_1    192    ``d f16[8]`` | ``m f16[8]`` | ``H`` 32 B | nibbles 128 B (both as Q5_0's)
Q4_K    1152   ``d f16[8]`` | ``dmin f16[8]`` | packed 6-bit scales 12 x 8 B (byte ``8j + r`` =
               ``scales[r, j]``) | 8 sub-blocks x nibbles 128 B (as Q5_0's, codes ``q``)
Q5_K    1408   as Q4_K's first 128 B | 8 sub-blocks x (nibbles 128 B | ``H`` 32 B, both as
               Q5_0's; sub-block ``b``'s high bit of ``k`` is bit ``b`` of the file's ``qh[k]``)
Q6_K    1680   ``d f16[8]`` | ``scales int8`` 16 x 8 B (byte ``8j + r``) | 8 sub-blocks x
               (nibbles 128 B (low 4 bits) | 64 B: vector ``v``, byte ``32v + 4r + j`` bits
               ``2p, 2p+1`` = high 2 bits of ``k = 4(4v + p) + j``): one sequential stream
======  =====  ==========================================================================

Weights (gguf-py ``dequantize_blocks``): Q8_0 ``d q``; Q5_0 ``d (u - 16)``, ``u = lo | h << 4``;
Q4_1 ``(d q) + m``; Q5_1 ``(d u) + m``; Q4_K ``(d sc_b) q - (dmin m_b)`` per 32-sub-block ``b``
(6-bit ``sc_b``, ``m_b``), Q5_K the same with ``u`` (5 bits); Q6_K ``(d sc_h) (u - 32)`` per 16
weights ``h``. The codes of Q4_1 / Q5_1 / Q4_K / Q5_K are unsigned as stored (offset 0).

int8 activations (:func:`linear_ggml_i8`) -- the quantization of :mod:`.packed_i8` (every
32-block of ``x`` to int8, ``d_x = max|x| / 127``), then per (row group, 32-block) the exact int32
sums ``S = sum_t dot4(U_t, X_t)`` with two instruction paths chosen at run time by
:func:`~.packed_i8.isa` (the same switch as the INT4 kernels; ``OLV_ISA=avx2`` /
:func:`~.packed_i8.set_isa` force the fallback): ``avx512vnni`` -- ``vpdpbusd`` (u8 x s8 -> s32);
``avx2`` -- ``vpmaddubsw`` + ``vpmaddwd`` per chunk (pair sums <= 2 x 63 x 127, never saturate).
Q8_0: VNNI takes ``u = q + 128`` and starts from ``-128 sum(xq)``; AVX2 uses the sign trick on
``q`` (``|q|`` x ``sign(x, q)``, ``|pair| <= 2 x 128 x 127``).
Both paths give the same integers, so the results are bitwise equal. Float lanes per block:

* Q8_0: ``acc += float(S) * (d * d_x)``; Q5_0: ``acc += float(S - 16 sum(xq)) * (d * d_x)``;
* Q4_1, Q5_1 (as llama.cpp's ``vec_dot`` with Q8_1 activations, the per-32 ``sum xq`` exact):
  ``acc += float(S) * (d * d_x) + m * (d_x * float(sum xq))`` (the two products, then their sum,
  then the add to ``acc``);
* Q4_K, Q5_K: ``acc += ((d sc_b) float(S) - (dmin m_b) float(sum xq)) * d_x``;
* Q6_K: ``acc += float(sc_0 (S_0 - 32 s_0) + sc_1 (S_1 - 32 s_1)) * (d * d_x)`` (halves of 16).

Exact mode (:func:`linear_ggml_exact`, float32 activations): the codes are decoded exactly
(integer ``u - offset`` converted to float32) and multiplied with the activations in 4 FMA
chains per block (``s``: the 4 chains of each half added ``(c0 + c1) + (c2 + c3)``, then the
halves), combined per block with the scales: Q8_0 / Q5_0 ``acc = fma(s, d, acc)``; Q4_1 / Q5_1
``acc += (d s) + (m sum(x))``; Q4_K / Q5_K ``acc += (d sc_b) s - (dmin m_b) sum(x)``
(``sum(x)`` the per-32 float32 sum of ``x`` in order from 0.0); Q6_K ``acc = fma(s_h, d sc_h,
acc)`` per half. Tolerance against a float64 product with the dequantized weight (``gguf.quants``):
``|y - y_ref| <= 1e-5 * sum_k |x_k| (|W_nk| + |min|) + 1e-6`` (``|min|`` = ``|dmin m_b|`` or
``|m|`` of the weight's block; tests/kernels/test_ggml_packed.py).

Prefill (M >= :data:`~.ggml_gemm.ROWS` in int8 mode, :data:`~.ggml_gemm.ROWS_F32` in exact
mode): :mod:`.ggml_gemm` decodes each record once for that many activation rows held in
registers (bitwise the one-row results), rows in L2-sized blocks; rows left over run the one-row
kernels. Exact mode for the kinds of :func:`~.ggml_gemm.use_fpanel`: records decoded once per
row block into a float32 panel read by tiles of rows of two groups (:func:`~.ggml_gemm.panel_f32`,
also bitwise the one-row results); on an AVX-512 host every kind, two groups per 16-lane vector
(:func:`~.ggml_zpanel.panel_f32z`). The LLVM-IR building blocks of both are in :mod:`.ggml_ir`.

Memory: each task streams one contiguous range of groups; ``prefetcht0`` :data:`PF_BYTES` ahead.
Bytes read per call: ``packed.nbytes`` (= the GGUF tensor's bytes, rows padded to 8).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from olv_runtime.errors import InvalidArgument

from .config import JIT, PJIT, check_array, check_int
from .ggml_gemm import (ROWS_P, block_rows, chunks_f32, chunks_i8, panel_f32, panel_floats,
                        use_fpanel)
from .ggml_zpanel import ROWS_Z, panel_f32z
from .ggml_panel import panel_groups, use_panel
from .ggml_ir import (
    F32,
    I32,
    KQ,
    LV8F32,
    LV8I32,
    MIN32,
    OFFSET,
    PF_BYTES,
    Emit,
    chunks,
    dot_sums,
    idx,
    k4_scales,
    load_f32,
    load_i32,
    nsub,
    xbcast,
)
from .packed import prepare_call, workspace_args
from .packed_i8 import (
    GROUP_ROWS,
    V8F32,
    aligned_empty,
    check_array_arg,
    fzero,
    prefetch,
    quantize_rows_i8,
    splat,
    store_group,
    task_scratch,
    use_vnni,
)

__all__ = ["GGMLPacked", "GGMLWorkspace", "KINDS", "RECORD_BYTES", "prepack_ggml",
           "q4_0_to_int4", "linear_ggml_i8", "linear_ggml_exact", "make_workspace_ggml",
           "dequantize_rows"]

#: ggml type ids of the supported block types (the ``kind`` of a :class:`GGMLPacked`).
KINDS = {"Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
#: (weights per ggml block, bytes per ggml block) of each kind.
BLOCKS = {3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
          14: (256, 210)}
#: bytes per record (8 rows x one ggml block).
RECORD_BYTES = {k: GROUP_ROWS * b for k, (_, b) in BLOCKS.items()}
SERIAL_MAX_WORK = 1 << 18


# ------------------------------------------------------------------------------------------------
# int8-activation record kernels
# ------------------------------------------------------------------------------------------------
def _make_rec_i8(kind):
    @intrinsic
    def rec(typingctx, acc, data, roff, xq, xo, xd, xs8, xs16, bo, vnni):
        if not (acc == V8F32 and check_array_arg(data, types.uint8)
                and check_array_arg(xq, types.int8) and check_array_arg(xd, types.float32)
                and check_array_arg(xs8, types.int32) and check_array_arg(xs16, types.int32)):
            return None
        sig = V8F32(V8F32, data, types.intp, xq, types.intp, xd, xs8, xs16, types.intp,
                    types.boolean)

        def codegen(context, builder, sig, args):
            a, dat, ro, xqa, xoff, xda, s8a, s16a, boff, vn = args
            at = sig.args
            e = Emit(context, builder, at[1], dat, ro)
            d = e.f16x8(0)
            dmin = e.f16x8(16) if kind in KQ or kind in MIN32 else None  # (Q4_1/Q5_1: m)
            for sub in range(nsub(kind)):
                us = chunks(e, kind, sub)
                xo_s = idx(builder, xoff, 32 * sub)
                xs = [xbcast(context, builder, at[3], xqa, xo_s, t) for t in range(8)]
                bo_s = idx(builder, boff, sub)
                xd_s = splat(builder, load_f32(context, builder, at[5], xda, bo_s), LV8F32)
                if kind == 14:
                    s0, s1 = dot_sums(builder, us, xs, vn, ((0, 1, 2, 3), (4, 5, 6, 7)))
                    i16 = builder.mul(bo_s, ir.Constant(bo_s.type, 2))
                    t0 = load_i32(context, builder, at[7], s16a, i16)
                    t1 = load_i32(context, builder, at[7], s16a, idx(builder, i16, 1))
                    c32 = ir.Constant(I32, 32)
                    s0 = builder.sub(s0, splat(builder, builder.mul(t0, c32), LV8I32))
                    s1 = builder.sub(s1, splat(builder, builder.mul(t1, c32), LV8I32))
                    sc0 = e.bytes8(16 + 8 * (2 * sub), signed=True)
                    sc1 = e.bytes8(16 + 8 * (2 * sub + 1), signed=True)
                    tot = builder.add(builder.mul(sc0, s0), builder.mul(sc1, s1))
                    f = builder.sitofp(tot, LV8F32)
                    a = builder.fadd(a, builder.fmul(f, builder.fmul(d, xd_s)))
                    continue
                x8 = load_i32(context, builder, at[6], s8a, bo_s)  # 8 * sum(xq)
                if kind == 8:
                    (s,) = dot_sums(builder, us, xs, vn, (tuple(range(8)),), signed=True,
                                     xsum=builder.shl(x8, ir.Constant(I32, 4)))
                else:
                    (s,) = dot_sums(builder, us, xs, vn, (tuple(range(8)),))
                if kind == 8:
                    a = builder.fadd(a, builder.fmul(builder.sitofp(s, LV8F32),
                                                     builder.fmul(d, xd_s)))
                    continue
                if kind == 6:
                    s = builder.sub(s, splat(builder, builder.shl(x8, ir.Constant(I32, 1)),
                                             LV8I32))
                    a = builder.fadd(a, builder.fmul(builder.sitofp(s, LV8F32),
                                                     builder.fmul(d, xd_s)))
                    continue
                sx = builder.sitofp(builder.ashr(x8, ir.Constant(I32, 3)), F32)
                if kind in MIN32:  # Q4_1, Q5_1: dmin is m
                    f = builder.fadd(builder.fmul(builder.sitofp(s, LV8F32),
                                                  builder.fmul(d, xd_s)),
                                     builder.fmul(dmin, builder.fmul(
                                         xd_s, splat(builder, sx, LV8F32))))
                    a = builder.fadd(a, f)
                    continue
                # Q4_K, Q5_K
                sc, mn = k4_scales(e, sub)
                big_d = builder.fmul(d, builder.sitofp(sc, LV8F32))
                big_m = builder.fmul(dmin, builder.sitofp(mn, LV8F32))
                f = builder.fsub(builder.fmul(big_d, builder.sitofp(s, LV8F32)),
                                 builder.fmul(big_m, splat(builder, sx, LV8F32)))
                a = builder.fadd(a, builder.fmul(f, xd_s))
            return a
        return sig, codegen
    return rec


_rec_i8_q8_0 = _make_rec_i8(8)
_rec_i8_q5_0 = _make_rec_i8(6)
_rec_i8_q4_k = _make_rec_i8(12)
_rec_i8_q6_k = _make_rec_i8(14)
_rec_i8_q4_1 = _make_rec_i8(3)
_rec_i8_q5_1 = _make_rec_i8(7)
_rec_i8_q5_k = _make_rec_i8(13)


# ------------------------------------------------------------------------------------------------
# exact (float32 activation) record kernels
# ------------------------------------------------------------------------------------------------
def _make_rec_f32(kind):
    @intrinsic
    def rec(typingctx, acc, data, roff, x, xo, xsum, bo):
        if not (acc == V8F32 and check_array_arg(data, types.uint8)
                and check_array_arg(x, types.float32) and check_array_arg(xsum, types.float32)):
            return None
        sig = V8F32(V8F32, data, types.intp, x, types.intp, xsum, types.intp)

        def codegen(context, builder, sig, args):
            a, dat, ro, xa, xoff, xsa, boff = args
            at = sig.args
            e = Emit(context, builder, at[1], dat, ro)
            d = e.f16x8(0)
            dmin = e.f16x8(16) if kind in KQ or kind in MIN32 else None  # (Q4_1/Q5_1: m)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(LV8F32, [LV8F32] * 3), "llvm.fma.v8f32")
            off = ir.Constant(LV8I32, [OFFSET[kind]] * 8)
            m255 = ir.Constant(LV8I32, [255] * 8)
            zero = ir.Constant(LV8F32, [0.0] * 8)
            for sub in range(nsub(kind)):
                us = chunks(e, kind, sub)
                xo_s = idx(builder, xoff, 32 * sub)
                halves = []
                for grp in ((0, 1, 2, 3), (4, 5, 6, 7)):
                    ch = [zero] * 4  # 4 chains (j = byte within the lane)
                    for t in grp:
                        v = builder.bitcast(us[t], LV8I32)
                        for j in range(4):
                            w = builder.and_(builder.lshr(v, ir.Constant(LV8I32, [8 * j] * 8)),
                                             m255) if j else builder.and_(v, m255)
                            if OFFSET[kind]:
                                w = builder.sub(w, off)
                            wf = builder.sitofp(w, LV8F32)
                            xv = load_f32(context, builder, at[3], xa, idx(builder, xo_s, 4 * t + j))
                            ch[j] = builder.call(fma, [wf, splat(builder, xv, LV8F32), ch[j]])
                    halves.append(builder.fadd(builder.fadd(ch[0], ch[1]),
                                               builder.fadd(ch[2], ch[3])))
                bo_s = idx(builder, boff, sub)
                if kind == 14:
                    sc0 = builder.sitofp(e.bytes8(16 + 8 * (2 * sub), signed=True), LV8F32)
                    sc1 = builder.sitofp(e.bytes8(16 + 8 * (2 * sub + 1), signed=True), LV8F32)
                    a = builder.call(fma, [halves[0], builder.fmul(d, sc0), a])
                    a = builder.call(fma, [halves[1], builder.fmul(d, sc1), a])
                    continue
                s = builder.fadd(halves[0], halves[1])
                if kind in (6, 8):
                    a = builder.call(fma, [s, d, a])
                    continue
                sx = splat(builder, load_f32(context, builder, at[5], xsa, bo_s), LV8F32)
                if kind in MIN32:  # Q4_1, Q5_1: dmin is m
                    a = builder.fadd(a, builder.fadd(builder.fmul(d, s),
                                                     builder.fmul(dmin, sx)))
                    continue
                sc, mn = k4_scales(e, sub)
                big_d = builder.fmul(d, builder.sitofp(sc, LV8F32))
                big_m = builder.fmul(dmin, builder.sitofp(mn, LV8F32))
                a = builder.fadd(a, builder.fsub(builder.fmul(big_d, s), builder.fmul(big_m, sx)))
            return a
        return sig, codegen
    return rec


_rec_f32_q8_0 = _make_rec_f32(8)
_rec_f32_q5_0 = _make_rec_f32(6)
_rec_f32_q4_k = _make_rec_f32(12)
_rec_f32_q6_k = _make_rec_f32(14)
_rec_f32_q4_1 = _make_rec_f32(3)
_rec_f32_q5_1 = _make_rec_f32(7)
_rec_f32_q5_k = _make_rec_f32(13)


# ------------------------------------------------------------------------------------------------
# serial group loops and drivers
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _row_i8(kind, data, g, xq, xd, xs8, xs16, i, vnni):
    nrec = data.shape[1]
    rb = data.shape[2]
    nsub = 1 if kind == 3 or kind == 6 or kind == 7 or kind == 8 else 8
    xo = i * xq.shape[1]
    bo = i * xd.shape[1]
    acc = fzero()
    base = g * nrec
    if kind == 8:
        for s in range(nrec):
            ro = (base + s) * rb
            prefetch(data, ro + PF_BYTES)
            prefetch(data, ro + PF_BYTES + 64)
            prefetch(data, ro + PF_BYTES + 128)
            prefetch(data, ro + PF_BYTES + 192)
            prefetch(data, ro + PF_BYTES + 256)
            acc = _rec_i8_q8_0(acc, data, ro, xq, xo + 32 * s, xd, xs8, xs16, bo + s, vnni)
    elif kind == 6:
        for s in range(nrec):
            ro = (base + s) * rb
            prefetch(data, ro + PF_BYTES)
            prefetch(data, ro + PF_BYTES + 64)
            prefetch(data, ro + PF_BYTES + 128)
            acc = _rec_i8_q5_0(acc, data, ro, xq, xo + 32 * s, xd, xs8, xs16, bo + s, vnni)
    elif kind == 3:
        for s in range(nrec):
            ro = (base + s) * rb
            prefetch(data, ro + PF_BYTES)
            prefetch(data, ro + PF_BYTES + 64)
            prefetch(data, ro + PF_BYTES + 128)
            acc = _rec_i8_q4_1(acc, data, ro, xq, xo + 32 * s, xd, xs8, xs16, bo + s, vnni)
    elif kind == 7:
        for s in range(nrec):
            ro = (base + s) * rb
            prefetch(data, ro + PF_BYTES)
            prefetch(data, ro + PF_BYTES + 64)
            prefetch(data, ro + PF_BYTES + 128)
            acc = _rec_i8_q5_1(acc, data, ro, xq, xo + 32 * s, xd, xs8, xs16, bo + s, vnni)
    elif kind == 12:
        for s in range(nrec):
            ro = (base + s) * rb
            acc = _rec_i8_q4_k(acc, data, ro, xq, xo + 256 * s, xd, xs8, xs16,
                               bo + nsub * s, vnni)
    elif kind == 13:
        for s in range(nrec):
            ro = (base + s) * rb
            acc = _rec_i8_q5_k(acc, data, ro, xq, xo + 256 * s, xd, xs8, xs16,
                               bo + nsub * s, vnni)
    else:
        for s in range(nrec):
            ro = (base + s) * rb
            acc = _rec_i8_q6_k(acc, data, ro, xq, xo + 256 * s, xd, xs8, xs16,
                               bo + nsub * s, vnni)
    return acc


@njit(**JIT)
def _row_f32(kind, data, g, x, xsum, i):
    nrec = data.shape[1]
    rb = data.shape[2]
    nsub = 1 if kind == 3 or kind == 6 or kind == 7 or kind == 8 else 8
    xo = i * x.shape[1]
    bo = i * xsum.shape[1]
    acc = fzero()
    base = g * nrec
    for s in range(nrec):
        ro = (base + s) * rb
        for p in range(0, rb, 64):
            prefetch(data, ro + PF_BYTES + p)
        if kind == 8:
            acc = _rec_f32_q8_0(acc, data, ro, x, xo + 32 * s, xsum, bo + s)
        elif kind == 6:
            acc = _rec_f32_q5_0(acc, data, ro, x, xo + 32 * s, xsum, bo + s)
        elif kind == 3:
            acc = _rec_f32_q4_1(acc, data, ro, x, xo + 32 * s, xsum, bo + s)
        elif kind == 7:
            acc = _rec_f32_q5_1(acc, data, ro, x, xo + 32 * s, xsum, bo + s)
        elif kind == 12:
            acc = _rec_f32_q4_k(acc, data, ro, x, xo + 256 * s, xsum, bo + nsub * s)
        elif kind == 13:
            acc = _rec_f32_q5_k(acc, data, ro, x, xo + 256 * s, xsum, bo + nsub * s)
        else:
            acc = _rec_f32_q6_k(acc, data, ro, x, xo + 256 * s, xsum, bo + nsub * s)
    return acc


@njit(**JIT)
def needs_xsum(kind):
    """Whether exact mode reads per-32 float sums of ``x`` (the kinds with mins: Q4_1, Q5_1,
    Q4_K, Q5_K)."""
    return kind == 3 or kind == 7 or kind == 12 or kind == 13


@njit(**JIT)
def _act_sums(kind, m, k, xq, xs16, x, xsum, quant):
    """Q6_K (int8 mode): per-16 sums of xq; Q4_1, Q5_1, Q4_K, Q5_K (exact mode,
    :func:`needs_xsum`): per-32 float sums of x (``t += x`` in order from 0.0)."""
    if quant and kind == 14:
        for i in range(m):
            for h in range(k // 16):
                t = 0
                for p in range(16):
                    t += np.int32(xq[i, 16 * h + p])
                xs16[i, h] = t
    if not quant and needs_xsum(kind):
        for i in range(m):
            for b in range(k // 32):
                t = np.float32(0.0)
                for p in range(32):
                    t += x[i, 32 * b + p]
                xsum[i, b] = t


@njit(**JIT)
def _groups(kind, data, g0, g1, x, xq, xd, xs8, xs16, xsum, m, n, out, facc, quant, vnni):
    """Groups g0..g1-1 of ``out[:m]``: activation rows in blocks of
    :func:`~.ggml_gemm.block_rows` (their codes stay in L2 while the groups stream), within a
    block in chunks of :data:`~.ggml_gemm.ROWS` (int8 mode, :func:`~.ggml_gemm.chunks_i8`) or
    :data:`~.ggml_gemm.ROWS_F32` (exact mode, :func:`~.ggml_gemm.chunks_f32`), each record decoded
    once per chunk; the rows left over one at a time (bitwise the same results). int8 mode when
    :func:`~.ggml_panel.use_panel` (per kind, rows and path): :func:`~.ggml_panel.panel_groups`
    (``vnni``: its ``vpdpbusd`` tiles).
    Exact mode when :func:`~.ggml_gemm.use_fpanel`: groups in pairs through
    :func:`~.ggml_gemm.panel_f32` (records decoded once per row block into a float panel); on
    the ``vnni`` path (an AVX-512 host) pairs of groups first through
    :func:`~.ggml_zpanel.panel_f32z` (16-lane tiles of :data:`~.ggml_zpanel.ROWS_Z` rows), the rows
    it leaves through :func:`~.ggml_gemm.panel_f32`."""
    if quant and use_panel(kind, m, vnni):
        panel_groups(kind, data, g0, g1, xq, xd, xs8, xs16, m, n, out, facc, vnni)
        return
    mb = block_rows(xq.shape[1] if quant else 4 * x.shape[1])
    if not quant and use_fpanel(kind, vnni):
        panel = np.empty(2 * panel_floats(kind), np.float32)
        accb = np.empty(16 * mb, np.float32)
        for ib in range(0, m, mb):
            ie = min(m, ib + mb)
            for g in range(g0, g1, 2):
                ng = min(2, g1 - g)
                i0 = ib
                if vnni and ng == 2 and ie - ib >= ROWS_Z:
                    i0 = panel_f32z(kind, data, g, x, xsum, ib, ie, n, out, facc, panel, accb)
                if ie - i0 >= ROWS_P:
                    i0 = panel_f32(kind, data, g, ng, x, xsum, i0, ie, n, out, facc, panel, accb)
                for gi in range(g, g + ng):
                    for i in range(i0, ie):
                        store_group(_row_f32(kind, data, gi, x, xsum, i), facc, gi, i, n, out)
        return
    for ib in range(0, m, mb):
        ie = min(m, ib + mb)
        for g in range(g0, g1):
            if quant:
                i0 = chunks_i8(kind, data, g, xq, xd, xs8, xs16, ib, ie, n, out, facc, vnni)
            else:
                i0 = chunks_f32(kind, data, g, x, xsum, ib, ie, n, out, facc)
            for i in range(i0, ie):
                if quant:
                    acc = _row_i8(kind, data, g, xq, xd, xs8, xs16, i, vnni)
                else:
                    acc = _row_f32(kind, data, g, x, xsum, i)
                store_group(acc, facc, g, i, n, out)


@njit(**PJIT)
def _linear_par(kind, data, x, m, k, n, out, ntasks, xq, xd, xs8, xs16, xsum, facc, quant,
                vnni):
    if quant:
        quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    _act_sums(kind, m, k, xq, xs16, x, xsum, quant)
    ng = data.shape[0]
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        _groups(kind, data, g0, g1, x, xq, xd, xs8, xs16, xsum, m, n, out, facc[task], quant,
                vnni)


@njit(**JIT)
def _linear_ser(kind, data, x, m, k, n, out, xq, xd, xs8, xs16, xsum, facc, quant, vnni):
    if quant:
        quantize_rows_i8(x, m, k, k // 32, xq, xd, xs8)
    _act_sums(kind, m, k, xq, xs16, x, xsum, quant)
    _groups(kind, data, np.int64(0), data.shape[0], x, xq, xd, xs8, xs16, xsum, m, n, out,
            facc, quant, vnni)


# ------------------------------------------------------------------------------------------------
# container, workspace, wrappers
# ------------------------------------------------------------------------------------------------
class GGMLPacked:
    """A ggml ``[N, K]`` weight in group records (see the module docstring).

    Attributes
    ----------
    kind : int
        ggml type id (:data:`KINDS`).
    data : ndarray of uint8, shape [NG, K / block_size, RECORD_BYTES[kind]] (64-byte aligned)
    n, k, n_groups : int
    k_padded : int
        ``= k`` (K is a multiple of the block size).
    """

    __slots__ = ("kind", "data", "n", "k", "k_padded", "n_groups")

    def __init__(self, kind, data, n, k):
        self.kind, self.data = int(kind), data
        self.n, self.k = int(n), int(k)
        self.k_padded = self.k
        self.n_groups = int(data.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def type_name(self) -> str:
        return {v: k for k, v in KINDS.items()}[self.kind]

    def __repr__(self) -> str:
        return (f"GGMLPacked({self.type_name}, n={self.n}, k={self.k}, "
                f"nbytes={self.nbytes})")


class GGMLWorkspace:
    """Buffers of :func:`linear_ggml_i8` / :func:`linear_ggml_exact` (``M <= m_max``,
    ``K <= k_max``, at most ``n_tasks`` tasks): ``xq`` int8 [m_max, Kp], ``xd`` float32 /
    ``xs8`` int32 / ``xsum`` float32 [m_max, Kp/32], ``xs16`` int32 [m_max, Kp/16], ``facc``
    float32 [n_tasks, 1, 8]."""

    __slots__ = ("m_max", "k_max", "n_tasks", "xq", "xd", "xs8", "xs16", "xsum", "facc")

    def __init__(self, m_max, k_max, n_tasks):
        kp = 32 * (-(-k_max // 32))
        self.m_max, self.k_max, self.n_tasks = m_max, kp, n_tasks
        self.xq = aligned_empty((m_max, kp), np.int8)
        self.xq[...] = 0
        self.xd = np.zeros((m_max, kp // 32), np.float32)
        self.xs8 = np.zeros((m_max, kp // 32), np.int32)
        self.xs16 = np.zeros((m_max, kp // 16), np.int32)
        self.xsum = np.zeros((m_max, kp // 32), np.float32)
        self.facc = task_scratch(n_tasks, (1, GROUP_ROWS), np.float32)  # own lines

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, a).nbytes for a in ("xq", "xd", "xs8", "xs16", "xsum",
                                                         "facc")))


def make_workspace_ggml(m_max: int, k_max: int, n_tasks: int | None = None) -> GGMLWorkspace:
    """Preallocate the buffers of the ggml linears (see :class:`GGMLWorkspace`)."""
    m_max, k_max, n_tasks = workspace_args(m_max, k_max, n_tasks)
    return GGMLWorkspace(m_max, k_max, n_tasks)


def _run(x, packed, out, workspace, quant):
    m, out, ws = prepare_call(x, packed, GGMLPacked, out, workspace, GGMLWorkspace,
                              make_workspace_ggml)
    if m == 0:
        return out
    ntasks = min(ws.n_tasks, numba.get_num_threads(), packed.n_groups)
    vnni = use_vnni()
    if m * packed.n * packed.k < SERIAL_MAX_WORK or ntasks == 1:
        _linear_ser(packed.kind, packed.data, x, m, packed.k, packed.n, out, ws.xq, ws.xd,
                    ws.xs8, ws.xs16, ws.xsum, ws.facc[0], quant, vnni)
    else:
        _linear_par(packed.kind, packed.data, x, m, packed.k, packed.n, out, ntasks, ws.xq,
                    ws.xd, ws.xs8, ws.xs16, ws.xsum, ws.facc, quant, vnni)
    return out


def linear_ggml_i8(x: np.ndarray, packed: GGMLPacked, out: np.ndarray | None = None,
                   workspace: GGMLWorkspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` with int8-quantized activation blocks (32) for a :func:`prepack_ggml`
    weight (the math of the module docstring; VNNI and AVX2 paths bitwise equal).

    Parameters
    ----------
    x : ndarray of float32, shape [M, K], C-contiguous
    packed : GGMLPacked
    out : ndarray of float32, shape [M, N], optional
    workspace : GGMLWorkspace, optional (with ``out``: the call allocates nothing)

    Raises
    ------
    InvalidArgument
        Wrong types, dtypes or shapes (expected vs got).
    """
    return _run(x, packed, out, workspace, True)


def linear_ggml_exact(x: np.ndarray, packed: GGMLPacked, out: np.ndarray | None = None,
                      workspace: GGMLWorkspace | None = None) -> np.ndarray:
    """``y = x @ W.T`` with float32 activations (exact mode) for a :func:`prepack_ggml` weight;
    arguments as :func:`linear_ggml_i8`. Tolerance: see the module docstring."""
    return _run(x, packed, out, workspace, False)


# ------------------------------------------------------------------------------------------------
# repacking (session creation) and row dequantization
# ------------------------------------------------------------------------------------------------
def _f16bits(blocks, off):
    return np.ascontiguousarray(blocks[..., off:off + 2]).view(np.uint16)[..., 0]


@njit(**JIT)
def _repack(kind, blocks, out):
    """``blocks`` uint8 [8 * ng, nb, type_size] -> ``out`` uint8 [ng, nb, RECORD_BYTES]: the group
    records of the module docstring, one serial pass (0.8 GB/s here; a parallel loop was 10x
    slower on a loaded machine). Tested bytewise against the numpy formulation
    ``tests/reference.py::ggml_records``."""
    ng, nb, _ = out.shape
    for u in range(ng * nb):
        g = u // nb
        b = u - g * nb
        rec = out[g, b]
        r0 = g * 8
        doff = 208 if kind == 14 else 0
        for r in range(8):  # d: float16 bits of the 8 rows, row innermost
            src = blocks[r0 + r, b]
            rec[2 * r] = np.uint32(src[doff])
            rec[2 * r + 1] = np.uint32(src[doff + 1])
        if kind == 8:  # Q8_0: codes + 128, [c: 8][r: 8][e: 4]
            for c in range(8):
                for r in range(8):
                    src = blocks[r0 + r, b]
                    for e in range(4):
                        rec[16 + c * 32 + r * 4 + e] = np.uint32(src[2 + 4 * c + e]) ^ 0x80
        elif kind == 6:  # Q5_0: high bits (1 per code), then the nibble bytes as stored
            for r in range(8):
                src = blocks[r0 + r, b]
                qh = (np.uint32(src[2]) | (np.uint32(src[3]) << 8)
                      | (np.uint32(src[4]) << 16) | (np.uint32(src[5]) << 24))
                for e in range(4):
                    v = np.uint32(0)
                    for p in range(8):
                        v |= ((qh >> (p * 4 + e)) & 1) << p
                    rec[16 + r * 4 + e] = v
                for i in range(4):
                    for j in range(4):
                        rec[48 + i * 32 + r * 4 + j] = np.uint32(src[6 + 4 * i + j])
        elif kind == 3 or kind == 7:  # Q4_1 / Q5_1: m, [Q5_1: high bits], nibble bytes
            nib = 32 if kind == 3 else 64
            qs = 4 if kind == 3 else 8
            for r in range(8):
                src = blocks[r0 + r, b]
                rec[16 + 2 * r] = np.uint32(src[2])
                rec[16 + 2 * r + 1] = np.uint32(src[3])
                if kind == 7:
                    qh = (np.uint32(src[4]) | (np.uint32(src[5]) << 8)
                          | (np.uint32(src[6]) << 16) | (np.uint32(src[7]) << 24))
                    for e in range(4):
                        v = np.uint32(0)
                        for p in range(8):
                            v |= ((qh >> (p * 4 + e)) & 1) << p
                        rec[32 + r * 4 + e] = v
                for i in range(4):
                    for j in range(4):
                        rec[nib + i * 32 + r * 4 + j] = np.uint32(src[qs + 4 * i + j])
        elif kind == 13:  # Q5_K: as Q4_K, each sub-block's nibbles followed by its high bits
            for r in range(8):
                src = blocks[r0 + r, b]
                rec[16 + 2 * r] = np.uint32(src[2])
                rec[16 + 2 * r + 1] = np.uint32(src[3])
                for j in range(12):
                    rec[32 + j * 8 + r] = np.uint32(src[4 + j])
                for c in range(4):
                    for sh in range(2):
                        sb = c * 2 + sh
                        base = 128 + sb * 160
                        for i in range(4):
                            for j in range(4):
                                lo = (np.uint32(src[48 + 32 * c + 4 * i + j])
                                      >> (4 * sh)) & 15
                                hi = (np.uint32(src[48 + 32 * c + 16 + 4 * i + j])
                                      >> (4 * sh)) & 15
                                rec[base + i * 32 + r * 4 + j] = lo | (hi << 4)
                        for e in range(4):
                            v = np.uint32(0)
                            for p in range(8):
                                v |= ((np.uint32(src[16 + 4 * p + e]) >> sb) & 1) << p
                            rec[base + 128 + r * 4 + e] = v
        elif kind == 12:  # Q4_K: d, dmin, 12 scale bytes per row, 8 sub-blocks of nibbles
            for r in range(8):
                src = blocks[r0 + r, b]
                rec[16 + 2 * r] = np.uint32(src[2])
                rec[16 + 2 * r + 1] = np.uint32(src[3])
                for j in range(12):
                    rec[32 + j * 8 + r] = np.uint32(src[4 + j])
                for c in range(4):
                    for sh in range(2):
                        base = 128 + (c * 2 + sh) * 128
                        for i in range(4):
                            for j in range(4):
                                lo = (np.uint32(src[16 + 32 * c + 4 * i + j])
                                      >> (4 * sh)) & 15
                                hi = (np.uint32(src[16 + 32 * c + 16 + 4 * i + j])
                                      >> (4 * sh)) & 15
                                rec[base + i * 32 + r * 4 + j] = lo | (hi << 4)
        else:  # Q6_K: d, 16 scale bytes per row, 8 sub-blocks of (nibbles, 2-bit highs)
            for r in range(8):
                src = blocks[r0 + r, b]
                for j in range(16):
                    rec[16 + j * 8 + r] = np.uint32(src[192 + j])
                for c in range(2):
                    for sh in range(2):
                        for h2 in range(2):
                            base = 144 + (c * 4 + sh * 2 + h2) * 192
                            for i in range(4):
                                for j in range(4):
                                    t = 64 * c + 32 * h2 + 4 * i + j
                                    lo = (np.uint32(src[t]) >> (4 * sh)) & 15
                                    hi = (np.uint32(src[t + 16]) >> (4 * sh)) & 15
                                    rec[base + i * 32 + r * 4 + j] = lo | (hi << 4)
                    for s4 in range(4):
                        base = 144 + (c * 4 + s4) * 192 + 128
                        for v in range(2):
                            for e in range(4):
                                x = np.uint32(0)
                                for p in range(4):
                                    t = v * 16 + p * 4 + e
                                    x |= ((np.uint32(src[128 + 32 * c + t])
                                           >> (2 * s4)) & 3) << (2 * p)
                                rec[base + v * 32 + r * 4 + e] = x


@njit(**JIT)
def _q4_0_rows(blocks, codes, scales):
    """Q4_0 blocks uint8 [R, nb, 18] -> row-major signed INT4 codes uint8 [R, nb, 16] (element
    2j in the low nibble of byte j, code u - 8 as u ^ 8) and the blocks' float16 d bits uint16
    [R, nb]."""
    r_, nb, _ = blocks.shape
    for r in range(r_):
        for b in range(nb):
            src = blocks[r, b]
            scales[r, b] = np.uint16(src[0]) | (np.uint16(src[1]) << 8)
            dst = codes[r, b]
            for j in range(8):
                lo = np.uint32(src[2 + 2 * j])
                hi = np.uint32(src[3 + 2 * j])
                dst[j] = ((lo & 15) | ((hi & 15) << 4)) ^ 0x88
                dst[8 + j] = ((lo >> 4) | (hi & 0xF0)) ^ 0x88


def q4_0_to_int4(blocks: np.ndarray):
    """Q4_0 blocks -> the signed-INT4 block-32 affine form (``w = d * q``, the same values).

    Parameters
    ----------
    blocks : ndarray of uint8, shape [R, K / 32, 18]
        The tensor's Q4_0 blocks (``d`` float16, 16 bytes of nibbles; GGUF spec / ggml-common.h).

    Returns
    -------
    codes : ndarray of uint8, shape [R * K / 2]
        Row-major INT4 codes (two's complement, LSB first) of ``q = u - 8``.
    scales : ndarray of float16, shape [R, K / 32]
        ``d`` of each block (its bits unchanged).
    """
    check_array(blocks, "blocks", dtype=np.uint8, ndim=3, contiguous=False)
    if blocks.shape[2] != 18:
        raise InvalidArgument(f"blocks: expected Q4_0 blocks of 18 bytes, got {blocks.shape[2]}")
    r, nb, _ = blocks.shape
    if blocks.flags.writeable:  # one numba specialisation: the file's blocks are read-only views
        blocks = blocks.view()
        blocks.flags.writeable = False
    codes = np.empty((r, nb, 16), np.uint8)
    scales = np.empty((r, nb), np.uint16)
    _q4_0_rows(blocks, codes, scales)
    return codes.reshape(-1), scales.view(np.float16)


def prepack_ggml(kind, blocks: np.ndarray, n: int, k: int) -> GGMLPacked:
    """Repack ggml blocks into group records (session creation; bytes only, no float copy).

    Parameters
    ----------
    kind : int or str
        ggml type (:data:`KINDS`: Q8_0, Q5_0, Q4_K, Q6_K, by name or type id).
    blocks : ndarray of uint8, shape [N * K / block_size * type_size] or [N, K / bs, type_size]
        The tensor's bytes as in the GGUF file (row-major blocks).
    n, k : int
        Rows and row length (``k`` a multiple of the block size).

    Raises
    ------
    InvalidArgument
        Unknown kind, ``k`` not a multiple of the block size, or a payload of the wrong size.
    """
    if isinstance(kind, str):
        if kind not in KINDS:
            raise InvalidArgument(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
        kind = KINDS[kind]
    if kind not in BLOCKS:
        raise InvalidArgument(f"kind: expected a ggml type id in {sorted(BLOCKS)}, got {kind!r}")
    n = check_int(n, "n", lo=1)
    k = check_int(k, "k", lo=1)
    bs, ts = BLOCKS[kind]
    if k % bs:
        raise InvalidArgument(f"k: expected a multiple of the block size {bs}, got {k}")
    nb = k // bs
    check_array(blocks, "blocks", dtype=np.uint8, contiguous=False)
    if blocks.size != n * nb * ts:
        raise InvalidArgument(f"blocks: expected {n * nb * ts} bytes for [{n}, {k}], got "
                              f"{blocks.size}")
    blocks = blocks.reshape(n, nb, ts)
    if blocks.flags.writeable:  # one numba specialisation: the file's blocks are read-only views
        blocks = blocks.view()
        blocks.flags.writeable = False
    ng = -(-n // GROUP_ROWS)
    data = aligned_empty((ng, nb, RECORD_BYTES[kind]), np.uint8)
    full = n // GROUP_ROWS
    if full:
        _repack(kind, blocks[:full * GROUP_ROWS], data[:full])
    if ng > full:  # the last group's rows past n: zero blocks (weights 0)
        tail = np.zeros((GROUP_ROWS, nb, ts), np.uint8)
        tail[:n - full * GROUP_ROWS] = blocks[full * GROUP_ROWS:]
        tail.flags.writeable = False
        _repack(kind, tail, data[full:])
    return GGMLPacked(kind, data, n, k)


def dequantize_rows(kind, blocks: np.ndarray) -> np.ndarray:
    """Rows of ggml blocks ``uint8 [R, nb, type_size]`` -> float32 ``[R, nb * block_size]``,
    with the float32 operations of gguf-py's ``dequantize_blocks`` (bitwise equal results)."""
    if isinstance(kind, str):
        kind = KINDS[kind]
    r, nb, _ = blocks.shape

    def f16(off):
        return _f16bits(blocks, off).view(np.float16).astype(np.float32)
    if kind == 8:
        d = f16(0)[..., None]
        return (d * blocks[..., 2:34].view(np.int8).astype(np.float32)).reshape(r, -1)
    if kind == 6:
        d = f16(0)[..., None]
        qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]
        h = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = blocks[..., 6:22]
        lo = np.concatenate([qs & 15, qs >> 4], axis=-1)
        q = (lo | (h << 4)).astype(np.int8) - np.int8(16)
        return (d * q.astype(np.float32)).reshape(r, -1)
    if kind in (3, 7):  # (d * q) + m
        d, m = f16(0)[..., None], f16(2)[..., None]
        qs = blocks[..., 4:20] if kind == 3 else blocks[..., 8:24]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if kind == 7:
            qh = np.ascontiguousarray(blocks[..., 4:8]).view("<u4")[..., 0]
            q = q | (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
                     << np.uint8(4))
        return ((d * q.astype(np.float32)) + m).reshape(r, -1)
    if kind in (12, 13):
        d, dmin = f16(0)[..., None], f16(2)[..., None]
        s = blocks[..., 4:16]
        d_, m_, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = np.concatenate([d_ & 63, (md & 15) | ((d_ >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([m_ & 63, (md >> 4) | ((m_ >> 2) & 0x30)], axis=-1)
        big_d = (d * sc.astype(np.float32))[..., None]
        big_m = (dmin * mn.astype(np.float32))[..., None]
        q0 = 16 if kind == 12 else 48
        qs = blocks[..., q0:q0 + 128].reshape(r, nb, 4, 1, 32) >> np.array(
            [0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 15).reshape(r, nb, 8, 32)
        if kind == 13:  # element l of sub-block s: bit s of qh[l]
            qh = blocks[..., 16:48].reshape(r, nb, 1, 32) >> np.arange(
                8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = q | ((qh & 1) << np.uint8(4))
        return (big_d * q.astype(np.float32) - big_m).reshape(r, -1)
    d = f16(208)[..., None]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    dd = (d * sc).reshape(r, nb, 16, 1)
    ql = blocks[..., 0:128].reshape(r, nb, 2, 1, 64) >> np.array(
        [0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & 15).reshape(r, nb, 8, 32)
    qh = blocks[..., 128:192].reshape(r, nb, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & 3).reshape(r, nb, 8, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (dd * q.reshape(r, nb, 16, 16).astype(np.float32)).reshape(r, -1)
