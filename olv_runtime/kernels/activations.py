"""Elementwise activations fused for the SiLU-gated MLP.

``silu_mul(g, u) = (g * sigmoid(g)) * u`` with ``sigmoid(x) = 1 / (1 + exp(-x))`` in float32 —
the ONNX subgraph ``Mul(Mul(g, Sigmoid(g)), u)`` evaluated in one pass (results agree with the
unfused numpy evaluation to ~1 ulp: ``exp`` implementations differ in the last bit).
"""
from __future__ import annotations

import concurrent.futures
import math

import numpy as np
from numba import njit, prange, vectorize

from .config import (
    JIT,
    PARALLEL_MIN_WORK,
    PJIT,
    check_array,
    check_out,
    get_num_threads,
)

__all__ = ["silu_mul", "silu_mul_np"]


@njit(**JIT)
def _silu_mul_range(g, u, out, lo, hi):
    one = np.float32(1.0)
    for i in range(lo, hi):
        x = g[i]
        sig = one / (one + np.exp(-x))
        out[i] = (x * sig) * u[i]


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


#: float32 elements per pass of :func:`silu_mul_np` (128 KiB: g, u and out chunks stay in L2).
NP_CHUNK = 32768
_POOL: list = []  # [ThreadPoolExecutor, its worker count]: made at the first parallel call


def _silu_np_rows(g2, u2, o2, r0, r1):
    rows = max(1, NP_CHUNK // max(g2.shape[1], 1))
    with np.errstate(over="ignore"):
        for a in range(r0, r1, rows):
            b = min(a + rows, r1)
            gc, uc, oc = g2[a:b], u2[a:b], o2[a:b]
            np.negative(gc, out=oc)
            np.exp(oc, out=oc)
            np.add(oc, np.float32(1.0), out=oc)
            np.divide(np.float32(1.0), oc, out=oc)
            np.multiply(gc, oc, out=oc)
            np.multiply(oc, uc, out=oc)


def silu_mul_np(g2: np.ndarray, u2: np.ndarray, o2: np.ndarray) -> None:
    """``o2 = (g2 * (1 / (1 + exp(-g2)))) * u2`` with numpy's float32 ``exp`` (several times
    faster than a scalar libm ``exp`` in a numba loop, and the unfused ONNX graph's result
    bitwise): per row chunk of :data:`NP_CHUNK` elements the six numpy passes (``negative``,
    ``exp``, ``add``, ``divide``, ``multiply``, ``multiply``; a compiled loop for the last four
    measured slower: on the strided halves of a merged gate|up output numba's loop stays scalar,
    1.1 ns per element against numpy's 0.7). From ``PARALLEL_MIN_WORK`` elements the rows are
    split over :func:`~.config.get_num_threads` threads (numpy's loops release the GIL; before,
    the step ran on one thread while the GEMMs around it used all). The per-element operations
    do not depend on the split: bitwise the same.

    Parameters
    ----------
    g2, u2 : ndarray of float32, (rows, n), last axis contiguous (may be views of one wider
        array, e.g. the halves of a merged gate|up output)
    o2 : ndarray of float32, (rows, n), written (may be ``g2`` or ``u2``)
    """
    m = g2.shape[0]
    nt = min(get_num_threads(), m) if g2.size >= PARALLEL_MIN_WORK else 1
    if nt <= 1:
        _silu_np_rows(g2, u2, o2, 0, m)
        return
    if not _POOL or _POOL[1] < nt - 1:
        if _POOL:
            _POOL[0].shutdown(wait=False)
            _POOL.clear()
        _POOL.extend([concurrent.futures.ThreadPoolExecutor(
            nt - 1, thread_name_prefix="olv-silu"), nt - 1])
    cuts = [m * t // nt for t in range(nt + 1)]
    futs = [_POOL[0].submit(_silu_np_rows, g2, u2, o2, cuts[t], cuts[t + 1])
            for t in range(1, nt)]
    _silu_np_rows(g2, u2, o2, cuts[0], cuts[1])
    for f in futs:
        f.result()


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
