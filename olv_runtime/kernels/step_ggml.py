"""The ggml parts of the compiled decode step's linears (:mod:`.decoder_layers`): GGUF Q8_0,
Q5_0, Q4_1, Q5_1, Q4_K, Q5_K and Q6_K weights in the group records of :mod:`.ggml_packed` (the
kind of each part is read from the weight table at run time).

A linear of the step is one or more parts (:class:`~.step_buffers.WeightTable`), each INT4 or
ggml; the step runs a ggml part's 8-row groups with the plan's own serial functions at one
activation row (``m = 1``): :func:`~.ggml_packed._row_i8` (int8 activations) or
:func:`~.ggml_packed._row_f32` (exact mode, float32 activations) per group, then
:func:`~.packed_i8.store_group` -- the body of :func:`~.ggml_packed._groups`, so each output row
is bitwise the per-operator plan's. The activations are the ones the INT4 parts read: int8 mode's
quantization is :func:`~.packed_i8.quantize_rows_i8` in both (one per norm output, made by
:func:`.decoder_layers._quantize`), plus the sums :func:`~.ggml_packed._act_sums` makes for
the plan (Q6_K: per-16 sums of the int8 codes; exact mode, the kinds with mins -- Q4_1, Q5_1,
Q4_K, Q5_K: per-32 float sums of ``x``),
made here per task, for the linears that have such a part.

Every function is an ``overload`` chosen by the type of the per-task ggml buffers (``gx``,
:class:`~.step_buffers.GGMLState`): None for a stack without ggml weights, whose step then
compiles none of the ggml kernels (and :mod:`.ggml_packed` is not even imported); the
activation mode by the type of the int8 buffers, as :func:`.decoder_layers._linear_groups`.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.core.extending import overload

from olv_runtime.lazy import lazy_module

from .step_buffers import L_NP, L_P0, W_A, W_B, W_KB, W_KIND, W_NG, GGMLState
from .step_sync import _view

gp = lazy_module("olv_runtime.kernels.ggml_packed")  # imported when a ggml step compiles

__all__ = ["ggml_groups", "ggml_prefetch", "ggml_sums", "task_ggml"]

_OV = dict(fastmath=False, error_model="numpy")  # the JIT flags overload implementations take
PF_BYTES = 2048  # the head of a part's records prefetched before a barrier (ggml_packed's)


def _is_int8(i8):
    return isinstance(i8, types.BaseTuple) and len(i8) == 4


def ggml_groups(i8, gx, w, p, xin, out, vnni, g0, g1):
    """Groups ``[g0, g1)`` of ggml part ``p`` (a row of ``w.wt``): ``out[0, :] = xin[0, :] @
    W_p.T`` on those groups' rows (``out`` is the part's own rows). ``i8``: int8 mode's
    ``(xq, xd, xs8, facc8)`` (:func:`~.ggml_packed._row_i8`), else exact mode
    (:func:`~.ggml_packed._row_f32` on ``xin``); ``gx`` this task's ggml buffers or None
    (nothing compiled: the stack has no ggml part)."""


@overload(ggml_groups, jit_options=_OV)
def _ov_ggml_groups(i8, gx, w, p, xin, out, vnni, g0, g1):
    if isinstance(gx, types.NoneType):
        return lambda i8, gx, w, p, xin, out, vnni, g0, g1: None
    row_i8, row_f32, store = gp._row_i8, gp._row_f32, gp.store_group
    if _is_int8(i8):
        def impl(i8, gx, w, p, xin, out, vnni, g0, g1):
            data = _view(w.ggml0, w.wt[p, W_A], (w.wt[p, W_NG], w.wt[p, W_KB], w.wt[p, W_B]))
            kind = w.wt[p, W_KIND]
            xq, xd, xs8 = i8[0], i8[1], i8[2]
            n = out.shape[1]
            for g in range(g0, g1):
                acc = row_i8(kind, data, g, xq, xd, xs8, gx.xs16, np.int64(0), vnni)
                store(acc, gx.facc, g, np.int64(0), n, out)
    else:
        def impl(i8, gx, w, p, xin, out, vnni, g0, g1):
            data = _view(w.ggml0, w.wt[p, W_A], (w.wt[p, W_NG], w.wt[p, W_KB], w.wt[p, W_B]))
            kind = w.wt[p, W_KIND]
            n = out.shape[1]
            for g in range(g0, g1):
                acc = row_f32(kind, data, g, xin, gx.xsum, np.int64(0))
                store(acc, gx.facc, g, np.int64(0), n, out)
    return impl


def ggml_sums(i8, gx, w, lin, xin, k):
    """The activation sums the ggml parts of linear ``lin`` read, of this task's ``xin[0, :k]``
    (after :func:`.decoder_layers._quantize`): int8 mode, a Q6_K part: per-16 sums of the int8
    codes into ``gx.xs16``; exact mode, a Q4_1 / Q5_1 / Q4_K / Q5_K part: per-32 float sums
    into ``gx.xsum``
    (:func:`~.ggml_packed._act_sums`, the plan's). Nothing without such a part, or ``gx``
    None."""


@overload(ggml_sums, jit_options=_OV)
def _ov_ggml_sums(i8, gx, w, lin, xin, k):
    if isinstance(gx, types.NoneType):
        return lambda i8, gx, w, lin, xin, k: None
    act_sums = gp._act_sums
    if _is_int8(i8):
        def impl(i8, gx, w, lin, xin, k):
            if _has_kind(w, lin, 14):
                act_sums(np.int64(14), np.int64(1), k, i8[0], gx.xs16, xin, gx.xsum, True)
    else:
        needs_xsum = gp.needs_xsum

        def impl(i8, gx, w, lin, xin, k):
            kind = _xsum_kind(w, lin, needs_xsum)
            if kind:
                act_sums(kind, np.int64(1), k, gx.xq, gx.xs16, xin, gx.xsum, False)
    return impl


def _has_kind(w, lin, kind):
    """Whether a part of linear ``lin`` has ggml type ``kind``."""


@overload(_has_kind, jit_options=_OV, inline="always")
def _ov_has_kind(w, lin, kind):
    def impl(w, lin, kind):
        p0 = w.wl[lin, L_P0]
        for p in range(p0, p0 + w.wl[lin, L_NP]):
            if w.wt[p, W_KIND] == kind:
                return True
        return False
    return impl


def _xsum_kind(w, lin, needs_xsum):
    """The ggml type id of the first part of linear ``lin`` whose exact mode reads per-32 float
    sums of ``x`` (``needs_xsum``: Q4_1, Q5_1, Q4_K, Q5_K), else 0."""


@overload(_xsum_kind, jit_options=_OV, inline="always")
def _ov_xsum_kind(w, lin, needs_xsum):
    def impl(w, lin, needs_xsum):
        p0 = w.wl[lin, L_P0]
        for p in range(p0, p0 + w.wl[lin, L_NP]):
            if needs_xsum(w.wt[p, W_KIND]):
                return np.int64(w.wt[p, W_KIND])
        return np.int64(0)
    return impl


def ggml_prefetch(gx, w, p, g):
    """Prefetch the first :data:`PF_BYTES` of ggml part ``p``'s records from group ``g`` on
    (:func:`.decoder_layers._prefetch_group`; nothing when ``gx`` is None)."""


@overload(ggml_prefetch, jit_options=_OV)
def _ov_ggml_prefetch(gx, w, p, g):
    if isinstance(gx, types.NoneType):
        return lambda gx, w, p, g: None
    prefetch = gp.prefetch

    def impl(gx, w, p, g):
        data = _view(w.ggml0, w.wt[p, W_A], (w.wt[p, W_NG], w.wt[p, W_KB], w.wt[p, W_B]))
        base = g * w.wt[p, W_KB] * w.wt[p, W_B]
        for off in range(0, PF_BYTES, 64):
            prefetch(data, base + off)
    return impl


def task_ggml(rs, tid):
    """Task ``tid``'s ggml buffers (a :class:`~.step_buffers.GGMLState` of its rows of the
    RunState ``rs``'s ``g_*`` arrays) or None (a stack without ggml weights)."""


@overload(task_ggml, jit_options=_OV)
def _ov_task_ggml(rs, tid):
    if isinstance(rs.types[rs.fields.index("g_xs16")], types.NoneType):
        return lambda rs, tid: None

    def impl(rs, tid):
        return GGMLState(rs.g_xs16[tid], rs.g_xsum[tid], rs.g_facc[tid], rs.g_xq[tid])
    return impl
