"""Multi-head attention with grouped-query heads over a contiguous KV cache.

Source: ONNX ``Attention`` (opset 23) with ``past_key``/``past_value`` (internal cache),
``is_causal`` (bottom-right aligned: query ``i`` of the ``S`` new ones attends key ``j`` iff
``j <= past_len + i``), ``q_num_heads``/``kv_num_heads`` (query head ``h`` uses kv head
``h // (H // KVH)``), no attention mask, no softcap; softmax in float32.

GQA in one pass: each task is a block of :data:`QBLOCK` query rows of one kv head ``g`` and serves
every query head of the group (``H/KVH`` heads), so each key/value row is read once per kv head and
block of rows, not once per query head and row (the keys every row of the block attends run once for
all of them, then each row its own last tiles: the same tiles, so the same bits, as a pass of its
own). Keys are taken in tiles of :data:`TILE`: the scores of a tile (``q . k`` dot products,
vectorised) for all heads of the group, then one *online* (streaming) softmax update per head and
tile -- running max ``m``, running sum ``l``, un-normalised output ``o`` rescaled by ``exp(m_old -
m_new)`` when the max grows -- with the tile's exponentials in one vector loop (:func:`_exp_neg`, a
polynomial within 2 ulp of libm's ``expf``), then ``o += p @ V`` per head with its output row in
registers (:func:`_pv16`; four keys per pass over ``o`` for head dims that are not a multiple of
16); ``o / l`` at the end. A decode step may split one kv head's keys over threads and combine the
partial states (:func:`_merge_partials`, flash-decoding). A query with no attendable key gets zeros
(ONNX convention for fully masked rows). Results agree with the float64 reference to ~1e-6 relative
(tests: rtol 1e-5).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from olv_runtime.errors import InvalidArgument

from .config import JIT, PJIT, check_array, check_int, check_out
from .rope import _rope_token

__all__ = ["attention", "append_kv", "kv_write", "rope_attention"]

#: Query-row x key x head-dim products above which attention splits its tasks (blocks of query
#: rows of one kv head) over the threads: each row's streaming softmax is serial scalar work, so
#: even short contexts pay off.
ATTENTION_PARALLEL_WORK = 1 << 14


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})
def _dot(a, b, n):
    """sum(a[:n] * b[:n]) in float32, reassociated so LLVM vectorises it (the summation order is
    fixed by the compiled code: deterministic, within float32 rounding of the sequential sum;
    no FMA contraction)."""
    s = np.float32(0.0)
    for i in range(n):
        s += a[i] * b[i]
    return s


# -------------------------------------------------------------------------------------------------
# blocked online softmax (decode and prefill): one pass over K/V per kv head for all its query heads
# -------------------------------------------------------------------------------------------------
#: Keys per online-softmax step: the scores of a tile of keys are computed for every query head
#: of the group (tracking the tile max on the way), the running max/sum are updated once per tile
#: and the tile's exponentials are one vector loop (64 = the 4 x 16 lanes LLVM's vectoriser takes
#: per iteration of a runtime-length float32 loop on AVX-512).
TILE = 64

#: Extra score slots after a tile (:func:`_qk16` writes 16 scores at a time).
SLACK = 16

#: Query positions per task of the contiguous prefill attention (:func:`_attend_task`): their
#: rows share one pass over the keys all of them attend.
QBLOCK = 8

_FM = dict(JIT, fastmath={"reassoc", "nsz", "contract"})

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)


@intrinsic
def _bits_f32(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if sig.args[0].bitwidth != 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(bits), codegen


@njit(**JIT)
def _exp_neg(x):
    """``exp(x)`` for float32 ``x <= 0`` (``x < -87`` gives ``exp(-87)``), a polynomial LLVM
    vectorises (libm's ``expf`` is a scalar call): Cody-Waite reduction ``x = n ln2 + r``,
    ``|r| <= ln2/2``, Cephes' degree-6 expf polynomial, ``2**n`` from the exponent bits.
    Within 2 ulp of ``np.exp`` on [-87, 0] (tested). No fastmath: the reduction's order stays."""
    if x < _EXP_MIN:
        x = _EXP_MIN
    n = np.int32(x * _LOG2E - np.float32(0.5))  # x <= 0: truncation = round to nearest
    fn = np.float32(n)
    r = (x - fn * _LN2_HI) - fn * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r) * r + r + np.float32(1.0)
    return y * _bits_f32((n + 127) << 23)


@njit(**_FM)
def _exp_row(sr, pr, nt, mo):
    """``pr[j] = exp(sr[j] - mo)`` for ``j < nt``; returns their sum (one vector loop)."""
    acc = np.float32(0.0)
    for j in range(nt):
        e = _exp_neg(sr[j] - mo)
        pr[j] = e
        acc += e
    return acc


@njit(**JIT)
def _softmax_tile(sc, ng, nt, mx, m, l, o, p):
    """Online-softmax update of ``ng`` query heads with the scores ``sc[:ng, :nt]`` of one tile
    of keys whose max per head is ``mx[hh]``: the running max ``m[hh]`` grows to the tile max
    (``l[hh]`` and ``o[hh]`` rescaled by ``exp(m_old - m_new)``), ``p[hh, j] = exp(sc - m_new)``
    and ``l[hh] += sum_j p``."""
    d = o.shape[1]
    for hh in range(ng):
        bm = mx[hh]
        mo = m[hh]
        if bm > mo:
            if l[hh] > 0:
                corr = _exp_neg(mo - bm)
                l[hh] = l[hh] * corr
                oh = o[hh]
                for i in range(d):
                    oh[i] = oh[i] * corr
            m[hh] = bm
            mo = bm
        l[hh] = l[hh] + _exp_row(sc[hh], p[hh], nt, mo)


@intrinsic
def _qk16(typingctx, q, k, row0, nrows, out, off, mult):
    """``out[off + j] = mult * (q . k[row0 + j])`` for ``j < 16``: the scores of up to 16 keys
    at once without a horizontal sum per key. Per key a 16-lane partial vector (one vector FMA
    per 16 features), then a shuffle tree adds the 16 vectors into one vector of 16 sums (15
    pairwise steps instead of 16 horizontal reductions). Rows ``>= nrows`` repeat the last row
    (never read out of bounds); their 16 - nrows results are written too, so ``out`` needs 16
    writable slots from ``off``. ``q`` float32 [D], ``k`` float32 [T, D] C-contiguous,
    ``D % 16 == 0``."""
    sig = types.void(q, k, row0, nrows, out, off, mult)
    def codegen(context, builder, sig, args):
        qa = context.make_array(sig.args[0])(context, builder, args[0])
        ka = context.make_array(sig.args[1])(context, builder, args[1])
        oa = context.make_array(sig.args[4])(context, builder, args[4])
        i64 = ir.IntType(64); i32 = ir.IntType(32)
        f32 = ir.FloatType(); v16 = ir.VectorType(f32, 16)
        d = builder.extract_value(qa.shape, 0)
        nch = builder.udiv(d, ir.Constant(i64, 16))
        row0 = context.cast(builder, args[2], sig.args[2], types.int64)
        nrows = context.cast(builder, args[3], sig.args[3], types.int64)
        last = builder.sub(nrows, ir.Constant(i64, 1))
        kbase = builder.bitcast(ka.data, f32.as_pointer())
        qbase = builder.bitcast(qa.data, f32.as_pointer())
        rowptrs = []
        for j in range(16):
            jj = ir.Constant(i64, j)
            r = builder.select(builder.icmp_signed("<", jj, nrows), jj, last)
            rowptrs.append(builder.gep(kbase, [builder.mul(builder.add(row0, r), d)]))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(16)]
        with cgutils.for_range(builder, nch) as loop:
            off16 = builder.mul(loop.index, ir.Constant(i64, 16))
            qv = builder.load(builder.bitcast(builder.gep(qbase, [off16]), v16.as_pointer()), align=4)
            for j in range(16):
                kv = builder.load(builder.bitcast(builder.gep(rowptrs[j], [off16]), v16.as_pointer()), align=4)
                a = builder.load(accs[j])
                prod = builder.fmul(qv, kv, flags=("fast",))
                builder.store(builder.fadd(a, prod, flags=("fast",)), accs[j])
        vecs = [builder.load(a) for a in accs]
        w = 16
        while len(vecs) > 1:
            half = w // 2; m = 16 // w
            lo_idx = [g * w + i for g in range(m) for i in range(half)]
            hi_idx = [g * w + half + i for g in range(m) for i in range(half)]
            lo_m = ir.Constant(ir.VectorType(i32, 16), lo_idx + [16 + x for x in lo_idx])
            hi_m = ir.Constant(ir.VectorType(i32, 16), hi_idx + [16 + x for x in hi_idx])
            vecs = [builder.fadd(builder.shuffle_vector(a, b, lo_m), builder.shuffle_vector(a, b, hi_m))
                    for a, b in zip(vecs[0::2], vecs[1::2])]
            w = half
        mv = builder.insert_element(ir.Constant(v16, ir.Undefined), args[6], ir.Constant(i32, 0))
        mv = builder.shuffle_vector(mv, ir.Constant(v16, ir.Undefined), ir.Constant(ir.VectorType(i32, 16), [0] * 16))
        r = builder.fmul(vecs[0], mv)
        o = context.cast(builder, args[5], sig.args[5], types.int64)
        optr = builder.gep(builder.bitcast(oa.data, f32.as_pointer()), [o])
        builder.store(r, builder.bitcast(optr, v16.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen

@intrinsic
def _pv16(typingctx, pr, c0, v, j0, nt, oh, mult):
    """``oh[i] += sum_{j < nt} (pr[c0 + j] * mult) * v[j0 + j, i]`` for every ``i < D``: one query
    head's ``p @ V`` over ``nt`` keys with the output in registers. The 16-lane chunks of ``oh``
    are taken four at a time (then one at a time): per key one ``pj = pr * mult`` (float32) and
    one FMA per chunk, keys in order (``acc = fma(pj, v, acc)``), so each output element is the
    sequential sum of its products, each added with one rounding. ``pr`` float32 [>= c0 + nt],
    ``oh`` float32 [D], ``v`` float32 [T, D] with unit strides along D (the rows may be strided),
    ``D % 16 == 0`` (the caller checks)."""
    sig = types.void(pr, c0, v, j0, nt, oh, mult)

    def codegen(context, builder, sig, args):
        pa = context.make_array(sig.args[0])(context, builder, args[0])
        va = context.make_array(sig.args[2])(context, builder, args[2])
        oa = context.make_array(sig.args[5])(context, builder, args[5])
        i64, i8 = ir.IntType(64), ir.IntType(8)
        f32 = ir.FloatType()
        v16 = ir.VectorType(f32, 16)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3),
                                             "llvm.fma.v16f32")
        c0 = context.cast(builder, args[1], sig.args[1], types.int64)
        j0 = context.cast(builder, args[3], sig.args[3], types.int64)
        nt = context.cast(builder, args[4], sig.args[4], types.int64)
        mult = context.cast(builder, args[6], sig.args[6], types.float32)
        d = builder.extract_value(va.shape, 1)
        vstride = builder.extract_value(va.strides, 0)
        pbase = builder.gep(builder.bitcast(pa.data, f32.as_pointer()), [c0])
        obase = builder.bitcast(oa.data, f32.as_pointer())
        vbase = builder.bitcast(va.data, i8.as_pointer())
        nch = builder.udiv(d, ir.Constant(i64, 16))
        nb4 = builder.udiv(nch, ir.Constant(i64, 4))
        zero_idx = ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16)

        def vptr(base, off):
            return builder.bitcast(builder.gep(base, [off]), v16.as_pointer())

        def block(first_lane, width):
            accs = [cgutils.alloca_once(builder, v16) for _ in range(width)]
            for k, a in enumerate(accs):
                off = builder.add(first_lane, ir.Constant(i64, 16 * k))
                builder.store(builder.load(vptr(obase, off), align=4), a)
            with cgutils.for_range(builder, nt) as jl:
                pj = builder.fmul(builder.load(builder.gep(pbase, [jl.index])), mult)
                pv = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(v16, ir.Undefined), pj,
                                           ir.Constant(ir.IntType(32), 0)),
                    ir.Constant(v16, ir.Undefined), zero_idx)
                row = builder.bitcast(
                    builder.gep(vbase, [builder.mul(builder.add(j0, jl.index), vstride)]),
                    f32.as_pointer())
                for k, a in enumerate(accs):
                    off = builder.add(first_lane, ir.Constant(i64, 16 * k))
                    x = builder.load(vptr(row, off), align=4)
                    builder.store(builder.call(fma, [pv, x, builder.load(a)]), a)
            for k, a in enumerate(accs):
                off = builder.add(first_lane, ir.Constant(i64, 16 * k))
                builder.store(builder.load(a), vptr(obase, off), align=4)

        with cgutils.for_range(builder, nb4) as b:
            block(builder.mul(b.index, ir.Constant(i64, 64)), 4)
        done = builder.mul(nb4, ir.Constant(i64, 4))  # chunks taken four at a time
        with cgutils.for_range(builder, builder.sub(nch, done)) as c:
            block(builder.mul(builder.add(done, c.index), ir.Constant(i64, 16)), 1)
        return context.get_dummy_value()
    return sig, codegen


@njit(**JIT)
def _scores_rows(qg, ng, k, j0, nt, mult, sc, c0, mx):
    """``sc[hh, c0 + j] = (qg[hh] . k[j0 + j]) * mult`` for ``ng`` heads and ``nt`` float32 key
    rows (``k`` C-contiguous); ``mx[hh]`` becomes the max of itself and these scores. With
    ``D % 16 == 0`` 16 keys at a time (:func:`_qk16`; ``sc`` needs 16 slots of slack after the
    tile), else one dot product per key."""
    d = qg.shape[1]
    if d % 16 == 0:
        for jj in range(0, nt, 16):
            n = min(16, nt - jj)
            for hh in range(ng):
                sr = sc[hh]
                _qk16(qg[hh], k, j0 + jj, n, sr, c0 + jj, mult)
                m = mx[hh]
                for j in range(n):
                    v = sr[c0 + jj + j]
                    if v > m:
                        m = v
                mx[hh] = m
        return
    for j in range(nt):
        kr = k[j0 + j]
        for hh in range(ng):
            v = _dot(qg[hh], kr, d) * mult
            sc[hh, c0 + j] = v
            if v > mx[hh]:
                mx[hh] = v


@njit(**_FM)
def _accum_rows(p, c0, ng, v, j0, nt, o, vmult):
    """``o[hh] += vmult * sum_j p[hh, c0 + j] * v[j0 + j]`` (float32 rows). With ``D % 16 == 0``
    and unit strides along D: :func:`_pv16` per head (the output in registers, one FMA per key
    and 16 lanes); else four keys per pass over ``o``."""
    d = o.shape[1]
    if (d % 16 == 0 and v.shape[1] == d and o.strides[1] == 4 and v.strides[1] == 4
            and p.strides[1] == 4):
        for hh in range(ng):
            _pv16(p[hh], c0, v, j0, nt, o[hh], vmult)
        return
    j = 0
    while j + 4 <= nt:
        v0 = v[j0 + j]
        v1 = v[j0 + j + 1]
        v2 = v[j0 + j + 2]
        v3 = v[j0 + j + 3]
        for hh in range(ng):
            pr = p[hh]
            p0 = pr[c0 + j] * vmult
            p1 = pr[c0 + j + 1] * vmult
            p2 = pr[c0 + j + 2] * vmult
            p3 = pr[c0 + j + 3] * vmult
            oh = o[hh]
            for i in range(d):
                oh[i] += (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])
        j += 4
    while j < nt:
        vr = v[j0 + j]
        for hh in range(ng):
            pj = p[hh, c0 + j] * vmult
            oh = o[hh]
            for i in range(d):
                oh[i] += pj * vr[i]
        j += 1


@njit(**JIT)
def _tile_max_init(mx, ng):
    for hh in range(ng):
        mx[hh] = -np.inf


# the same functions inlined into _attend_rows (numba IR, same flags): one library level less,
# so numba's LLVM pass over every caller's closure (prefill driver, compiled decode step) is not
# repeated for them (cold start); the paged kernels call the dispatchers above
_tile_max_init_il = njit(inline="always", **JIT)(_tile_max_init.py_func)
_scores_rows_il = njit(inline="always", **JIT)(_scores_rows.py_func)
_softmax_tile_il = njit(inline="always", **JIT)(_softmax_tile.py_func)


@njit(**JIT)
def _attend_rows(qg, ng, k, v, j0, j1, scale, m, l, o, sc, p, mx):
    """Keys/values ``k[j0:j1]``, ``v[j0:j1]`` (float32 [T, D] rows of one kv head) into the
    partial softmax state ``m[ng], l[ng], o[ng, D]`` of the ``ng`` query heads ``qg[ng, D]``.
    Scratch: ``sc, p`` float32 [>= ng, TILE + SLACK], ``mx`` float32 [>= ng]."""
    one = np.float32(1.0)
    zero = np.int64(0)  # not the literal 0: a literal argument is one more specialisation
    for t0 in range(j0, j1, TILE):
        nt = min(TILE, j1 - t0)
        _tile_max_init_il(mx, ng)
        _scores_rows_il(qg, ng, k, t0, nt, scale, sc, zero, mx)
        _softmax_tile_il(sc, ng, nt, mx, m, l, o, p)
        _accum_rows(p, zero, ng, v, t0, nt, o, one)


def shared_entries() -> list:
    """``(numba dispatcher, argument types)`` of the attention-row functions the prefill
    attention (:func:`_attend_task`) and the compiled decode step
    (:func:`~.decode_stack._stack_thread`) both call, with the one specialisation they share
    (float32 C-contiguous rows, int64 counts). A compile worker building the decode step
    compiles these first (:mod:`.precompile`): the main process, which reaches the prefill
    attention seconds later, then loads them from numba's cache instead of compiling them
    again (cold start)."""
    f1 = types.Array(types.float32, 1, "C")
    f2 = types.Array(types.float32, 2, "C")
    i64 = types.int64
    return [(_state_init, (f1, f1, f2, i64)),
            (_attend_rows, (f2, i64, f2, f2, i64, i64, types.float32, f1, f1, f2, f2, f2, f1))]


@njit(**JIT)
def _state_init(m, l, o, ng):
    d = o.shape[1]
    for hh in range(ng):
        m[hh] = -np.inf
        l[hh] = 0.0
        for i in range(d):
            o[hh, i] = 0.0


@njit(**JIT)
def _state_finish(l, o, ng, out):
    """``out[hh] = o[hh] / l[hh]`` (zeros for a head that attended no key, ``l == 0``; a NaN
    ``l`` -- a NaN or infinite score -- gives NaN rows, as the IEEE softmax does)."""
    d = o.shape[1]
    for hh in range(ng):
        inv = np.float32(1.0) / l[hh] if l[hh] != 0 else np.float32(0.0)
        for i in range(d):
            out[hh, i] = o[hh, i] * inv


@njit(**JIT)
def _merge_partials(pm, pl, po, n, h, out):
    """Combine ``n`` partial softmax states of head ``h`` (``pm/pl [n, H]``, ``po [n, H, D]``,
    disjoint key ranges) into ``out[D] = sum_t exp(m_t - M) o_t / sum_t exp(m_t - M) l_t``.
    A partial state that attended no key (``l == 0``) is skipped; one whose sum is NaN (a NaN or
    infinite score in its range) makes the row NaN, as the one-pass softmax does (``!= 0``
    rather than ``> 0`` lets NaN through: no extra work)."""
    d = out.shape[0]
    mx = np.float32(-np.inf)
    for t in range(n):
        if pl[t, h] != 0 and pm[t, h] > mx:
            mx = pm[t, h]
    for i in range(d):
        out[i] = 0.0
    tot = np.float32(0.0)
    for t in range(n):
        if pl[t, h] != 0:
            w = _exp_neg(pm[t, h] - mx)
            tot += w * pl[t, h]
            for i in range(d):
                out[i] += w * po[t, h, i]
    inv = np.float32(1.0) / tot if tot != 0 else np.float32(0.0)
    for i in range(d):
        out[i] *= inv


@njit(inline="always", **JIT)
def _attend_task(t, q, k_cache, v_cache, past_len, scale, is_causal, out):
    """Task ``t`` of ``B * KVH * ceil(S / QBLOCK)``: query rows ``s0 .. s0 + QBLOCK - 1`` (fewer
    at the end) of every head of kv head ``g`` (GQA: one pass over the kv head's keys/values
    serves its ``H/KVH`` query heads). The keys every row of the block attends -- the whole
    tiles below the first row's causal end, all keys without a mask -- run once for all the
    block's rows (their query heads gathered into one scratch), then each row its own last
    tiles: the tiles of a row are those of a pass of its own (``_attend_rows`` treats each head
    row alone), so its output is bitwise the same, and those keys are read once per block of
    rows instead of once per row."""
    b_n, s_n, h_n, d = q.shape
    kvh = k_cache.shape[1]
    group = h_n // kvh
    nsb = (s_n + QBLOCK - 1) // QBLOCK
    b = t // (kvh * nsb)
    rem = t - b * (kvh * nsb)
    g = rem // nsb
    s0 = (rem - g * nsb) * QBLOCK
    s1 = min(s_n, s0 + QBLOCK)
    nr = (s1 - s0) * group
    qg = np.empty((nr, d), np.float32)
    o = np.empty((nr, d), np.float32)
    m = np.empty(nr, np.float32)
    l = np.empty(nr, np.float32)
    sc = np.empty((nr, TILE + SLACK), np.float32)
    p = np.empty((nr, TILE + SLACK), np.float32)
    mx = np.empty(nr, np.float32)
    for s in range(s0, s1):
        for hh in range(group):
            qr = q[b, s, g * group + hh]
            dst = qg[(s - s0) * group + hh]
            for i in range(d):
                dst[i] = qr[i]
    _state_init(m, l, o, nr)
    kc = k_cache[b, g]
    vc = v_cache[b, g]
    # j0 an int64 variable (the decode step's type), not the literal 0: one specialisation of
    # _attend_rows serves both
    zero = np.int64(0)
    if is_causal:
        shared = np.int64((past_len + s0 + 1) // TILE * TILE)
    else:
        shared = np.int64(past_len + s_n)
    if shared > 0:
        _attend_rows(qg, nr, kc, vc, zero, shared, scale, m, l, o, sc, p, mx)
    for s in range(s0, s1):
        r0 = (s - s0) * group
        nkeys = past_len + s + 1 if is_causal else past_len + s_n
        if nkeys > shared:
            _attend_rows(qg[r0:r0 + group], group, kc, vc, shared, nkeys, scale,
                         m[r0:r0 + group], l[r0:r0 + group], o[r0:r0 + group], sc, p, mx)
        _state_finish(l[r0:r0 + group], o[r0:r0 + group], group,
                      out[b, s, g * group:(g + 1) * group])


@njit(**PJIT)
def _attention_par(q, k_cache, v_cache, past_len, scale, is_causal, out):
    b_n, s_n, h_n, d = q.shape
    for t in prange(b_n * k_cache.shape[1] * ((s_n + QBLOCK - 1) // QBLOCK)):
        _attend_task(t, q, k_cache, v_cache, past_len, scale, is_causal, out)


@njit(**JIT)
def _attention_ser(q, k_cache, v_cache, past_len, scale, is_causal, out):
    b_n, s_n, h_n, d = q.shape
    for t in range(b_n * k_cache.shape[1] * ((s_n + QBLOCK - 1) // QBLOCK)):
        _attend_task(t, q, k_cache, v_cache, past_len, scale, is_causal, out)


@njit(**PJIT)
def _append_kv_par(past, new, out):
    b_n, kvh, p, d = past.shape
    s_n = new.shape[1]
    for t in prange(b_n * kvh):
        b = t // kvh
        g = t - b * kvh
        for j in range(p):
            for i in range(d):
                out[b, g, j, i] = past[b, g, j, i]
        for j in range(s_n):
            for i in range(d):
                out[b, g, p + j, i] = new[b, j, g * d + i]


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, past_len: int,
              scale: float, is_causal: bool, out=None) -> np.ndarray:
    """Scaled dot-product attention of ``S`` new queries over a KV cache (GQA).

    Parameters
    ----------
    q : ndarray of float32, shape [B, S, H, D], C-contiguous
        Queries (the 3-D ONNX ``[B, S, H*D]`` input reshaped without copy).
    k_cache, v_cache : ndarray of float32, shape [B, KVH, T, D], C-contiguous
        Keys/values of the past tokens followed by the ``S`` new ones (ONNX ``present_key`` /
        ``present_value``). ``T >= past_len + S``; only the first ``past_len + S`` keys are read
        (so a larger capacity buffer may be passed). ``H % KVH == 0``.
    past_len : int
        Number of cached tokens before the new ones.
    scale : float
        Multiplies ``q . k`` (ONNX ``scale``; usually ``1/sqrt(D)``).
    is_causal : bool
        Bottom-right aligned causal mask: query ``i`` attends key ``j`` iff ``j <= past_len + i``.
        Otherwise every query attends all ``past_len + S`` keys.
    out : ndarray of float32, shape [B, S, H, D], optional

    Returns
    -------
    ndarray of float32, shape [B, S, H, D]
        ``softmax(q k^T * scale) v`` per head; ONNX output ``Y`` viewed as [B, S, H, D].
    """
    check_array(q, "q", dtype=np.float32, ndim=4)
    b, s, h, d = q.shape
    check_array(k_cache, "k_cache", dtype=np.float32, ndim=4)
    kvh, t = k_cache.shape[1], k_cache.shape[2]
    check_array(k_cache, "k_cache", dtype=np.float32, shape=(b, None, None, d))
    check_array(v_cache, "v_cache", dtype=np.float32, shape=(b, kvh, t, d))
    if kvh == 0 or h % kvh != 0:
        raise InvalidArgument(f"k_cache: expected a kv head count dividing the {h} query heads, "
                              f"got {kvh}")
    past_len = check_int(past_len, "past_len", lo=0)
    if past_len + s > t:
        raise InvalidArgument(f"past_len: expected past_len + S <= T = {t} (cache length), got "
                              f"past_len={past_len}, S={s}")
    try:
        sc = np.float32(scale)
    except (TypeError, ValueError):
        raise InvalidArgument(f"scale: expected a float, got {scale!r}") from None
    out = check_out(out, "out", np.float32, (b, s, h, d))
    if out.size:
        work = b * s * h * (past_len + s) * d
        if work >= ATTENTION_PARALLEL_WORK and b * kvh * ((s + QBLOCK - 1) // QBLOCK) > 1:
            _attention_par(q, k_cache, v_cache, past_len, sc, bool(is_causal), out)
        else:
            _attention_ser(q, k_cache, v_cache, past_len, sc, bool(is_causal), out)
    return out


def append_kv(cache_past: np.ndarray, new: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write ``concat(cache_past, new as [B, KVH, S, D], axis=2)`` into ``out``.

    The ``present_key``/``present_value`` computation of ONNX ``Attention`` (opset 23):
    ``new`` is the 3-D ``[B, S, KVH*D]`` key (or value) input, reshaped to ``[B, S, KVH, D]``
    and transposed to ``[B, KVH, S, D]``.

    Parameters
    ----------
    cache_past : ndarray of float32, shape [B, KVH, P, D], C-contiguous
    new : ndarray of float32, shape [B, S, KVH*D], C-contiguous
    out : ndarray of float32, shape [B, KVH, P+S, D], C-contiguous, allocated by the caller;
        must not overlap the inputs.

    Returns
    -------
    ndarray
        ``out``.
    """
    check_array(cache_past, "cache_past", dtype=np.float32, ndim=4)
    b, kvh, p, d = cache_past.shape
    check_array(new, "new", dtype=np.float32, ndim=3)
    check_array(new, "new", dtype=np.float32, shape=(b, None, kvh * d))
    s = new.shape[1]
    if out is None:
        raise InvalidArgument("out: expected a float32 array of shape "
                              f"[{b}, {kvh}, {p + s}, {d}], got None")
    check_out(out, "out", np.float32, (b, kvh, p + s, d))
    if np.may_share_memory(out, cache_past) or np.may_share_memory(out, new):
        raise InvalidArgument("out: expected a buffer not overlapping cache_past/new, got an "
                              "overlapping one")
    if out.size:
        _append_kv_par(cache_past, new, out)
    return out


@njit(**JIT)
def _kv_write_ser(cache, new, start):
    b_n, kvh, cap, d = cache.shape
    s_n = new.shape[1]
    for t in range(b_n * kvh):
        b = t // kvh
        g = t - b * kvh
        for j in range(s_n):
            for i in range(d):
                cache[b, g, start + j, i] = new[b, j, g * d + i]


def kv_write(cache: np.ndarray, new: np.ndarray, start: int) -> np.ndarray:
    """Write new keys (or values) into a KV capacity buffer at token position ``start``.

    Parameters
    ----------
    cache : ndarray of float32, shape [B, KVH, CAP, D], C-contiguous, writeable
        The capacity buffer (present tokens occupy ``[:, :, :start]``).
    new : ndarray of float32, shape [B, S, KVH*D], C-contiguous
        The ONNX 3-D K/V input of ``S`` new tokens.
    start : int
        First token slot written; ``start + S <= CAP``.

    Returns
    -------
    ndarray
        ``cache`` (slots ``[start, start + S)`` written, nothing else touched).
    """
    check_array(cache, "cache", dtype=np.float32, ndim=4)
    b, kvh, cap, d = cache.shape
    check_array(new, "new", dtype=np.float32, shape=(b, None, kvh * d))
    start = check_int(start, "start", lo=0)
    if start + new.shape[1] > cap:
        raise InvalidArgument(f"start: expected start + S <= capacity {cap}, got start={start}, "
                              f"S={new.shape[1]}")
    if not cache.flags.writeable:
        raise InvalidArgument("cache: expected a writeable buffer, got a read-only one")
    if new.shape[1]:
        _kv_write_ser(cache, new, start)
    return cache


@njit(**JIT)
def _rope_kv_ser(q, k, v, cos, sin, interleaved, rdim, kbuf, vbuf, start):
    """Rotate q [B,S,H,D] and k [B,S,KVH,D] in place, then write k, v into the KV buffers."""
    b_n, s_n = q.shape[0], q.shape[1]
    kvh, d = k.shape[2], k.shape[3]
    for b in range(b_n):
        for s in range(s_n):
            _rope_token(q[b, s], cos[b, s], sin[b, s], interleaved, rdim, q[b, s])
            _rope_token(k[b, s], cos[b, s], sin[b, s], interleaved, rdim, k[b, s])
            for g in range(kvh):
                for i in range(d):
                    kbuf[b, g, start + s, i] = k[b, s, g, i]
                    vbuf[b, g, start + s, i] = v[b, s, g, i]


def rope_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                   interleaved: bool, rotary_dim: int, kbuf: np.ndarray, vbuf: np.ndarray,
                   past_len: int, scale: float, is_causal: bool, out: np.ndarray) -> np.ndarray:
    """Decode/prefill attention block: RoPE on q and k (in place), KV append, attention.

    The same arithmetic as :func:`~.rope.rotary_embedding` + :func:`kv_write` +
    :func:`attention` in sequence, in two kernel calls. Shapes are checked by the caller
    (the fused session step validates them against the graph once per call shape).

    Parameters
    ----------
    q : float32 [B, S, H, D], C-contiguous, writeable (rotated in place)
    k : float32 [B, S, KVH, D], C-contiguous, writeable (rotated in place)
    v : float32 [B, S, KVH, D], C-contiguous
    cos, sin : float32 [B, S, rotary_dim/2], C-contiguous
    interleaved : bool
    rotary_dim : int
        Rotated features per head (even, <= D).
    kbuf, vbuf : float32 [B, KVH, CAP, D], C-contiguous
        Capacity buffers; slots ``[past_len, past_len + S)`` are written.
    past_len : int
    scale : float
    is_causal : bool
    out : float32 [B, S, H, D], C-contiguous

    Returns
    -------
    ndarray
        ``out``.
    """
    _rope_kv_ser(q, k, v, cos, sin, bool(interleaved), int(rotary_dim), kbuf, vbuf, int(past_len))
    b, s, h, d = q.shape
    sc = np.float32(scale)
    if (b * s * h * (past_len + s) * d >= ATTENTION_PARALLEL_WORK
            and b * kbuf.shape[1] * ((s + QBLOCK - 1) // QBLOCK) > 1):
        _attention_par(q, kbuf, vbuf, int(past_len), sc, bool(is_causal), out)
    else:
        _attention_ser(q, kbuf, vbuf, int(past_len), sc, bool(is_causal), out)
    return out
