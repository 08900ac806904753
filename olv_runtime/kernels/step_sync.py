"""Synchronisation of the compiled decode step's tasks (:mod:`.decoder_layers`): int64 atomics,
a spin barrier, the phase profile stamps, and array views over raw addresses.

Every task of the step's one parallel region runs the same per-thread program and meets the
others at :func:`_barrier` after each operator that produces shared data. The barrier array
(int64 ``[barrier_slots(nt)]``) holds the arrival counter (slot 0), the generation (slot 8) and,
per task, the claim offset of its work range (:func:`.decoder_layers._claim`); a longer array
(``+ nt * PROF_SLOTS``) turns on the phase profile (:func:`_stamp`, bench/stack_phases.py).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.np.arrayobj import populate_array

from .config import JIT

__all__ = ["BARRIER_SLOTS", "WORK_SLOTS", "PROF_SLOTS", "PHASES", "barrier_slots", "cycles_now",
           "address"]

BARRIER_SLOTS = 16  # int64 [16]: counter at 0, generation at 8 (separate cache lines)
WORK_SLOTS = 8      # per task, after the barrier: its range's claim offset (one cache line each)


def _i64_ptr(context, builder, aty, aval, idx):
    ary = context.make_array(aty)(context, builder, aval)
    return builder.gep(ary.data, [idx])


@intrinsic
def _atomic_add(typingctx, arr, idx, val):
    """Atomic ``arr[idx] += val`` (seq_cst); returns the old value (int64 array)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = _i64_ptr(context, builder, sig.args[0], args[0], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", p, v, "seq_cst")
    return types.int64(arr, types.intp, val), codegen


@intrinsic
def _atomic_load(typingctx, arr, idx):
    """Atomic (seq_cst) load of ``arr[idx]`` (int64 array)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = _i64_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(p, "seq_cst", 8)
    return types.int64(arr, types.intp), codegen


@intrinsic
def _atomic_store(typingctx, arr, idx, val):
    """Atomic (seq_cst) store ``arr[idx] = val`` (int64 array)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        p = _i64_ptr(context, builder, sig.args[0], args[0], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, p, "seq_cst", 8)
        return context.get_dummy_value()
    return types.none(arr, types.intp, val), codegen


@intrinsic
def _pause(typingctx):
    """Spin-wait hint (x86 ``pause``)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def _yield_cpu(typingctx):
    """``sched_yield()`` (POSIX; libc is linked into the process, resolved by the JIT)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def _view(typingctx, like, addr, shape):
    """An array of ``like``'s exact type (dtype, rank, C layout, read-only flag) over the memory
    at address ``addr`` with ``shape`` (a tuple of ints; C-contiguous strides), without a
    meminfo: the caller keeps the memory alive (the Python side holds the arrays whose addresses
    it put in the tables, :class:`olv_runtime.executor.decoder_step.DecoderStack`). numba's typed lists
    of arrays cost seconds of compilation per process (their methods are not cached on disk) and
    per-call boxing; tables of addresses cost neither."""
    if not (isinstance(like, types.Array) and like.layout == "C"
            and isinstance(addr, types.Integer) and isinstance(shape, types.BaseTuple)
            and len(shape) == like.ndim and all(isinstance(t, types.Integer) for t in shape)):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.return_type
        ary = context.make_array(aryty)(context, builder)
        dt = context.get_data_type(aryty.dtype)
        isz = context.get_abi_sizeof(dt)
        intp = context.get_value_type(types.intp)
        dims = [context.cast(builder, builder.extract_value(args[2], i), sig.args[2][i],
                             types.intp) for i in range(aryty.ndim)]
        strides = []
        acc = ir.Constant(intp, isz)
        for dim in reversed(dims):
            strides.append(acc)
            acc = builder.mul(acc, dim)
        strides.reverse()
        a = context.cast(builder, args[1], sig.args[1], types.intp)
        data = builder.inttoptr(a, dt.as_pointer())
        populate_array(ary, data=data, shape=dims, strides=strides,
                       itemsize=ir.Constant(intp, isz), meminfo=None)
        return ary._getvalue()
    return like(like, addr, shape), codegen


@intrinsic
def _cycles(typingctx):
    """The CPU's time-stamp counter (``llvm.readcyclecounter``: ``rdtsc`` on x86)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


@njit(**JIT)
def cycles_now():
    """:func:`_cycles` from Python (benchmarks calibrate the counter's rate with it)."""
    return _cycles()


PROF_SLOTS = 32  # per task: time-stamp-counter ticks per phase (PHASES), the last stamp at 31
PHASES = ("input norm + quantize", "qkv linear", "wait after qkv", "rope + kv write + attention",
          "wait after attention", "merge heads", "quantize attn + o linear + residual",
          "wait after o", "post norm + quantize", "gate/up linear + silu*up", "wait after gate/up",
          "quantize act + down linear + residual", "wait after down",
          "final norm + quantize + lm_head", "final wait")


@njit(**JIT)
def _stamp(bar, tid, nt, k):
    """Phase profile (benchmarks only, bench/stack_phases.py): when the barrier array is longer
    than :func:`barrier_slots` (``+ nt * PROF_SLOTS``), add the ticks since this task's last
    stamp to its phase ``k``; with the normal array, nothing (one compare).

    A function of its own, called with ``np.int64(k)`` (one specialisation, not one per literal
    phase): numba's IR inlining at its 16 call sites cost ~1 s of the step's compilation (cold
    start); LLVM inlines the compiled function anyway (the step's optimised code is the same)."""
    base = BARRIER_SLOTS + WORK_SLOTS * nt
    if bar.shape[0] >= base + nt * PROF_SLOTS:
        o = base + tid * PROF_SLOTS
        now = _cycles()
        if k >= 0:
            bar[o + k] += now - bar[o + PROF_SLOTS - 1]
        bar[o + PROF_SLOTS - 1] = now


SPIN_LIMIT = 1 << 10  # pause-spins (~26 us here, ~25 ns each) before a waiting task yields its CPU


def barrier_slots(nt: int) -> int:
    """Length of the int64 barrier array of ``nt`` tasks (:func:`_barrier`,
    :func:`.decoder_layers._claim`)."""
    return BARRIER_SLOTS + WORK_SLOTS * nt


@njit(**JIT)
def _barrier(bar, nt):
    """All ``nt`` tasks wait here until every one has arrived (sense by generation count).
    A waiting task spins with ``pause``, then yields its CPU (``sched_yield``) so a descheduled
    partner on a busy machine gets to run instead of the spinner burning its time slice.
    The last task to arrive also resets the work ranges' claim offsets
    (:func:`.decoder_layers._claim`) before
    it releases the others: every task has then finished its claims of the linear before the
    barrier, and none claims from the next one yet."""
    if nt == 1:
        return
    gen = _atomic_load(bar, 8)
    if _atomic_add(bar, 0, 1) == nt - 1:
        _atomic_store(bar, 0, 0)
        for r in range(nt):
            _atomic_store(bar, BARRIER_SLOTS + WORK_SLOTS * r, 0)
        _atomic_add(bar, 8, 1)
    else:
        spins = 0
        while _atomic_load(bar, 8) == gen:
            if spins < SPIN_LIMIT:
                _pause()
                spins += 1
            else:
                _yield_cpu()


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first element (for the tables of
    :func:`.decoder_layers.decode_stack`)."""
    return int(a.__array_interface__["data"][0])
