"""One compiled forward of ``R`` rows from many sequences through a stack of decoder layers (the
batching engine's step; :mod:`.decoder_layers` is its one-token twin).

A step of :class:`olv_runtime.engine.Engine` runs decode rows of running sequences and chunks of
prompts together, each row at its own position of its own sequence, with the keys and values in
one pool of blocks shared by every sequence (:class:`olv_runtime.kv.block_pool.KVBlockPool`,
``[L, NB, KVH, BS, D]``). :func:`rows_forward` runs such a step in ONE numba parallel region of
``nt`` tasks that meet at a spin barrier (:mod:`.step_sync`) after each operator producing shared
data, as the one-token step does, instead of a Python call per operator (the engine's per-operator
rows program, :mod:`olv_runtime.executor.rows`, spends ~40 us of Python per operator call).

Per layer, ``x`` float32 [R, E] the rows' residual stream:

1. ``h = RMSNorm(x) * w_in`` for all R rows, privately in every task (int8 mode: each row
   quantized to int8 blocks, :func:`~.packed_i8.quantize_rows_i8`);
2. ``qkv = h @ Wqkv.T (+ bias)``: chunks of 8-row weight groups claimed by the tasks
   (:func:`~.decoder_layers._claim`), each chunk computing all R rows (the weights are read once
   per step: int8 :func:`~.packed_i8_gemm.groups_tiles`, VNNI or AVX2 tiles -- one row by the
   one-token step's group kernels, bitwise the same values; exact mode where
   the CPU has AVX-512 VNNI: the one-token step's kernels on the rows' fixed-point digits,
   :func:`~.packed_f32_vnni.groups_m1` for one row, :func:`~.packed_f32_vnni.groups_rows` for
   more (the same operations per output); else the float path :func:`~.packed_f32._groups8` /
   ``_groups_small``); barrier;
3. per row (rows split between the tasks): RoPE of its query heads (into ``q`` [R, H, D]) and key
   heads at the row's position, its key and value written into the pool at (``blocks[r]``,
   ``offsets[r]``) in the pool's format; barrier (when every row is its sequence's only row --
   decode rows -- no row reads another's keys: each task of step 4 does step 3 for its own
   (row, kv head) first, and this barrier goes);
4. attention: tasks claim (row, kv head) pairs; each runs the row's query heads of that kv head
   over blocks ``0 .. pos // BS`` of the row's table, one block after the other, with the tile
   function of the contiguous kernels (:func:`~.attention._attend_rows`); barrier;
5. ``x1 = attn @ Wo.T + x``; barrier; 6-7. ``h2 = RMSNorm(x1) * w_post`` (private), gate/up pairs
   of groups claimed with ``SiLU(g) * u`` on their rows; barrier; 8. ``x2 = a @ Wdown.T + x1``;
   barrier.

Then the rows that need logits (``lrows``): final norm (private), ``logits = . @ Wlm.T``;
barrier.

**Batch invariance.** Every output of a row is computed from that row's values only, by the same
serial functions whatever the number of rows, the tasks or which task runs what: the int8 and
exact group kernels give bitwise the same row for 1, 2, 4 or 8 rows per pass (their docstrings);
norm, quantization, RoPE, the KV write and SiLU are per row; a row's attention walks its own
blocks in order, one task per (row, kv head), never split. So a request's logits are bitwise the
same whatever else is in the step, however its prompt was chunked, and whichever blocks it got.
They agree with the one-token step and with the per-operator plan to float32 rounding (the
attention here is not split over the tasks; exact mode without VNNI runs the float path, the
one-token step there too), which the tests bound. Exact mode on a VNNI CPU runs the one-token
step's own linear kernels, so an engine of one sequence costs what ``generate`` does.

**Phase profile** (benchmarks only, bench/rows_phases.py): the tasks stamp the time-stamp
counter at the phase boundaries (:func:`~.step_sync._stamp`, the phases of
:data:`~.step_sync.PHASES`) when the barrier array is longer than the normal one; with the
normal array a stamp is one compare.

Arguments are bundles (named tuples, as :mod:`.step_buffers`): the step's rows
(:class:`RowBatch`), the workspace (:class:`RowsState`), the pool (:class:`PoolKV`), and the
one-token step's ``StepWeights`` / ``StepDims``.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, prange, types
from numba.core.extending import overload

from . import packed_f32, packed_f32_vnni, packed_i8, packed_i8_gemm
from .activations import silu_mul_chunk
from .attention import SLACK, TILE, _attend_rows, _state_finish, _state_init
from .config import JIT, PJIT
from .decoder_layers import (
    _chunk_units,
    _is_digits,
    _next_chunk,
    _paired_halves,
    _prefetch_head,
    _prefetch_part,
    _task_i8,
    _weight,
)
from .norm import _rms_norm_row
from .paged_ir import _f32_to_half
from .row_attention import _decode_block
from .step_buffers import StepDims, StepWeights
from .step_sync import _barrier, _stamp, barrier_slots

__all__ = ["RowBatch", "RowsState", "PoolKV", "RowsWorkspace", "rows_forward", "pool_bundle",
           "KV_FORMATS", "StepWeights", "StepDims"]

GROUP_ROWS = packed_i8.GROUP_ROWS
_OV = dict(fastmath=False, error_model="numpy")
# flags as module-level numpy bools (numba types them as plain booleans: one specialisation of
# _linear_rows, where literal True / False arguments would make one per combination)
_YES = np.bool_(True)
_NO = np.bool_(False)

#: pool storage dtypes the step writes and reads (float32, float16 bits, int8, two int4 per byte)
KV_FORMATS = ("float32", "float16", "int8", "int4")

RowBatch = namedtuple("RowBatch", [
    "x0",       # float32 [R, E]: the rows' embeddings
    "cos",      # float32 [R, rdim/2]: cos of each row's position
    "sin",      # float32 [R, rdim/2]
    "pos",      # int64 [R]: each row's position in its sequence
    "row_seq",  # int32 [R]: the row of ``tables`` (sequence) of each row
    "tables",   # int32 [S, MB]: block table per sequence
    "blocks",   # int64 [R]: pool block of each row's key/value
    "offsets",  # int64 [R]: row inside that block
    "lrows",    # int64 [n]: the rows whose logits are computed, in this order
    "logits",   # float32 [n, V] (written)
    "fused",    # bool: one row per sequence (decode rows only): each (row, kv head) task ropes,
                # writes and attends its own head with no barrier between (no row reads another's
                # keys); else step 3 for all rows, a barrier, then step 4
])

RowsState = namedtuple("RowsState", [
    "xa", "xb",  # float32 [Rmax, E]: the residual stream's two buffers
    "qkv",       # float32 [Rmax, N_qkv]
    "q",         # float32 [Rmax, H, D]: rotated queries
    "attn",      # float32 [Rmax, H, D]: attention output
    "attn2",     # float32 [Rmax, H*D]: the same memory
    "gu",        # float32 [Rmax, 2I]
    "act",       # float32 [Rmax, I]
    "hx",        # float32 [nt, Rmax, E]: per task, the normed rows
    "facc32",    # float32 [nt, 64]: per task, the exact kernels' accumulators
    "xl",        # float32 [nt, Rmax, E]: per task, the residual rows that need logits
])

PoolKV = namedtuple("PoolKV", [
    "k", "v",    # [L, NB, KVH, BS, D] float32 / uint16 (float16 bits) / int8; int4: uint8 [.., D/2]
    "ks", "vs",  # float32 [L, NB, KVH, BS]: per token scales (int8 / int4), else [1, 1, 1, 1]
    "qmax",      # int: 127 (int8), 7 (int4), 0 (float pools)
    "m", "l",    # float32 [nt, H/KVH]: per task, the softmax state of a kv head's query heads
    "sc", "pr",  # float32 [nt, H/KVH, TILE + SLACK]: per task, a tile's scores / probabilities
    "mx",        # float32 [nt, H/KVH]
    "kb", "vb",  # float32 [nt, BS, D]: per task, one decoded block (encoded pools)
    "kr",        # float32 [nt, D]: per task, a key/value row before it is encoded
])


# ------------------------------------------------------------------------------------------------
# mode-dependent pieces (chosen by the type of the activation buffers: None = exact mode)
# ------------------------------------------------------------------------------------------------
def _quantize_rows(i8, xin, m, k, kb):
    """int8 mode: ``xin[:m, :k]`` quantized into this task's buffers; exact mode on the VNNI
    path: their activation digits (:func:`~.packed_f32_vnni.digits_rows`; a row holding a
    non-finite value gets NaN outputs, as in the one-token step); exact float path: nothing."""


@overload(_quantize_rows, jit_options=_OV)
def _ov_quantize_rows(i8, xin, m, k, kb):
    if isinstance(i8, types.NoneType):
        def impl(i8, xin, m, k, kb):
            pass
    elif _is_digits(i8):
        def impl(i8, xin, m, k, kb):
            dg, bz, xsc = i8
            packed_f32_vnni.digits_rows(xin, m, k, dg, bz, xsc)
    else:
        def impl(i8, xin, m, k, kb):
            xq, xd, xs8, facc8 = i8
            packed_i8.quantize_rows_i8(xin, m, k, kb, xq, xd, xs8)
    return impl


def _groups_rows(i8, codes, scale, xin, m, out, facc32, vnni, g0, g1):
    """8-row weight groups ``[g0, g1)`` of ``out[:m] = xin[:m] @ W.T``."""


@overload(_groups_rows, jit_options=_OV)
def _ov_groups_rows(i8, codes, scale, xin, m, out, facc32, vnni, g0, g1):
    if isinstance(i8, types.NoneType):
        def impl(i8, codes, scale, xin, m, out, facc32, vnni, g0, g1):
            n = out.shape[1]
            if m >= 8:
                packed_f32._groups8(codes, scale, g0, g1, xin, m, n, out, facc32)
            else:
                packed_f32._groups_small(codes, scale, g0, g1, xin, np.int64(0), m, n, out,
                                         facc32)
    elif _is_digits(i8):
        # one row: the one-token step's kernel (4 groups per pass for long rows); more: pairs
        # of groups, 4 rows per pass -- the same operations per output, so a row's values do
        # not depend on m (packed_f32_vnni's docstring)
        def impl(i8, codes, scale, xin, m, out, facc32, vnni, g0, g1):
            dg, bz, xsc = i8
            n = out.shape[1]
            if m == 1:
                packed_f32_vnni.groups_m1(codes, scale, g0, g1, dg, bz, xsc, n, out, facc32)
            else:
                packed_f32_vnni.groups_rows(codes, scale, g0, g1, m, dg, bz, xsc, n, out,
                                            facc32)
    else:
        def impl(i8, codes, scale, xin, m, out, facc32, vnni, g0, g1):
            xq, xd, xs8, facc8 = i8
            packed_i8_gemm.groups_tiles(codes, scale, g0, g1, xq, xd, xs8, m, out.shape[1],
                                        out, facc8, vnni)
    return impl


# ------------------------------------------------------------------------------------------------
# operators
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _linear_rows(tid, nt, i8, codes, scale, xin, m, out, facc32, vnni, bar, add, addv, brow):
    """This task's chunks of ``out[:m] = xin[:m] @ W.T``; ``add``: then ``+ addv[i]`` on every row
    (``brow``: ``addv`` has one row, the bias, added to every row; else the residual row ``i``)."""
    ng = codes.shape[0]
    n = out.shape[1]
    step = _chunk_units(codes, 1)
    r = tid
    while True:
        g0, g1, r = _next_chunk(bar, nt, ng, step, r)
        if g0 < 0:
            break
        _groups_rows(i8, codes, scale, xin, m, out, facc32, vnni, g0, g1)
        if add:
            j1 = min(g1 * GROUP_ROWS, n)
            for i in range(m):
                src = addv[0] if brow else addv[i]
                for j in range(g0 * GROUP_ROWS, j1):
                    out[i, j] = out[i, j] + src[j]


@njit(**JIT)
def _norm_rows(x, m, w, eps, h):
    for i in range(m):
        _rms_norm_row(x[i], w, eps, h[i])


@njit(**JIT)
def _rope_row(src, dst, cos, sin, interleaved, rdim):
    """``dst = RoPE(src)`` of one head (float32 [D]; the expressions of rope._rope_token);
    dimensions from ``rdim`` on are copied."""
    half = rdim // 2
    d = src.shape[0]
    if interleaved:
        for i in range(half):
            x1 = src[2 * i]
            x2 = src[2 * i + 1]
            dst[2 * i] = cos[i] * x1 - sin[i] * x2
            dst[2 * i + 1] = sin[i] * x1 + cos[i] * x2
    else:
        for i in range(half):
            x1 = src[i]
            x2 = src[half + i]
            dst[i] = cos[i] * x1 - sin[i] * x2
            dst[half + i] = sin[i] * x1 + cos[i] * x2
    for i in range(rdim, d):
        dst[i] = src[i]


def _store(kv, li, blk, g, off, row, side):
    """Row ``row`` float32 [D] into the pool's key (side 0) or value (side 1) slot
    (``li, blk, g, off``), in the pool's format."""


@overload(_store, jit_options=_OV)
def _ov_store(kv, li, blk, g, off, row, side):
    dt = kv.types[0].dtype
    if dt == types.float32:
        def f32(kv, li, blk, g, off, row, side):
            dst = kv.k[li, blk, g, off] if side == 0 else kv.v[li, blk, g, off]
            for i in range(row.shape[0]):
                dst[i] = row[i]
        return f32
    if dt == types.uint16:
        def f16(kv, li, blk, g, off, row, side):
            dst = kv.k[li, blk, g, off] if side == 0 else kv.v[li, blk, g, off]
            for i in range(row.shape[0]):
                dst[i] = _f32_to_half(row[i])
        return f16

    # int8 / int4: the operations of row_attention.quantize_rows (scale = max|x| / qmax, 1 for a
    # zero row; q = rint(x / scale) clipped), int4 stored as q + 8, two per byte
    def enc(kv, li, blk, g, off, row, side):
        qmax = np.float32(kv.qmax)
        amax = np.float32(0.0)
        for i in range(row.shape[0]):
            a = abs(row[i])
            if a > amax or a != a:
                amax = a
        s = amax / qmax
        if s == 0:
            s = np.float32(1.0)
        dst = kv.k[li, blk, g, off] if side == 0 else kv.v[li, blk, g, off]
        if side == 0:
            kv.ks[li, blk, g, off] = s
        else:
            kv.vs[li, blk, g, off] = s
        if kv.qmax == 7:
            for i in range(row.shape[0] // 2):
                a = np.int32(min(max(np.rint(row[2 * i] / s), -qmax), qmax)) + 8
                b = np.int32(min(max(np.rint(row[2 * i + 1] / s), -qmax), qmax)) + 8
                dst[i] = np.uint8(a | (b << 4))
        else:
            for i in range(row.shape[0]):
                dst[i] = np.int8(min(max(np.rint(row[i] / s), -qmax), qmax))
    return enc


def _attend(kv, tid, li, qg, group, blk, n, scale, o, m, l, sc, pr, mx, g):
    """Keys/values ``0..n`` of block ``blk`` (kv head ``g``) into the softmax state."""


@overload(_attend, jit_options=_OV)
def _ov_attend(kv, tid, li, qg, group, blk, n, scale, o, m, l, sc, pr, mx, g):
    zero = np.int64(0)
    if kv.types[0].dtype == types.float32:
        def f32(kv, tid, li, qg, group, blk, n, scale, o, m, l, sc, pr, mx, g):
            _attend_rows(qg, group, kv.k[li, blk, g], kv.v[li, blk, g], zero, n, scale, m, l, o,
                         sc, pr, mx)
        return f32

    def enc(kv, tid, li, qg, group, blk, n, scale, o, m, l, sc, pr, mx, g):
        kb, vb = kv.kb[tid], kv.vb[tid]
        _decode_block(kv.k[li], kv.ks[li], blk, g, n, kb)
        _decode_block(kv.v[li], kv.vs[li], blk, g, n, vb)
        _attend_rows(qg, group, kb, vb, zero, n, scale, m, l, o, sc, pr, mx)
    return enc


@njit(**JIT)
def _rope_write_head(tid, r, g, li, batch, rs, dims, kv):
    """Step 3 for row ``r`` and kv head ``g``: its query heads rotated into ``rs.q``, its key
    rotated and its value written into the pool."""
    n_heads, n_kv, d = dims.n_heads, dims.n_kv, dims.d
    group = n_heads // n_kv
    hd = n_heads * d
    kr = kv.kr[tid]
    row = rs.qkv[r]
    cs, sn = batch.cos[r], batch.sin[r]
    for hh in range(g * group, (g + 1) * group):
        _rope_row(row[hh * d:(hh + 1) * d], rs.q[r, hh], cs, sn, dims.interleaved, dims.rdim)
    blk, off = batch.blocks[r], batch.offsets[r]
    k0 = hd + g * d
    _rope_row(row[k0:k0 + d], kr, cs, sn, dims.interleaved, dims.rdim)
    _store(kv, li, blk, g, off, kr, 0)
    v0 = hd + n_kv * d + g * d
    for i in range(d):
        kr[i] = row[v0 + i]
    _store(kv, li, blk, g, off, kr, 1)


@njit(**JIT)
def _rope_write_rows(tid, nt, r_n, li, batch, rs, dims, kv):
    """Step 3 for this task's rows (every kv head)."""
    for r in range(tid * r_n // nt, (tid + 1) * r_n // nt):
        for g in range(dims.n_kv):
            _rope_write_head(tid, r, g, li, batch, rs, dims, kv)


@njit(**JIT)
def _attention_rows(tid, nt, r_n, li, batch, rs, dims, kv, bar):
    """Step 4: this task's claimed (row, kv head) pairs."""
    n_kv = dims.n_kv
    group = dims.n_heads // n_kv
    bs = kv.k.shape[3]
    m, l, sc, pr, mx = kv.m[tid], kv.l[tid], kv.sc[tid], kv.pr[tid], kv.mx[tid]
    n_tasks = r_n * n_kv
    c = tid
    while True:
        t0, t1, c = _next_chunk(bar, nt, n_tasks, np.int64(1), c)
        if t0 < 0:
            break
        for task in range(t0, t1):
            r = task // n_kv
            g = task - r * n_kv
            if batch.fused:
                _rope_write_head(tid, r, g, li, batch, rs, dims, kv)
            p = batch.pos[r]
            tab = batch.tables[batch.row_seq[r]]
            o = rs.attn[r, g * group:(g + 1) * group]
            qg = rs.q[r, g * group:(g + 1) * group]
            _state_init(m, l, o, group)
            for b in range(p // bs + 1):
                n = np.int64(min(bs, p + 1 - b * bs))
                _attend(kv, tid, li, qg, group, np.int64(tab[b]), n, dims.att_scale, o, m, l,
                        sc, pr, mx, g)
            _state_finish(l, o, group, o)


@njit(**JIT)
def _prefetch_gate_up(tid, nt, wt, w, codes0, scale0, inter):
    """:func:`_prefetch_head` where this task's first claim of :func:`_gate_up_rows` starts:
    its gate and its up group of pair ``tid * gh / nt`` (the whole linear's share when the
    halves are not paired)."""
    cw, sw = _weight(wt, w, codes0, scale0)
    ng = cw.shape[0]
    gh = ng // 2
    if _paired_halves(inter, ng):
        a0 = tid * gh // nt
        _prefetch_head(cw, sw, a0)
        _prefetch_head(cw, sw, gh + a0)
    else:
        _prefetch_head(cw, sw, tid * ng // nt)


@njit(**JIT)
def _gate_up_rows(tid, nt, i8, cw, sw, h, m, rs, inter, f32, vnni, bar):
    """Gate and up groups as pairs (when no group straddles the halves) with ``SiLU(g) * u`` on
    the chunk's rows; else the whole linear, a barrier and the product over this task's rows."""
    gu, act = rs.gu, rs.act
    ng = cw.shape[0]
    gh = ng // 2
    if _paired_halves(inter, ng):
        step = _chunk_units(cw, 2)
        r = tid
        while True:
            p0, p1, r = _next_chunk(bar, nt, gh, step, r)
            if p0 < 0:
                break
            _groups_rows(i8, cw, sw, h, m, gu, f32, vnni, p0, p1)
            _groups_rows(i8, cw, sw, h, m, gu, f32, vnni, gh + p0, gh + p1)
            j0, j1 = p0 * GROUP_ROWS, p1 * GROUP_ROWS
            for i in range(m):
                silu_mul_chunk(gu[i, j0:j1], gu[i, inter + j0:inter + j1], act[i, j0:j1])
    else:
        _linear_rows(tid, nt, i8, cw, sw, h, m, gu, f32, vnni, bar, _NO, gu, _NO)
        _barrier(bar, nt)
        j0, j1 = tid * inter // nt, (tid + 1) * inter // nt
        for i in range(m):
            silu_mul_chunk(gu[i, j0:j1], gu[i, inter + j0:inter + j1], act[i, j0:j1])


# ------------------------------------------------------------------------------------------------
# the per-task program and the drivers
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _rows_thread(tid, nt, r_n, batch, bar, i8ws, w, dims, rs, kv):
    """Task ``tid``'s program of one step of ``r_n`` rows (the module docstring's steps)."""
    n_layers = kv.k.shape[0]
    e = rs.xa.shape[1]
    hd = dims.n_heads * dims.d
    inter, vnni = dims.inter, dims.vnni
    wt, codes0, scale0 = w.wt, w.codes0, w.scale0
    i8 = _task_i8(i8ws, tid)
    f32 = rs.facc32[tid]
    h = rs.hx[tid]
    x = batch.x0
    nxt = 0
    _stamp(bar, tid, nt, np.int64(-1))  # phase profile (benchmarks only): the start
    for li in range(n_layers):
        wi = 4 * li
        # 1-2: norm (private), q/k/v (+ bias)
        _norm_rows(x, r_n, w.norms[2 * li], w.eps, h)
        cw, sw = _weight(wt, wi, codes0, scale0)
        _quantize_rows(i8, h, r_n, e, cw.shape[1])
        _stamp(bar, tid, nt, np.int64(0))
        _linear_rows(tid, nt, i8, cw, sw, h, r_n, rs.qkv, f32, vnni, bar, w.has_bias[li],
                     w.biases[li:li + 1], _YES)
        _prefetch_part(tid, nt, wt, wi + 1, codes0, scale0)
        _stamp(bar, tid, nt, np.int64(1))
        _barrier(bar, nt)
        _stamp(bar, tid, nt, np.int64(2))
        # 3: RoPE, KV write; 4: attention (fused per (row, kv head) when rows are decode rows)
        if not batch.fused:
            _rope_write_rows(tid, nt, r_n, li, batch, rs, dims, kv)
            _stamp(bar, tid, nt, np.int64(3))
            _barrier(bar, nt)
            _stamp(bar, tid, nt, np.int64(4))
        _attention_rows(tid, nt, r_n, li, batch, rs, dims, kv, bar)
        _stamp(bar, tid, nt, np.int64(3))
        _barrier(bar, nt)
        _stamp(bar, tid, nt, np.int64(4))
        # 5: output projection + residual
        xn = rs.xa if nxt == 0 else rs.xb
        cw, sw = _weight(wt, wi + 1, codes0, scale0)
        _quantize_rows(i8, rs.attn2, r_n, hd, cw.shape[1])
        _linear_rows(tid, nt, i8, cw, sw, rs.attn2, r_n, xn, f32, vnni, bar, _YES, x, _NO)
        _prefetch_gate_up(tid, nt, wt, wi + 2, codes0, scale0, inter)
        _stamp(bar, tid, nt, np.int64(6))
        _barrier(bar, nt)
        _stamp(bar, tid, nt, np.int64(7))
        x = xn
        nxt = 1 - nxt
        # 6-7: post norm (private), gate/up, SiLU * up
        _norm_rows(x, r_n, w.norms[2 * li + 1], w.eps, h)
        cw, sw = _weight(wt, wi + 2, codes0, scale0)
        _quantize_rows(i8, h, r_n, e, cw.shape[1])
        _stamp(bar, tid, nt, np.int64(8))
        _gate_up_rows(tid, nt, i8, cw, sw, h, r_n, rs, inter, f32, vnni, bar)
        _prefetch_part(tid, nt, wt, wi + 3, codes0, scale0)
        _stamp(bar, tid, nt, np.int64(9))
        _barrier(bar, nt)
        _stamp(bar, tid, nt, np.int64(10))
        # 8: down + residual
        xn = rs.xa if nxt == 0 else rs.xb
        cw, sw = _weight(wt, wi + 3, codes0, scale0)
        _quantize_rows(i8, rs.act, r_n, inter, cw.shape[1])
        _linear_rows(tid, nt, i8, cw, sw, rs.act, r_n, xn, f32, vnni, bar, _YES, x, _NO)
        _prefetch_part(tid, nt, wt, wi + 4, codes0, scale0)
        _stamp(bar, tid, nt, np.int64(11))
        _barrier(bar, nt)
        _stamp(bar, tid, nt, np.int64(12))
        x = xn
        nxt = 1 - nxt
    # the rows that need logits: final norm (private), lm_head
    n_l = batch.lrows.shape[0]
    if n_l > 0:
        xl = rs.xl[tid]
        for i in range(n_l):
            src = x[batch.lrows[i]]
            for j in range(e):
                xl[i, j] = src[j]
        _norm_rows(xl, n_l, w.norms[2 * n_layers], w.eps, h)
        cw, sw = _weight(wt, 4 * n_layers, codes0, scale0)
        _quantize_rows(i8, h, n_l, e, cw.shape[1])
        _linear_rows(tid, nt, i8, cw, sw, h, n_l, batch.logits, f32, vnni, bar, _NO,
                     batch.logits, _NO)
    _stamp(bar, tid, nt, np.int64(13))
    _barrier(bar, nt)
    _stamp(bar, tid, nt, np.int64(14))


@njit(**JIT)
def indices_ok(pos, row_seq, tables, blocks, offsets, logit_rows, n_blocks, bs):
    """True when every index of a step is inside its range (positions within the block table,
    ``row_seq`` rows of ``tables``, pool blocks ``< n_blocks``, offsets ``< bs``, logit rows
    ``< len(pos)``): the compiled step indexes without bounds checks. One pass instead of a
    dozen numpy reductions per step (the caller explains a False with those)."""
    r = pos.shape[0]
    mb = tables.shape[1]
    for i in range(r):
        if pos[i] < 0 or pos[i] // bs >= mb or row_seq[i] < 0 or row_seq[i] >= tables.shape[0]:
            return False
        if blocks[i] < 0 or blocks[i] >= n_blocks or offsets[i] < 0 or offsets[i] >= bs:
            return False
    for s in range(tables.shape[0]):
        for j in range(mb):
            if tables[s, j] < 0 or tables[s, j] >= n_blocks:
                return False
    for i in range(logit_rows.shape[0]):
        if logit_rows[i] < 0 or logit_rows[i] >= r:
            return False
    return True


@njit(**PJIT)
def _rows_par(nt, r_n, batch, bar, i8ws, w, dims, rs, kv):
    """The parallel entry: one region of ``nt`` tasks, each :func:`_rows_thread`."""
    for tid in prange(nt):
        _rows_thread(np.int64(tid), nt, r_n, batch, bar, i8ws, w, dims, rs, kv)


# ------------------------------------------------------------------------------------------------
# workspace and the Python entry
# ------------------------------------------------------------------------------------------------
class RowsWorkspace:
    """Buffers of :func:`rows_forward` for ``nt`` tasks and up to ``r_max`` rows (allocated once;
    a call allocates nothing). ``e`` hidden size, ``n_qkv`` q/k/v width, ``h, kvh, d`` heads,
    ``inter`` the MLP width, ``k_max`` the widest linear input, ``bs`` the pool's block size."""

    def __init__(self, nt, r_max, e, n_qkv, h, kvh, d, inter, k_max, bs):
        f = np.float32
        kp = 32 * (-(-k_max // 32))
        kb = kp // 32
        self.nt, self.r_max = nt, r_max
        ts = packed_i8.task_scratch  # per-task scratch: cache lines of its own
        attn = np.zeros((r_max, h, d), f)
        self.rs = RowsState(np.zeros((r_max, e), f), np.zeros((r_max, e), f),
                            np.zeros((r_max, n_qkv), f), np.zeros((r_max, h, d), f), attn,
                            attn.reshape(r_max, h * d), np.zeros((r_max, 2 * inter), f),
                            np.zeros((r_max, inter), f), np.zeros((nt, r_max, e), f),
                            ts(nt, (packed_f32.ROWS_MAX * GROUP_ROWS,), f),
                            np.zeros((nt, r_max, e), f))
        xq = packed_i8.aligned_empty((nt, r_max, kp), np.int8)
        xq[...] = 0
        self.i8 = (xq, np.zeros((nt, r_max, kb), f), np.zeros((nt, r_max, kb), np.int32),
                   ts(nt, (1, GROUP_ROWS), f))
        g = h // kvh
        # the decoded key/value blocks keep their shape (RowsProgram checks it)
        self.att = (ts(nt, (g,), f), ts(nt, (g,), f), ts(nt, (g, TILE + SLACK), f),
                    ts(nt, (g, TILE + SLACK), f), ts(nt, (g,), f), ts(nt, (bs, d), f, pad=False),
                    ts(nt, (bs, d), f, pad=False), ts(nt, (d,), f, pad=False))
        self.bar = np.zeros(barrier_slots(nt), np.int64)
        self._kb = kb
        self._digits = None

    def digit_buffers(self) -> tuple:
        """Exact mode's activation digits per task, ``(dg int8 [nt, r_max, 128 kb], bz int32
        [nt, r_max, 4 kb], xsc float32 [nt, r_max, kb])`` (:mod:`.packed_f32_vnni`), made at
        the first exact-mode call on the VNNI path."""
        if self._digits is None:
            nt, r = self.nt, self.r_max
            self._digits = tuple(a.reshape((nt, r) + a.shape[1:]) for a in
                                 packed_f32_vnni.digit_buffers(nt * r, self._kb))
        return self._digits

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.rs if a.base is None) + sum(
            a.nbytes for a in self.i8) + sum(a.nbytes for a in self.att) + self.bar.nbytes
            + sum(a.nbytes for a in self._digits or ()))


_NO_SCALE = np.ones((1, 1, 1, 1), np.float32)


def pool_bundle(pool, ws: RowsWorkspace) -> PoolKV:
    """The :class:`PoolKV` of a :class:`~olv_runtime.kv.block_pool.KVBlockPool` with the
    workspace's attention scratch."""
    qmax = {"int8": 127, "int4": 7}.get(pool.kv_dtype, 0)
    ks = pool.k_scale if pool.k_scale is not None else _NO_SCALE
    vs = pool.v_scale if pool.v_scale is not None else _NO_SCALE
    return PoolKV(pool.k, pool.v, ks, vs, qmax, *ws.att)


def rows_forward(nt: int, quant: bool, batch: RowBatch, ws: RowsWorkspace, kv: PoolKV, weights,
                 dims) -> np.ndarray:
    """Run ``R = len(batch.pos)`` rows through every layer and the lm_head of the logit rows.

    Parameters
    ----------
    nt : int
        Tasks (1: the serial program; > 1 only with the ``omp`` threading layer).
    quant : bool
        int8 activations (:mod:`.packed_i8`) or exact (float32 activations: the digits of
        :mod:`.packed_f32_vnni` where ``dims.vnni``, else :mod:`.packed_f32`).
    batch : RowBatch
        The step's rows (shapes beside its fields); ``R <= ws.r_max``, ``batch.logits`` float32
        ``[len(lrows), V]`` written.
    ws : RowsWorkspace
    kv : PoolKV
        The pool (:func:`pool_bundle`).
    weights : StepWeights; dims : StepDims
        As the one-token step's (:mod:`.step_buffers`).

    Returns
    -------
    ``batch.logits``.

    The caller (:class:`olv_runtime.executor.rows.RowsProgram`) checks the shapes; the tables and
    positions are the engine's own.
    """
    r_n = np.int64(batch.pos.shape[0])
    i8ws = ws.i8 if quant else (ws.digit_buffers() if dims.vnni else None)
    if nt > 1:
        _rows_par(nt, r_n, batch, ws.bar, i8ws, weights, dims, ws.rs, kv)
    else:
        _rows_thread(np.int64(0), np.int64(1), r_n, batch, ws.bar, i8ws, weights, dims, ws.rs,
                     kv)
    return batch.logits
