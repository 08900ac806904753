"""Per-block kernels of the paged attention (:mod:`.paged_attention`): one block side (K or V,
any format) of one kv head scored against the query heads of its group, or accumulated into
their outputs (``o += p @ V``), the int8 queries of the int8-activation mode, and the prefetch
of the blocks ahead.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import carray, njit

from .attention import _FM, _accum_rows, _dot, _scores_rows, _softmax_tile
from .config import JIT
from .paged_ir import (
    QKBLK_MAX_D,
    _f32p,
    _half_to_f32,
    _i8p,
    _prefetch,
    _pv1,
    _pv2,
    _pv3,
    _pv4,
    _pv4_1,
    _pv4_2,
    _pv4_3,
    _pv4_4,
    _pv4_5,
    _pv4_6,
    _pv4_7,
    _pv4_8,
    _pv8_1,
    _pv8_2,
    _pv8_3,
    _pv8_4,
    _pv8_5,
    _pv8_6,
    _pv8_7,
    _pv8_8,
    _qk16_i4,
    _qk16_i8,
    _qkblk_i4,
    _qkblk_i8,
    _qkg_f16,
    _qkg_i8,
    _u8p,
    _u16p,
)
from .paged_table import T_KFMT, T_VADDR, T_VFMT, T_VPT, T_VSADDR

#: The partial online-softmax state of the ``ng`` query heads of one kv head (float32): running
#: max ``m`` [ng], running sum ``l`` [ng], output accumulator ``o`` [ng, D] (unnormalised).
SoftmaxState = namedtuple("SoftmaxState", ("m", "l", "o"))

#: The scratch of one softmax tile of ``W`` keys (``W >= BS``): scores ``sc`` and probabilities
#: ``p`` float32 [ng, W + SLACK], the tile's running max ``mx`` float32 [ng], one decoded block and
#: kv head of a non-float32 side ``scr`` float32 [BS, D], its row multipliers ``rmul`` float32
#: [BS + 16] (key scales with int8 queries), the tile's blocks ``pend`` int64 [W, 2] (table row,
#: tokens).
TileScratch = namedtuple("TileScratch", ("sc", "p", "mx", "scr", "rmul", "pend"))

#: The int8 queries of the int8-activation mode (:func:`_quantize_heads`): ``on`` (bool, scores
#: of INT8/INT4 key blocks from them), ``vnni`` (bool, the AVX-512 VNNI instruction path), codes
#: ``qi`` and their INT4 nibble order ``qip`` int8 [ng, D], ``qmul`` float32 [ng] (query scale
#: times attention scale), ``qsum`` int32 [ng] (sum of the codes).
Int8Query = namedtuple("Int8Query", ("on", "vnni", "qi", "qip", "qmul", "qsum"))


@njit(**JIT)
def _block_f32(addr, g, bs, d):
    """The float32 [BS, D] rows of kv head ``g`` of a float32 block slot at ``addr``."""
    return carray(_f32p(addr + g * bs * d * 4), (bs, d))


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
def _block_scores_i8(qi, qip, qmul, qsum, ng, kside, g, bs, d, nk, sc, c0, mx, rmul, vnni):
    """Scores of the first ``nk`` tokens of an INT8/INT4 key block side against the int8
    queries ``qi``/``qip`` int8 [ng, D] (``qmul`` float32, ``qsum`` int32 [ng]:
    :func:`_quantize_heads`) into ``sc[:, c0:]``: ``float32(S) * (qmul[hh] * k_scale[t])`` with
    ``S`` the exact integer dot product (:func:`~.paged_ir._qk16_i8`; ``rmul`` float32 needs 16
    slots past the block's last multiple of 16); ``mx[hh]`` tracks the max. ``kside``: the
    side's (format 2 or 3, slot address, scale address, per-token scales) of the block-table
    row (int64 4-tuple); kv head ``g``, block size ``bs``, head size ``d``; ``vnni`` the
    instruction path. (The table's scalars, not the query arrays, are bundled: a tuple of
    arrays costs reference-count updates per block.)"""
    fmt, addr, saddr, pt = kside
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
    if not is4 and d <= QKBLK_MAX_D:  # AVX2: 8 heads in the lanes per load of a key row
        for jj in range(0, nk, 16):
            _qkg_i8(qi, ng, base + jj * rb, min(16, nk - jj), rb, qmul, rmul[jj:], sc, c0 + jj,
                    mx)
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
    elif fmt == 1 and d % 64 == 0:  # float16 rows converted in registers, 8 heads per load
        rmul[0] = scale
        base = addr + g * bs * d * 2
        for jj in range(0, nk, 16):
            _qkg_f16(qg, ng, base + jj * d * 2, min(16, nk - jj), d * 2, rmul, rmul, sc, c0 + jj,
                     mx)
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
def _flush(table, npend, ng, g, bs, d, c, st, ws):
    """The softmax update of a tile of ``c`` scored keys (``ws.sc[:, :c]``) into ``st``
    (:class:`SoftmaxState`), then ``o += p @ V`` over the tile's ``npend`` blocks
    (``ws.pend``: table row, tokens) of kv head ``g``."""
    m, l, o = st
    sc, p, mx, scr, rmul, pend = ws
    _softmax_tile(sc, ng, c, mx, m, l, o, p)
    c0 = 0
    for k in range(npend):
        bi = pend[k, 0]
        nk = pend[k, 1]
        _block_accum(p, c0, ng, table[bi, T_VFMT], table[bi, T_VADDR], table[bi, T_VSADDR],
                     table[bi, T_VPT], g, bs, d, nk, o, scr, rmul)
        c0 += nk


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
