"""One compiled decode step for a stack of pre-norm transformer layers (M = 1).

ggml's way of running a graph: one pool of threads walks every operator of the step, with a
barrier between operators, instead of a Python call (and a parallel-region start) per operator.
:func:`decode_stack` opens ONE numba parallel region of ``nt`` tasks (``nt`` <= the threads of
the ``omp`` layer, so every task runs on its own thread at once); each task runs
:func:`_stack_thread` over every layer and meets the others at a spin barrier (atomic counter and
generation in an int64 array, ``pause`` while waiting) after each operator that produces shared
data.

Per layer (the Qwen2/Llama decoder layer; ``x`` is the residual stream, float32 [E]):

1. ``h = RMSNorm(x) * w_in`` -- every thread computes it privately (E floats, no barrier), and in
   int8 mode quantizes it privately (:func:`~.packed_i8._quantize_rows_i8`; exact mode on the
   VNNI path: its block fixed-point digits, :func:`~.packed_f32_vnni._digits_rows`);
2. ``qkv = h @ Wqkv.T (+ bias)`` -- chunks of 8-row groups claimed by the tasks
   (:func:`_claim`: each task starts with its own share, then takes what is left of the
   others'; :func:`~.packed_i8._groups` int8; exact: :func:`~.packed_f32_vnni._groups_m1` on
   activation digits where the CPU has VNNI, else :func:`~.packed_f32._groups_m1`); barrier;
3. RoPE of q (every task into its private copy) and k (non-interleaved or interleaved halves,
   ``rotary_dim``) -- Qwen3 first RMS-normalises each query head (into the private copy) and
   each key head (in place) with the layer's q / k norm weights (:func:`_queries`,
   :func:`_key_norm`: the per-operator plan's :func:`~.norm._rms_norm_row`, so the heads are
   bitwise the plan's); the last task, whose share of the keys ends with the new one, writes k and
   v into slot ``t`` of the layer's capacity buffers (no other task reads that slot: no
   barrier);
4. attention over ``t + 1`` keys (:func:`~.attention._attend_rows`: one pass per kv head for all
   its query heads, 64-key tiles, online softmax): each task takes its share of the keys of every
   kv head (flash-decoding split); barrier; each task merges the partial softmax states into its
   private copy of the attention output (:func:`~.attention._merge_partials`);
5. ``x1 = attn @ Wo.T + x`` (groups claimed, residual added per row); barrier;
6. ``h2 = RMSNorm(x1) * w_post`` (private), ``gu = h2 @ Wgu.T`` (gate rows then up rows): a
   claimed chunk is the same 8-row groups of the gate half and of the up half (when ``inter``
   is a multiple of 8; otherwise the groups are claimed over the whole and a barrier follows);
7. ``a = g * sigmoid(g) * u`` on the chunk's rows (same operations as the unfused SiLU:
   ``1 / (1 + exp(-g))``, then two products; ``exp`` is :func:`~.activations.expf`, bitwise
   libm's, in a vector loop); barrier;
8. ``x2 = a @ Wdown.T + x1`` (groups claimed); barrier.

After the last layer: ``RMSNorm(x) * w_final`` (private), ``logits = . @ Wlm.T`` (groups
claimed), a last barrier (it resets the claim offsets for the next call). Five barriers per
layer. Every linear's groups are claimed in chunks (:func:`_claim`), so a task delayed by the
machine (another process on its core) or by slower memory no longer makes the others wait at
the barrier for its fixed share; which task computes a row never changes the row's result. Before each, a task prefetches the first 2 KiB of its share of the
next weight (the group loop's own prefetch runs that far ahead of the stream, so a linear's
start would otherwise wait for DRAM after the barrier).

The arithmetic of every operator is that of the generic kernels (same serial functions or the
same expressions), so the logits agree with the per-operator plan to float32 rounding (the SiLU
``exp`` is libm's here and numpy's SIMD exp in the plan; attention's dot products may be
vectorised differently): the tests bound the difference and require identical greedy tokens.

Workspace (:class:`StackWorkspace`) is allocated once per (session, thread); a call allocates
nothing.

Weights (:class:`~.step_buffers.WeightTable`). Each linear (qkv, o, gate_up, down per layer, the
lm_head) is one or more *parts* whose output rows follow each other: olv's INT4 8-row groups
(kind 0) or the ggml group records of a GGUF Q8_0 / Q5_0 / Q4_1 / Q5_1 / Q4_K / Q5_K / Q6_K
tensor (kind = its ggml type id), mixed per tensor as llama.cpp's Q4_K_M files mix them (q|k
Q5_0 and v Q8_0 in one linear; Q4_0 tensors are INT4 parts). ``wt`` has a row per part
(addresses, groups, records, kind, first group in the linear, rows), ``wl`` a row per linear
(first part, parts, groups, bytes per group). A linear's groups are numbered across its parts,
claimed as one range (:func:`_claim`), and each claimed chunk runs every part's share with the
part's kernel (:func:`_lin_groups`: the kind read from the table at run time, a branch per part
and chunk;
ggml parts through :mod:`.step_ggml`, the plan's own serial group functions at one row, so each
row is bitwise the per-operator plan's). One quantization of each norm output serves both
kinds (ggml's int8 mode quantizes with the same :func:`~.packed_i8.quantize_rows_i8`), plus the
per-16 / per-32 sums Q6_K / the kinds with mins read (:func:`~.step_ggml.ggml_sums`).

Arguments (:mod:`.step_buffers`, as llama2.c's ``RunState``): the weights, the dimensions, the
activations and the attention scratch arrive as four named tuples (``StepWeights``,
``StepDims``, ``RunState``, ``AttState``; each field's shape and dtype are written beside it),
the KV cache as a fifth: ``KVContig`` (capacity buffers) or ``KVPaged`` (block tables). One
driver serves both caches: they differ only in step 3's write and step 4's share of the keys
(:func:`_kv_write`, :func:`_kv_attend`: overloads chosen by the KV bundle's type when the step
compiles, so a session compiles the one its model uses). The barrier, the atomics and the
phase stamps live in :mod:`.step_sync`.

Compile cost (cold start, issue 14): how the program is kept to what a session compiles, with
the measurements, is in docs/architecture.md, "The compiled decode step's compile cost".
"""
from __future__ import annotations

import inspect

import numpy as np
from numba import carray, njit, prange, types
from numba.core.extending import overload
from numba.core.typing.typeof import Purpose, typeof

from olv_runtime.kernels.attention import shared_entries
from olv_runtime.kernels.rope import _rope_token

from . import packed_f32, packed_f32_vnni, packed_i8
from . import paged_attention as pk
from .attention import SLACK, _attend_rows, _merge_partials, _state_init
from .activations import silu_mul_chunk
from .config import JIT, PJIT
from .norm import _rms_norm_row
from .paged_attention import Int8Query, SoftmaxState, TileScratch, _attend_blocks
from .step_buffers import (
    L_GB,
    L_NG,
    L_NP,
    L_P0,
    W_G0,
    W_KIND,
    W_N,
    W_NG,
    AttState,
    KVContig,
    KVPaged,
    RunState,
    StackWorkspace,
    StepDims,
    StepWeights,
    WeightTable,
)
from .step_ggml import ggml_groups, ggml_prefetch, ggml_sums, task_ggml
from .step_sync import (
    BARRIER_SLOTS,
    PHASES,
    PROF_SLOTS,
    WORK_SLOTS,
    _atomic_add,
    _atomic_load,
    _barrier,
    _stamp,
    _view,
    address,
    barrier_slots,
    cycles_now,
)

__all__ = ["decode_stack", "decode_stack_paged", "prepared_call", "precompile_entries",
           "decode_stack_entry", "StackWorkspace", "WeightTable", "address", "barrier_slots",
           "cycles_now", "BARRIER_SLOTS", "PROF_SLOTS", "PHASES"]

GROUP_ROWS = packed_i8.GROUP_ROWS
GROUP_BLOCK_BYTES = packed_i8.GROUP_BLOCK_BYTES
_OV = dict(fastmath=False, error_model="numpy")  # the JIT flags overload implementations take


# ------------------------------------------------------------------------------------------------
# the per-thread program
# ------------------------------------------------------------------------------------------------
def _linear_groups(i8, codes, scale, xin, out, facc32, vnni, g0, g1):
    """8-row groups ``[g0, g1)`` of ``out[0, :] = xin[0, :] @ W.T``. ``i8``: None (exact mode,
    float path, :mod:`.packed_f32`), this task's activation digits ``(dg, bz, xsc)`` (exact
    mode, VNNI path, :mod:`.packed_f32_vnni`) or its int8 quantization ``(xq, xd, xs8, facc8)``
    of ``xin`` (both made by :func:`_quantize`).

    The mode is chosen by the *type* of ``i8`` when numba compiles the caller (an ``overload``),
    so a session compiles the kernels of its own mode only, never both (cold start)."""


def _is_digits(i8):
    return isinstance(i8, types.BaseTuple) and len(i8) == 3


@overload(_linear_groups, jit_options=_OV)
def _ov_linear_groups(i8, codes, scale, xin, out, facc32, vnni, g0, g1):
    if isinstance(i8, types.NoneType):
        def impl(i8, codes, scale, xin, out, facc32, vnni, g0, g1):
            packed_f32._groups_m1(codes, scale, g0, g1, xin, out.shape[1], out, facc32)
    elif _is_digits(i8):
        def impl(i8, codes, scale, xin, out, facc32, vnni, g0, g1):
            dg, bz, xsc = i8
            packed_f32_vnni._groups_m1(codes, scale, g0, g1, dg, bz, xsc, out.shape[1], out,
                                       facc32)
    else:
        def impl(i8, codes, scale, xin, out, facc32, vnni, g0, g1):
            xq, xd, xs8, facc8 = i8
            packed_i8._groups(codes, scale, g0, g1, xq, xd, xs8, 1, out.shape[1], out, facc8,
                              vnni)
    return impl


CHUNK_BYTES = 1 << 16  # codes bytes per claimed chunk of a linear (about 4 us of stream)
CHUNK_MULTIPLE = 4     # groups per chunk: a multiple of packed_f32_vnni.NG_MULTI
CHUNK_DIV = 2          # a claim takes 1/CHUNK_DIV of what is left in the range (guided)


@njit(inline="always", **JIT)
def _chunk_units(codes, per_unit):
    """Units of ``per_unit`` groups per claimed chunk of a linear: about :data:`CHUNK_BYTES` of
    codes, a multiple of :data:`CHUNK_MULTIPLE` units (at least that many)."""
    return _chunk_for(codes.shape[1] * GROUP_BLOCK_BYTES, per_unit)


@njit(inline="always", **JIT)
def _chunk_for(group_bytes, per_unit):
    """:func:`_chunk_units` for groups of ``group_bytes`` bytes."""
    ub = group_bytes * per_unit * CHUNK_MULTIPLE
    return CHUNK_MULTIPLE * max(np.int64(1), CHUNK_BYTES // ub)


@njit(inline="always", **JIT)
def _claim(bar, nt, n, step, r):
    """Claim the next chunk of units ``[u0, u1)`` out of ``n`` (units: 8-row groups, or gate/up
    group pairs), starting the search at range ``r``: returns ``(u0, u1, r)`` with the range
    the chunk came from, or ``u0 = -1`` when every range is used up.

    Dynamic work distribution. The ``n`` units are cut into ``nt`` ranges, range ``r`` being
    task ``r``'s static share ``[r n / nt, (r + 1) n / nt)``; each has a claim offset in
    ``bar`` (int64 slot ``BARRIER_SLOTS + WORK_SLOTS r``, advanced by an atomic add, reset to 0
    by :func:`_barrier`). A claim takes ``1 / CHUNK_DIV`` of what is left of the range, at least
    ``step`` units, rounded down to a multiple of :data:`CHUNK_MULTIPLE` (guided scheduling: few
    long claims first, short ones at the end). A task claims chunks of its own range in order
    (one contiguous stream, as the static split read it), then takes chunks from the front of
    the other ranges, so a task that is delayed (descheduled, slower memory) no longer holds the
    others up at the next barrier.

    Results do not depend on which task computes a chunk, nor on where chunks end: every
    output row is computed from its own weights and the shared activations only, by the same
    serial group kernel. Chunks start at the range start plus a multiple of
    :data:`CHUNK_MULTIPLE` groups, so the multi-group passes of exact mode on the VNNI path
    (:func:`~.packed_f32_vnni._groups_m1`, 4 groups per pass) fall exactly where the static
    split put them."""
    for _ in range(nt):
        s = r * n // nt
        e = (r + 1) * n // nt
        slot = BARRIER_SLOTS + WORK_SLOTS * r
        rem = e - s - _atomic_load(bar, slot)
        if rem > 0:
            size = max(step, CHUNK_MULTIPLE * (rem // (CHUNK_DIV * CHUNK_MULTIPLE)))
            off = _atomic_add(bar, slot, size)
            if s + off < e:
                return s + off, min(s + off + size, e), r
        r = r + 1 if r + 1 < nt else 0
    return np.int64(-1), np.int64(-1), r


@njit(inline="always", **JIT)
def _next_chunk(bar, nt, n, step, r):
    """The next chunk of a claim loop, for any task count: with several tasks :func:`_claim`;
    with one task, all ``n`` units on the first call (``r`` = its task index 0) and
    ``u0 = -1`` on the next (the returned ``r`` is -1 in between). The loop::

        r = tid
        while True:
            u0, u1, r = _next_chunk(bar, nt, n, step, r)
            if u0 < 0:
                break
            ...  # units [u0, u1)
    """
    if nt == 1:
        if r < 0:
            return np.int64(-1), np.int64(-1), r
        return np.int64(0), np.int64(n), np.int64(-1)
    return _claim(bar, nt, n, step, r)


# the add flag of _linear_part: module-level numpy bools, which numba types as plain booleans;
# a literal True / False argument would make one more specialisation of _linear_part each
# (cold start: measured 3 compilations of it instead of 1)
_YES = np.bool_(True)
_NO = np.bool_(False)


@njit(**JIT)
def _lin_groups(i8, gx, w, lin, xin, out, facc32, vnni, g0, g1):
    """8-row groups ``[g0, g1)`` of linear ``lin`` (a row of ``w.wl``): each part's groups in
    the range (:class:`~.step_buffers.WeightTable`), INT4 (:func:`_linear_groups`) or ggml
    (:func:`~.step_ggml.ggml_groups`, the part's kind read from the table), into the part's
    own rows of ``out`` (a view of them when the linear has several parts)."""
    p0 = w.wl[lin, L_P0]
    npart = w.wl[lin, L_NP]
    for p in range(p0, p0 + npart):
        pg0 = w.wt[p, W_G0]
        a = max(g0, pg0)
        b = min(g1, pg0 + w.wt[p, W_NG])
        if a >= b:
            continue
        o = out
        if npart > 1:
            o = _view(out, out.ctypes.data + 4 * GROUP_ROWS * pg0, (1, w.wt[p, W_N]))
        if w.wt[p, W_KIND] == 0:
            _int4_part(i8, w, p, xin, o, facc32, vnni, a - pg0, b - pg0, np.int64(-1))
        else:
            ggml_groups(i8, gx, w, p, xin, o, vnni, a - pg0, b - pg0)


def _int4_part(i8, w, p, xin, out, facc32, vnni, g0, g1, pf):
    """INT4 part ``p`` of ``w.wt``: groups ``[g0, g1)`` (:func:`_linear_groups`), or with
    ``pf >= 0`` only :func:`_prefetch_head` from group ``pf``. Nothing compiled when the stack
    has no INT4 part (``w.codes0`` None: a GGUF file without Q4_0 tensors)."""


@overload(_int4_part, jit_options=_OV)
def _ov_int4_part(i8, w, p, xin, out, facc32, vnni, g0, g1, pf):
    if isinstance(w.types[StepWeights._fields.index("codes0")], types.NoneType):
        return lambda i8, w, p, xin, out, facc32, vnni, g0, g1, pf: None
    if isinstance(xin, types.NoneType):
        def impl(i8, w, p, xin, out, facc32, vnni, g0, g1, pf):
            cw, sw = _weight(w.wt, p, w.codes0, w.scale0)
            _prefetch_head(cw, sw, pf)
    else:
        def impl(i8, w, p, xin, out, facc32, vnni, g0, g1, pf):
            cw, sw = _weight(w.wt, p, w.codes0, w.scale0)
            _linear_groups(i8, cw, sw, xin, out, facc32, vnni, g0, g1)
    return impl


@njit(**JIT)
def _linear_part(tid, nt, i8, gx, w, lin, xin, out, facc32, vnni, bar, add, addv):
    """This task's part of ``out[0, :] = xin[0, :] @ W.T (+ addv)`` for linear ``lin``
    (:func:`_lin_groups`): chunks of 8-row groups claimed with :func:`_claim` (with one task:
    all groups). ``add``: the rows a chunk wrote get ``+ addv[0, r]`` (bias, residual) before
    the next claim. Returns the number of chunks this task computed."""
    ng = w.wl[lin, L_NG]
    n = out.shape[1]
    if nt == 1:
        _lin_groups(i8, gx, w, lin, xin, out, facc32, vnni, np.int64(0), ng)
        if add:
            for r in range(n):
                out[0, r] = out[0, r] + addv[0, r]
        return np.int64(1)
    step = _chunk_for(w.wl[lin, L_GB], 1)
    r = tid
    done = np.int64(0)
    while True:
        g0, g1, r = _claim(bar, nt, ng, step, r)
        if g0 < 0:
            break
        _lin_groups(i8, gx, w, lin, xin, out, facc32, vnni, g0, g1)
        if add:
            for j in range(g0 * GROUP_ROWS, min(g1 * GROUP_ROWS, n)):
                out[0, j] = out[0, j] + addv[0, j]
        done += 1
    return done


@njit(**JIT)
def _prefetch_head(codes, scale, g0):
    """Prefetch the first :data:`~.packed_i8.PF_BYTES` of the codes and scales stream that
    starts at group ``g0`` (the part the group loop's own prefetch, that far ahead, never
    covers): issued before a barrier, the DRAM latency of a linear's start overlaps the wait."""
    pf = packed_i8.PF_BYTES
    if pf > 0:
        kb = codes.shape[1]
        cb = g0 * kb * GROUP_BLOCK_BYTES
        for off in range(0, pf, 64):
            packed_i8._prefetch(codes, cb + off)
        sb = g0 * kb * GROUP_ROWS
        # scales: 8 per block, float32 or float16 bits (element offsets; 64-byte lines)
        for off in range(0, pf // GROUP_BLOCK_BYTES * GROUP_ROWS, 64 // scale.itemsize):
            packed_i8._prefetch(scale, sb + off)


@njit(**JIT)
def _prefetch_group(gx, w, lin, g):
    """:func:`_prefetch_head` (INT4) or :func:`~.step_ggml.ggml_prefetch` of linear ``lin``
    from its group ``g`` on (the part holding it)."""
    p0 = w.wl[lin, L_P0]
    for p in range(p0, p0 + w.wl[lin, L_NP]):
        pg0 = w.wt[p, W_G0]
        if g < pg0 + w.wt[p, W_NG] or p == p0 + w.wl[lin, L_NP] - 1:
            if w.wt[p, W_KIND] == 0:
                _int4_part(None, w, p, None, None, None, False, 0, 0, g - pg0)
            else:
                ggml_prefetch(gx, w, p, g - pg0)
            return


@njit(**JIT)
def _prefetch_linear(tid, nt, gx, w, lin):
    """:func:`_prefetch_group` of this task's share of linear ``lin`` (where its first claim,
    :func:`_claim`, starts)."""
    _prefetch_group(gx, w, lin, tid * w.wl[lin, L_NG] // nt)


@njit(**JIT)
def _prefetch_part(tid, nt, wt, w, codes0, scale0):
    """:func:`_prefetch_head` of this task's share of weight ``w`` (where its first claim,
    :func:`_claim`, starts)."""
    cw, sw = _weight(wt, w, codes0, scale0)
    _prefetch_head(cw, sw, tid * cw.shape[0] // nt)


def _quantize(i8, xin, k, kb):
    """int8 mode: this task's quantization of ``xin[0, :k]`` into ``i8``; exact mode on the
    VNNI path: its activation digits; exact mode, float path (``i8`` is None): nothing (see
    :func:`_linear_part`)."""


@overload(_quantize, jit_options=_OV)
def _ov_quantize(i8, xin, k, kb):
    if isinstance(i8, types.NoneType):
        def impl(i8, xin, k, kb):
            pass
    # one row as np.int64(1), not the literal 1: the prefill's specialisation (int64 rows), so
    # the step loads the one the main process compiled instead of compiling a second (cold start)
    elif _is_digits(i8):
        def impl(i8, xin, k, kb):
            dg, bz, xsc = i8
            packed_f32_vnni._digits_rows(xin, np.int64(1), k, dg, bz, xsc)  # non-finite: NaN out
    else:
        def impl(i8, xin, k, kb):
            xq, xd, xs8, facc8 = i8
            packed_i8._quantize_rows_i8(xin, np.int64(1), k, kb, xq, xd, xs8)
    return impl


def _task_i8(i8ws, tid):
    """Task ``tid``'s activation buffers of the workspace tuple (int8 mode's
    ``(xq, xd, xs8, facc8)`` or exact mode's digits ``(dg, bz, xsc)``), or None."""


@overload(_task_i8, jit_options=_OV)
def _ov_task_i8(i8ws, tid):
    if isinstance(i8ws, types.NoneType):
        return lambda i8ws, tid: None
    if _is_digits(i8ws):
        return lambda i8ws, tid: (i8ws[0][tid], i8ws[1][tid], i8ws[2][tid])
    return lambda i8ws, tid: (i8ws[0][tid], i8ws[1][tid], i8ws[2][tid], i8ws[3][tid])


@njit(**JIT)
def _rope_head(buf, off, cos, sin, interleaved, rdim):
    """Rotate one head ``buf[0, off:off+D]`` in place (the expressions of rope._rope_token)."""
    half = rdim // 2
    if interleaved:
        for i in range(half):
            x1 = buf[0, off + 2 * i]
            x2 = buf[0, off + 2 * i + 1]
            buf[0, off + 2 * i] = cos[i] * x1 - sin[i] * x2
            buf[0, off + 2 * i + 1] = sin[i] * x1 + cos[i] * x2
    else:
        for i in range(half):
            x1 = buf[0, off + i]
            x2 = buf[0, off + half + i]
            buf[0, off + i] = cos[i] * x1 - sin[i] * x2
            buf[0, off + half + i] = sin[i] * x1 + cos[i] * x2


def _queries(w, li, qkv, qp, q3):
    """Step 3's start, every task: the query heads ``qkv[0, :H*D]`` into the task's private
    ``qp`` [1, H*D] (``q3`` [H, D] the same memory) -- copied, or (Qwen3, ``w.qk_norms`` not
    None) RMS-normalised per head with the layer's q norm weights (:func:`~.norm._rms_norm_row`,
    the per-operator plan's function). Chosen by the type of ``w.qk_norms`` when the step
    compiles (an ``overload``): a model without head norms compiles the copy only."""


def _key_norm(w, li, qkv, off, d):
    """Step 3, the last task: the key head ``qkv[0, off:off + D]`` RMS-normalised in place with
    the layer's k norm weights (before its RoPE); nothing without head norms (``overload`` as
    :func:`_queries`)."""


@overload(_queries, jit_options=_OV)
def _ov_queries(w, li, qkv, qp, q3):
    if isinstance(w.types[StepWeights._fields.index("qk_norms")], types.NoneType):
        def impl(w, li, qkv, qp, q3):
            for i in range(qp.shape[1]):
                qp[0, i] = qkv[0, i]
        return impl

    def impl(w, li, qkv, qp, q3):
        n_heads, d = q3.shape
        wq = w.qk_norms[li, 0]
        for hh in range(n_heads):
            _rms_norm_row(qkv[0, hh * d:(hh + 1) * d], wq, w.eps, q3[hh])
    return impl


@overload(_key_norm, jit_options=_OV)
def _ov_key_norm(w, li, qkv, off, d):
    if isinstance(w.types[StepWeights._fields.index("qk_norms")], types.NoneType):
        return lambda w, li, qkv, off, d: None

    def impl(w, li, qkv, off, d):
        row = qkv[0, off:off + d]
        _rms_norm_row(row, w.qk_norms[li, 1], w.eps, row)
    return impl


@njit(**JIT)
def _weight(wt, w, codes0, scale0):
    """Packed weight ``w`` (codes, scale) from the address table (see :func:`decode_stack`)."""
    ng = wt[w, 2]
    kb = wt[w, 3]
    return (_view(codes0, wt[w, 0], (ng, kb, GROUP_BLOCK_BYTES)),
            _view(scale0, wt[w, 1], (ng, kb, GROUP_ROWS)))


@njit(inline="always", **JIT)
def _activations(i8, gx, w, lin, xin, k):
    """This task's activations of linear ``lin`` from ``xin[0, :k]``: :func:`_quantize` (int8
    codes / VNNI digits, shared by INT4 and ggml parts) and the sums its ggml parts read
    (:func:`~.step_ggml.ggml_sums`)."""
    _quantize(i8, xin, k, (k + 31) // 32)
    ggml_sums(i8, gx, w, lin, xin, k)


@njit(inline="always", **JIT)
def _layer_head(tid, nt, i8, gx, x, li, w, h, qkv, f32, bar, vnni):
    """Steps 1-2: input norm (private), q/k/v projection (+ bias); barrier."""
    e = x.shape[1]
    _rms_norm_row(x[0], w.norms[2 * li], w.eps, h[0])
    _activations(i8, gx, w, 4 * li, h, e)
    _stamp(bar, tid, nt, np.int64(0))
    _linear_part(tid, nt, i8, gx, w, 4 * li, h, qkv, f32, vnni, bar, w.has_bias[li],
                 w.biases[li:li + 1])
    # the output projection's start
    _prefetch_linear(tid, nt, gx, w, 4 * li + 1)
    _stamp(bar, tid, nt, np.int64(1))
    _barrier(bar, nt)
    _stamp(bar, tid, nt, np.int64(2))


@njit(inline="always", **JIT)
def _merge_heads(tid, nt, n_heads, d, pm, pl, po, attn_p):
    """Every task combines the partial softmax states of all heads into its private copy of
    the attention output (no barrier needed before the output projection reads it)."""
    ap = attn_p[tid]
    for hh in range(n_heads):
        _merge_partials(pm, pl, po, nt, hh, ap[0, hh * d:(hh + 1) * d])


@njit(inline="always", **JIT)
def _layer_tail(tid, nt, i8, gx, x, nxt, li, w, dims, rs, attn, h, f32, bar):
    """Steps 5-8 (output projection + residual, post norm, gate/up, SiLU*up, down + residual);
    returns the new residual buffer and the flip flag. Before each barrier a task prefetches
    the start of its share of the next weight (:func:`_prefetch_linear`)."""
    xa, xb, gu, act = rs.xa, rs.xb, rs.gu, rs.act
    inter, vnni = dims.inter, dims.vnni
    wi = 4 * li
    hd = attn.shape[1]
    e = x.shape[1]
    xn = xa if nxt == 0 else xb
    _activations(i8, gx, w, wi + 1, attn, hd)
    _linear_part(tid, nt, i8, gx, w, wi + 1, attn, xn, f32, vnni, bar, _YES, x)
    _stamp(bar, tid, nt, np.int64(6))
    ng = w.wl[wi + 2, L_NG]
    # gate rows [0, inter), up rows [inter, 2 inter): when no 8-row group straddles the two,
    # each task takes the same groups of both halves and applies SiLU * up to its own rows
    # (no barrier between gate/up and the product)
    halves = _paired_halves(inter, ng)
    gh = ng // 2
    a0 = tid * gh // nt
    if halves:
        _prefetch_group(gx, w, wi + 2, a0)
        _prefetch_group(gx, w, wi + 2, gh + a0)
    else:
        _prefetch_group(gx, w, wi + 2, tid * ng // nt)
    _barrier(bar, nt)
    _stamp(bar, tid, nt, np.int64(7))
    x = xn
    nxt = 1 - nxt
    xn = xa if nxt == 0 else xb
    # 6: post-attention norm (private), gate/up projection
    _rms_norm_row(x[0], w.norms[2 * li + 1], w.eps, h[0])
    _activations(i8, gx, w, wi + 2, h, e)
    _stamp(bar, tid, nt, np.int64(8))
    if halves:
        # chunks of gate/up group pairs (the same groups of both halves), claimed as the
        # linears' groups are (_claim); SiLU * up on the chunk's rows
        if nt == 1:
            _gate_up_pairs(i8, gx, w, wi + 2, h, gu, act, inter, f32, vnni, np.int64(0), gh)
        else:
            step = _chunk_for(w.wl[wi + 2, L_GB], 2)
            r = tid
            while True:
                p0, p1, r = _claim(bar, nt, gh, step, r)
                if p0 < 0:
                    break
                _gate_up_pairs(i8, gx, w, wi + 2, h, gu, act, inter, f32, vnni, p0, p1)
    else:
        _linear_part(tid, nt, i8, gx, w, wi + 2, h, gu, f32, vnni, bar, _NO, gu)
        _barrier(bar, nt)
        _silu_mul(gu, act, inter, tid * inter // nt, (tid + 1) * inter // nt)
    _prefetch_linear(tid, nt, gx, w, wi + 3)
    _stamp(bar, tid, nt, np.int64(9))
    _barrier(bar, nt)
    _stamp(bar, tid, nt, np.int64(10))
    # 8: down projection + residual
    _activations(i8, gx, w, wi + 3, act, inter)
    _linear_part(tid, nt, i8, gx, w, wi + 3, act, xn, f32, vnni, bar, _YES, x)
    _prefetch_linear(tid, nt, gx, w, wi + 4)  # next layer's qkv, or the lm_head
    _stamp(bar, tid, nt, np.int64(11))
    _barrier(bar, nt)
    _stamp(bar, tid, nt, np.int64(12))
    return xn, 1 - nxt


@njit(inline="always", **JIT)
def _paired_halves(inter, ng):
    """Whether the ``ng`` 8-row groups of a gate|up weight (gate rows ``[0, inter)``, up rows
    ``[inter, 2 inter)``) pair up: no group straddles the halves, so a task can take the same
    groups of both and apply SiLU * up to its own rows without a barrier between."""
    return inter % GROUP_ROWS == 0 and ng == 2 * (inter // GROUP_ROWS)


@njit(inline="always", **JIT)
def _silu_mul(gu, act, inter, j0, j1):
    """Step 7 on rows ``[j0, j1)``: ``act = g * sigmoid(g) * u`` (same operations as
    fusion.SiluMul: ``1 / (1 + exp(-g))``, then two products)."""
    silu_mul_chunk(gu[0, j0:j1], gu[0, inter + j0:inter + j1], act[0, j0:j1])


@njit(inline="always", **JIT)
def _gate_up_pairs(i8, gx, w, lin, h, gu, act, inter, f32, vnni, p0, p1):
    """Gate groups ``[p0, p1)``, the up groups ``gh + [p0, p1)`` (``gh = inter / 8``) of
    linear ``lin``, then SiLU * up on their rows."""
    gh = w.wl[lin, L_NG] // 2
    _lin_groups(i8, gx, w, lin, h, gu, f32, vnni, p0, p1)
    _lin_groups(i8, gx, w, lin, h, gu, f32, vnni, gh + p0, gh + p1)
    _silu_mul(gu, act, inter, p0 * GROUP_ROWS, p1 * GROUP_ROWS)


@njit(inline="always", **JIT)
def _lm_head(tid, nt, i8, gx, x, n_layers, w, h, logits, f32, vnni, bar):
    """Final norm (private), ``logits = . @ Wlm.T``; a last barrier (it resets the claim
    offsets for the next call)."""
    e = x.shape[1]
    _rms_norm_row(x[0], w.norms[2 * n_layers], w.eps, h[0])
    _activations(i8, gx, w, 4 * n_layers, h, e)
    _linear_part(tid, nt, i8, gx, w, 4 * n_layers, h, logits, f32, vnni, bar, _NO, logits)
    _stamp(bar, tid, nt, np.int64(13))
    _barrier(bar, nt)
    _stamp(bar, tid, nt, np.int64(14))


# ------------------------------------------------------------------------------------------------
# the KV cache: where a key/value position is (contiguous capacity buffers or paged blocks)
# ------------------------------------------------------------------------------------------------
def _kv_write(kv, tid, li, g, qkv, dims):
    """Step 3's write (the last task only): kv head ``g``'s new key (rotated, in ``qkv[0, H*D +
    g*D:]``) and value (``qkv[0, (H + KVH)*D + g*D:]``) of layer ``li`` into the cache: slot
    ``kv.pos[li]`` of the capacity buffers (:class:`~.step_buffers.KVContig`), or row
    ``kv.pos[li]`` of the open block (:class:`~.step_buffers.KVPaged`, through the task's
    ``kvnew`` rows; float32, or float16 rounded to nearest even). Chosen by the type of ``kv``
    when the step compiles (an ``overload``): a session compiles one of the two."""


def _kv_attend(kv, tid, nt, li, q3, att, dims):
    """Step 4, this task's share: the partial softmax states ``att.pm/pl/po[tid]`` of every
    query head over its share of layer ``li``'s keys (flash-decoding split): keys ``[tid (t +
    1) / nt, (tid + 1) (t + 1) / nt)`` of the capacity buffers (:func:`~.attention._attend_rows`,
    t = ``kv.pos[li]``), or blocks ``[tid nb / nt, (tid + 1) nb / nt)`` of the block table, one
    softmax tile of blocks at a time for every kv head (:func:`~.paged_attention._attend_blocks`;
    with ``kv.iq`` the queries are quantized to int8 first). Chosen at compile time by the type
    of ``kv``, as :func:`_kv_write`."""


def _is_kv(kv, cls):
    return isinstance(kv, types.NamedTuple) and kv.instance_class is cls


@overload(_kv_write, jit_options=_OV)
def _ov_kv_write(kv, tid, li, g, qkv, dims):
    if _is_kv(kv, KVContig):
        def impl(kv, tid, li, g, qkv, dims):
            n_kv, d = dims.n_kv, dims.d
            hd = dims.n_heads * d
            kvd = n_kv * d
            t = kv.pos[li]
            cap = kv.kvt[li, 2]
            kb = _view(kv.kv0, kv.kvt[li, 0], (1, n_kv, cap, d))
            vb = _view(kv.kv0, kv.kvt[li, 1], (1, n_kv, cap, d))
            for i in range(d):
                kb[0, g, t, i] = qkv[0, hd + g * d + i]
                vb[0, g, t, i] = qkv[0, hd + kvd + g * d + i]
        return impl
    if _is_kv(kv, KVPaged):
        def impl(kv, tid, li, g, qkv, dims):
            d = dims.d
            hd = dims.n_heads * d
            kvd = dims.n_kv * d
            kvn = kv.kvnew[tid]
            for i in range(d):
                kvn[0, g * d + i] = qkv[0, hd + g * d + i]
                kvn[1, g * d + i] = qkv[0, hd + kvd + g * d + i]
            _write_open_row(kv.tabs[li], kv.nblk[li], g, kv.bs, d, kv.pos[li], kvn, g * d)
        return impl
    return None


@overload(_kv_attend, jit_options=_OV)
def _ov_kv_attend(kv, tid, nt, li, q3, att, dims):
    if _is_kv(kv, KVContig):
        def impl(kv, tid, nt, li, q3, att, dims):
            n_kv, d = dims.n_kv, dims.d
            group = dims.n_heads // n_kv
            t = kv.pos[li]
            cap = kv.kvt[li, 2]
            kb = _view(kv.kv0, kv.kvt[li, 0], (1, n_kv, cap, d))
            vb = _view(kv.kv0, kv.kvt[li, 1], (1, n_kv, cap, d))
            sc, p, mx = att.asc[tid], att.ap[tid], att.amx[tid]
            j0 = tid * (t + 1) // nt
            j1 = (tid + 1) * (t + 1) // nt
            for g in range(n_kv):
                hs = g * group
                m = att.pm[tid, hs:hs + group]
                l = att.pl[tid, hs:hs + group]
                o = att.po[tid, hs:hs + group]
                _state_init(m, l, o, group)
                _attend_rows(q3[hs:hs + group], group, kb[0, g], vb[0, g], j0, j1,
                             dims.att_scale, m, l, o, sc, p, mx)
        return impl
    if _is_kv(kv, KVPaged):
        def impl(kv, tid, nt, li, q3, att, dims):
            _paged_share(kv, tid, nt, li, q3, att, dims)
        return impl
    return None


@njit(**JIT)
def _write_open_row(tab, nb, g, bs, d, t_in, src, off):
    """Write the key ``src[0, off:off+D]`` and value ``src[1, off:off+D]`` as token ``t_in`` of kv
    head ``g`` into the open (last) block of the table (float32, or float16 rounded to nearest
    even)."""
    for side in range(2):
        fmt = tab[nb - 1, pk.T_KFMT if side == 0 else pk.T_VFMT]
        addr = tab[nb - 1, pk.T_KADDR if side == 0 else pk.T_VADDR]
        r = g * bs + t_in
        if fmt == 0:
            dst = carray(pk._f32p(addr + r * d * 4), (d,))
            for i in range(d):
                dst[i] = src[side, off + i]
        else:
            dst16 = carray(pk._u16p(addr + r * d * 2), (d,))
            for i in range(d):
                dst16[i] = pk._f32_to_half(src[side, off + i])


@njit(inline="always", **JIT)
def _paged_share(kv, tid, nt, li, q3, att, dims):
    """:func:`_kv_attend` over a block table (see there)."""
    n_heads, n_kv = dims.n_heads, dims.n_kv
    group = n_heads // n_kv
    att_scale = dims.att_scale
    tab = kv.tabs[li]
    nb = kv.nblk[li]
    qi, qip, qmul, qsum = kv.qi[tid], kv.qip[tid], kv.qmul[tid], kv.qsum[tid]
    sc, p, mx = att.asc[tid], att.ap[tid], att.amx[tid]
    pm, pl, po = att.pm, att.pl, att.po
    scr, rmul, pend = kv.scr[tid], kv.rmul[tid], kv.pend[tid]
    if kv.iq:  # int8 queries for INT8/INT4 key blocks (every task quantizes all heads)
        pk._quantize_heads(q3, 0, n_heads, att_scale, qi, qip, qmul, qsum)
    b0 = tid * nb // nt
    b1 = (tid + 1) * nb // nt
    for g in range(n_kv):
        hs = g * group
        _state_init(pm[tid, hs:hs + group], pl[tid, hs:hs + group], po[tid, hs:hs + group],
                    group)
    # one softmax tile of blocks at a time for every kv head: a block slot ([KVH, BS, D]) is
    # read whole, in address order, before the next one
    tb = max((sc.shape[1] - SLACK) // kv.bs, 1)
    for c0 in range(b0, b1, tb):
        c1 = min(c0 + tb, b1)
        for g in range(n_kv):
            hs = g * group
            _attend_blocks(q3[hs:hs + group], group, tab, c0, c1, g, kv.bs, 0, False, att_scale,
                           SoftmaxState(pm[tid, hs:hs + group], pl[tid, hs:hs + group],
                                        po[tid, hs:hs + group]),
                           TileScratch(sc, p, mx, scr, rmul, pend),
                           Int8Query(kv.iq, dims.vnni, qi[hs:hs + group], qip[hs:hs + group],
                                     qmul[hs:hs + group], qsum[hs:hs + group]),
                           b1, n_kv if g == 0 else 0)


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _stack_thread(tid, nt, x0, cos, sin, logits, bar, i8ws, w, dims, rs, att, kv):
    """Task ``tid``'s program of one decode token (the module docstring's steps 1-8 per layer,
    then the lm_head): ``x0`` float32 [1, E] the token's embedding, ``cos, sin`` float32
    [rdim/2] of its position, ``logits`` float32 [1, V] (written), ``bar`` int64 the barrier
    array (:func:`~.step_sync.barrier_slots`), ``i8ws`` the per-task activation buffers
    (:meth:`~.step_buffers.StackWorkspace.exact_buffers`), then the bundles of
    :mod:`.step_buffers`: ``w`` StepWeights, ``dims`` StepDims, ``rs`` RunState, ``att``
    AttState, ``kv`` KVContig or KVPaged (one compiled specialisation per KV type)."""
    n_layers = kv.pos.shape[0]
    n_heads, n_kv, d = dims.n_heads, dims.n_kv, dims.d
    rdim, interleaved = dims.rdim, dims.interleaved
    hd = n_heads * d
    qkv = rs.qkv
    qp = rs.qpa[tid]  # this task's rotated queries [1, H*D], as [H, D]
    q3 = rs.qpa3[tid]
    h = rs.hx[tid]
    i8 = _task_i8(i8ws, tid)  # None in exact mode
    gx = task_ggml(rs, tid)  # None without ggml weights
    f32 = rs.facc32[tid]
    attn = att.attn_p[tid]
    # residual stream: x0 -> xa -> xb -> xa ... (each write goes to the buffer x is not in)
    x = x0
    nxt = 0  # 0: the next write goes to xa, 1: to xb
    _stamp(bar, tid, nt, np.int64(-1))  # phase profile (benchmarks only): the start
    for li in range(n_layers):
        _layer_head(tid, nt, i8, gx, x, li, w, h, qkv, f32, bar, dims.vnni)
        # 3: RoPE: every task rotates all query heads into its private copy; the task whose
        #    share of the keys ends with the new one (the last) rotates the key heads and
        #    writes k and v to the cache -- no other task reads that position, so no barrier
        #    before the attention
        #    (Qwen3: each query and key head RMS-normalised first, _queries / _key_norm)
        _queries(w, li, qkv, qp, q3)
        for hh in range(n_heads):
            _rope_head(qp, hh * d, cos, sin, interleaved, rdim)
        if tid == nt - 1:
            for g in range(n_kv):
                _key_norm(w, li, qkv, hd + g * d, d)
                _rope_head(qkv, hd + g * d, cos, sin, interleaved, rdim)
                _kv_write(kv, tid, li, g, qkv, dims)
        # 4: this task's share of the keys for every kv head; barrier; every task merges the
        #    partial states into its private output
        _kv_attend(kv, tid, nt, li, q3, att, dims)
        _stamp(bar, tid, nt, np.int64(3))
        _barrier(bar, nt)
        _stamp(bar, tid, nt, np.int64(4))
        _merge_heads(tid, nt, n_heads, d, att.pm, att.pl, att.po, att.attn_p)
        _stamp(bar, tid, nt, np.int64(5))
        x, nxt = _layer_tail(tid, nt, i8, gx, x, nxt, li, w, dims, rs, attn, h, f32, bar)
    _lm_head(tid, nt, i8, gx, x, n_layers, w, h, logits, f32, dims.vnni, bar)


@njit(**PJIT)
def _stack_par(nt, x0, cos, sin, logits, bar, i8ws, w, dims, rs, att, kv):
    """The parallel entry: one region of ``nt`` tasks, each :func:`_stack_thread`."""
    for tid in prange(nt):
        # int64 like the serial entry's tid (the prange index is unsigned): one specialisation
        # of _stack_thread serves both
        _stack_thread(np.int64(tid), nt, x0, cos, sin, logits, bar, i8ws, w, dims, rs, att, kv)


def _bundles(quant, weights, biases, has_bias, norms, eps, n_heads, n_kv, d, rdim, interleaved,
             att_scale, inter, ws, att):
    """The arguments of the compiled step after the KV bundle's: ``(i8ws, StepWeights,
    StepDims, RunState, AttState)``."""
    qpa, qpa3 = ws.qprivate(n_heads, d)
    return (ws.exact_buffers(quant),
            StepWeights(weights.wt, weights.codes0, weights.scale0, biases, has_bias, norms, eps,
                        weights.wl, weights.ggml0, weights.qk_norms),
            StepDims(n_heads, n_kv, d, rdim, interleaved, att_scale, inter,
                     packed_i8.use_vnni()),
            RunState(ws.xa, ws.xb, ws.qkv, qpa, qpa3, ws.gu, ws.act, ws.hx, ws.facc32,
                     *ws.ggml_buffers(weights.ggml0 is not None)),
            AttState(*att))


def _entry(nt, args):
    """The compiled entry and its argument list: the parallel driver with ``nt`` first, or with
    one task the per-thread program itself as the serial entry (no second top-level driver)."""
    if nt > 1:
        return _stack_par, (nt,) + args
    return _stack_thread, (0, 1) + args


def decode_stack_paged(nt, quant, x0, weights, biases, has_bias, norms, eps, tabs, nblk,
                       tin, block_size, cos, sin, n_heads, n_kv, d, rdim, interleaved, att_scale,
                       inter, ws, logits):
    """:func:`decode_stack` over paged KV caches (the same driver, compiled for a
    :class:`~.step_buffers.KVPaged` bundle at the first call, for paged models).

    Instead of capacity buffers, each layer's cache is a block table
    (:mod:`.paged_attention`) and the weights are a :class:`WeightTable`: ``tabs`` a typed list of int64 [>= nblk[l], TABLE_COLS] arrays
    (one per layer), ``nblk`` int64 [L] rows used, ``tin`` int64 [L] the token index inside the
    last (open, float32/float16) block where the new key and value are written, ``block_size``
    BS. Step 3 writes k, v there: the last task, whose share of the blocks ends with the open
    block, so no barrier before the attention (the bookkeeping -- slot claim, allocation,
    sealing -- is the caller's, :meth:`olv_runtime.kv.paged.PagedKV.decode_begin` /
    ``decode_end``); step 4 runs
    :func:`~.paged_attention._attend_blocks` over this task's share of the blocks for every kv head
    and merges the partial states as the contiguous step does. In int8-activation mode
    (``quant``) the scores of INT8/INT4 key blocks are integer dot products against the query
    heads quantized to int8 (``paged_attention(..., int8_query=True)``: one scale per head,
    the block's key codes and scales as they are).
    """
    w = pk.tile_width(block_size)
    att = ws.attention(n_heads, n_kv, d, w)
    scr, rmul, pend, kvnew, qi, qip, qmul, qsum, pm, pl, amx = ws.paged(d, w, n_kv,
                                                                    int(block_size), n_heads)
    att = (pm, pl) + tuple(att[2:6]) + (amx,)  # line-padded per-task max/sum rows
    kv = KVPaged(tabs, nblk, tin, int(block_size), scr, rmul, pend, kvnew, bool(quant), qi, qip,
                 qmul, qsum)
    rest = _bundles(quant, weights, biases, has_bias, norms, eps, n_heads, n_kv, d, rdim,
                    interleaved, att_scale, inter, ws, att)
    fn, args = _entry(nt, (x0, cos, sin, logits, ws.bar) + rest + (kv,))
    fn(*args)
    return logits


def decode_stack(nt, quant, x0, weights, biases, has_bias, norms, eps, kvt, kv0, tpos, cos, sin,
                 n_heads, n_kv, d, rdim, interleaved, att_scale, inter, ws, logits):
    """Run every layer of one decode token and the lm_head (see the module docstring).

    Parameters (checked by the caller, :class:`olv_runtime.executor.decoder_step.DecoderStack`)
    ----------
    nt : int
        Tasks (1: serial; > 1 only with the ``omp`` threading layer, nt <= its threads).
    quant : bool
        int8 activations (:mod:`.packed_i8`) or float32 (:mod:`.packed_f32`); only the kernels
        of the mode in use are compiled.
    x0 : float32 [1, E]
        The embedding of the token.
    weights : WeightTable
        4 packed weights per layer (qkv, o, gate_up, down) + lm_head.
    biases : float32 [L, N_qkv] (zeros where a layer has none); has_bias : bool [L]
    norms : float32 [2L + 1, E]: input and post-attention norm weights per layer, final
    eps : float32
    kvt : int64 [L, 3]
        Per layer: address of the key and of the value capacity buffer (float32
        [1, KVH, CAP, D], C-contiguous; slot ``tpos[l]`` is written), CAP.
    kv0 : float32 [1, KVH, 1, D] (any C-contiguous writeable 4-D float32 array: the type of the
        views)
    tpos : int64 [L]
    cos, sin : float32 [rdim/2] of the token's position
    ws : StackWorkspace
    logits : float32 [1, V] (written)
    """
    fn, args = _stack_call(nt, quant, x0, weights, biases, has_bias, norms, eps, kvt, kv0, tpos,
                           cos, sin, n_heads, n_kv, d, rdim, interleaved, att_scale, inter, ws,
                           logits)
    fn(*args)
    return logits


def _stack_call(nt, quant, x0, weights, biases, has_bias, norms, eps, kvt, kv0, tpos, cos, sin,
                n_heads, n_kv, d, rdim, interleaved, att_scale, inter, ws, logits):
    rest = _bundles(quant, weights, biases, has_bias, norms, eps, n_heads, n_kv, d, rdim,
                    interleaved, att_scale, inter, ws, ws.attention(n_heads, n_kv, d))
    return _entry(nt, (x0, cos, sin, logits, ws.bar) + rest + (KVContig(kvt, kv0, tpos),))


#: Positions, in the argument list of :func:`_stack_call`'s compiled function, of the values that
#: change from one token to the next (x0, cos, sin, logits), after its 1 (parallel entry: nt)
#: or 2 (serial entry: tid, nt) leading arguments. Checked by :func:`prepared_call`.
_VARYING = (0, 1, 2, 3)


def prepared_call(nt, quant, x0, weights, biases, has_bias, norms, eps, kvt, kv0, tpos, cos, sin,
                  n_heads, n_kv, d, rdim, interleaved, att_scale, inter, ws, logits):
    """:func:`decode_stack`'s compiled function and argument list, built once for a workspace:
    ``(fn, args, (i_x0, i_cos, i_sin, i_logits))``. A caller whose other arguments stay the
    same objects (the tables are updated in place) runs a token with
    ``args[i_x0] = x0; ...; fn(*args)`` instead of rebuilding the argument list."""
    fn, args = _stack_call(nt, quant, x0, weights, biases, has_bias, norms, eps, kvt, kv0, tpos,
                           cos, sin, n_heads, n_kv, d, rdim, interleaved, att_scale, inter, ws,
                           logits)
    lead = 1 if nt > 1 else 2
    idx = tuple(lead + i for i in _VARYING)
    assert all(args[i] is v for i, v in zip(idx, (x0, cos, sin, logits)))
    return fn, list(args), idx


def precompile_entries(entry) -> list:
    """What a compile worker builds for the decode step ``entry`` (:func:`decode_stack_entry`),
    in order: first kernels of the prefill, the ones the main process reaches last -- its
    RoPE rows, and in exact mode on the VNNI path the many-row GEMV groups
    (:func:`_prefill_entries`) --, then the attention rows the prefill shares with the step
    (:func:`~.attention.shared_entries`), then the step itself (whose compilation loads the
    GEMV and norm callees the main process has compiled meanwhile).

    With the shared cache each entry is compiled by one process (:mod:`.precompile`): the main
    process, running the prefill, waits for an entry the worker is compiling and loads it, and
    compiles one the worker has not started itself (the worker then skips it). So the first
    token, which only needs the prefill's kernels, comes earlier, and the second one (the first
    decode step) later by about the same time. Only what the prefill needs last is listed:
    with its first callees too (RMSNorm rows, digits, one-row groups) the main process mostly
    waited for the worker instead of compiling beside it (measured: 1 s less CPU in the main
    process, no earlier first token)."""
    return _prefill_entries(entry) + shared_entries() + [entry]


def _prefill_entries(entry) -> list:
    """``(dispatcher, argument types)`` of prefill kernels whose specialisation follows from the
    decode step's (the packed weight and digit types): the rows of a prompt's RoPE
    (:func:`~.rope._rope_token`) and, in exact mode on the VNNI path, the many-row GEMV groups
    (:func:`~.packed_f32_vnni._groups_rows`, the types of :func:`~.packed_f32_vnni._groups_m1`
    that the step calls, plus the row count)."""
    f1 = types.Array(types.float32, 1, "C")
    f2 = types.Array(types.float32, 2, "C")
    i64 = types.int64
    out = []
    fn, sig = entry
    if fn is _stack_thread or fn is _stack_par:
        names = list(inspect.signature(fn.py_func).parameters)
        w_t = sig[names.index("w")]  # the StepWeights bundle's type
        codes_t = w_t.types[StepWeights._fields.index("codes0")]
        scale_t = w_t.types[StepWeights._fields.index("scale0")]
        i8ws = sig[names.index("i8ws")]
        dg_t = (types.Array(types.int8, 2, "C"), types.Array(types.int32, 2, "C"), f2)
        if (isinstance(i8ws, types.BaseTuple) and len(i8ws) == 3
                and isinstance(codes_t, types.Array)):
            out.append((packed_f32_vnni._groups_rows,
                        (codes_t, scale_t, i64, i64, i64) + dg_t + (i64, f2, f1)))
    out.append((_rope_token, (f2, f1, f1, types.boolean, i64, f2)))
    return out


def decode_stack_entry(*args):
    """``(numba dispatcher, argument types)`` of the compiled function that
    :func:`decode_stack` with these arguments calls (the arrays only need the types of the real
    ones): what :mod:`.precompile` compiles in a worker process."""
    fn, call = _stack_call(*args)
    return fn, tuple(typeof(a, Purpose.argument) for a in call)