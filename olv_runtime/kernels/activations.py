"""Elementwise activations fused for the SiLU-gated MLP.

``silu_mul(g, u) = (g * sigmoid(g)) * u`` with ``sigmoid(x) = 1 / (1 + exp(-x))`` in float32 —
the ONNX subgraph ``Mul(Mul(g, Sigmoid(g)), u)`` evaluated in one pass (results agree with the
unfused numpy evaluation to ~1 ulp: ``exp`` implementations differ in the last bit).

The ``exp`` of the compiled kernels is :func:`expf`: the float32 exponential of glibc's ``expf``
(the algorithm of Szabolcs Nagy's ARM optimized-routines: ``2^(k/32)`` from a 32-entry table of
doubles times a degree-3 polynomial of the reduced argument, all in float64, one rounding to
float32 at the end), written so LLVM vectorises a loop over it. ``np.exp`` in a numba loop is a
scalar call into libm (~4 ns per element here: 0.45-0.63 ms of SiLU per token of a 0.5B model,
bench/expf_check.py); the loop over :func:`expf` runs at a quarter of that and gives the same
bits: equal to libm's ``expf`` (glibc 2.36, its FMA build, which x86-64 CPUs with FMA run) on
every float32 input, NaN payloads included --
checked on all 2^32 bit patterns (``bench/expf_check.py``), tested on a sample and the edges
(tests/kernels/test_expf.py).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types, vectorize
from numba.core.extending import intrinsic

from .config import JIT, PARALLEL_MIN_WORK, PJIT, check_array, check_out

__all__ = ["silu_mul", "silu_mul_chunk", "expf"]


def _exp2_table() -> np.ndarray:
    """``T[i] = bits(2^(i/32)) - (i << 47)`` (uint64 [32]): ``2^(i/32)`` rounded to the nearest
    double, from exact integer arithmetic (the 32nd root as five nested integer square roots of
    ``2^(i + 32 * 60)``, i.e. ``floor(2^(i/32) * 2^60)``; never a tie: irrational for i > 0)."""
    t = np.empty(32, np.uint64)
    for i in range(32):
        v = 1 << (i + 32 * 60)
        for _ in range(5):
            v = math.isqrt(v)
        m = (v >> 8) + ((v >> 7) & 1)  # 61 -> 53 bits, to nearest
        bits = (1023 << 52) + (m - (1 << 52))
        t[i] = (bits - (i << 47)) % (1 << 64)
    return t


_EXP2_T = _exp2_table()
_INV_LN2_32 = float.fromhex("0x1.71547652b82fep+0") * 32  # 32 / ln 2
_SHIFT = float.fromhex("0x1.8p+52")                          # round to integer by addition
_C0 = float.fromhex("0x1.c6af84b912394p-5") / 32 / 32 / 32  # 2^(r/32) - 1 ~ r (C2 + r (C1 + r C0))
_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / 32 / 32
_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / 32
_OFLOW = np.float32(float.fromhex("0x1.62e42ep6"))    # x above: exp(x) overflows float32 (inf)
_UFLOW = np.float32(-float.fromhex("0x1.9fe368p6"))   # x below: exp(x) rounds to 0


@intrinsic
def _fma64(typingctx, a, b, c):
    """``a * b + c`` rounded once (float64; ``llvm.fma``: one instruction with FMA, libm's
    ``fma`` without)."""
    if not all(isinstance(t, types.Float) and t.bitwidth == 64 for t in (a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        d = ir.DoubleType()
        f = builder.module.declare_intrinsic("llvm.fma", [d], ir.FunctionType(d, [d, d, d]))
        return builder.call(f, args)
    return types.float64(types.float64, types.float64, types.float64), codegen


@intrinsic
def _f64_bits(typingctx, a):
    if not (isinstance(a, types.Float) and a.bitwidth == 64):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@intrinsic
def _bits_f64(typingctx, a):
    if not (isinstance(a, types.Integer) and a.bitwidth == 64):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(a), codegen


@njit(inline="always", **JIT)
def expf(x):
    """``exp(x)`` of a float32, bitwise glibc's ``expf`` (module docstring): ``x > 88.72`` gives
    inf, ``x < -103.97`` gives 0 (both selected, so the vector loop has no branch), NaN gives
    ``x + x`` (quiet, payload kept), results below 2^-126 are the subnormals of the float64
    result's rounding."""
    xd = np.float64(x)
    xr = xd if abs(xd) < 104.0 else 0.0  # the table path's input (exponent bits cannot wrap)
    z = _INV_LN2_32 * xr
    kd = z + _SHIFT
    ki = _f64_bits(kd)
    kd -= _SHIFT
    r = _fma64(_INV_LN2_32, xr, -kd)      # x / ln2 * 32 - k, |r| <= 1/2 (+ rounding)
    s = _bits_f64(_EXP2_T[ki & np.uint64(31)] + (ki << np.uint64(47)))  # 2^(k/32)
    p = _fma64(_C0, r, _C1)
    y = _fma64(_C2, r, 1.0)
    y = _fma64(p, r * r, y)
    y = np.float32(y * s)
    if xd > _OFLOW:
        y = np.float32(np.inf)
    if xd < _UFLOW:
        y = np.float32(0.0)
    if xd != xd:
        y = x + x  # a signalling NaN comes back quiet, as from glibc
    return y


@njit(**JIT)
def silu_mul_chunk(g, u, out):
    """``out[j] = (g[j] * (1 / (1 + exp(-g[j])))) * u[j]`` for ``j < len(g)`` (float32 1-d
    arrays, ``out`` may be ``g`` or ``u``; :func:`expf`). One vector loop: the compiled steps
    call it on contiguous slices (an inlined loop over 2-d indices stays scalar: 625 against
    152 us per token of a 0.5B model's SiLU, bench/expf_check.py shows the loop alone)."""
    one = np.float32(1.0)
    for j in range(g.shape[0]):
        x = g[j]
        out[j] = (x * (one / (one + expf(-x)))) * u[j]


@njit(**JIT)
def _silu_mul_range(g, u, out, lo, hi):
    silu_mul_chunk(g[lo:hi], u[lo:hi], out[lo:hi])


@njit(**JIT)
def _silu_mul_ser(g, u, out):
    _silu_mul_range(g, u, out, 0, g.shape[0])


@njit(**PJIT)
def _silu_mul_par(g, u, out, chunk):
    n = g.shape[0]
    nchunks = (n + chunk - 1) // chunk
    for c in prange(nchunks):
        lo = c * chunk
        hi = min(lo + chunk, n)
        _silu_mul_range(g, u, out, lo, hi)


def silu_mul(g: np.ndarray, u: np.ndarray, out=None) -> np.ndarray:
    """``(g * sigmoid(g)) * u`` elementwise.

    Parameters
    ----------
    g, u : ndarray of float32, same shape, C-contiguous
        Gate and up projections of the MLP.
    out : ndarray of float32, same shape, optional (may be ``g`` or ``u``)

    Returns
    -------
    ndarray of float32
    """
    check_array(g, "g", dtype=np.float32)
    check_array(u, "u", dtype=np.float32, shape=g.shape)
    out = check_out(out, "out", np.float32, g.shape)
    gf, uf, of = g.reshape(-1), u.reshape(-1), out.reshape(-1)
    if gf.size >= PARALLEL_MIN_WORK:
        _silu_mul_par(gf, uf, of, 16384)
    elif gf.size:
        _silu_mul_ser(gf, uf, of)
    return out


_ERF = []


def _erf_ufunc():
    """The numba ufunc of ``math.erf`` (float32, float64), built at the first :func:`erf` call:
    an eager ``@vectorize`` compiles (or loads) at ``import olv_runtime``, which every model
    paid for, Erf or not (cold start, issue 14)."""
    if not _ERF:
        def _erf(x):
            return math.erf(x)
        _ERF.append(vectorize(["float32(float32)", "float64(float64)"], cache=True)(_erf))
    return _ERF[0]


def erf(x: np.ndarray) -> np.ndarray:
    """The Gauss error function elementwise (ONNX Erf), float32/float64; float16 is computed in
    float32 and rounded back. Returns a new array of ``x``'s dtype and shape."""
    f = _erf_ufunc()
    if x.dtype == np.float16:
        return f(x.astype(np.float32)).astype(np.float16)
    return np.asarray(f(x), x.dtype)
