"""RMS normalisation over the last axis.

Source: ONNX ``RMSNormalization`` (opset 23) with ``axis=-1`` and ``stash_type=1`` (float32);
arithmetic follows ``onnx/reference/ops/op_rms_normalization.py``::

    y = (x * (1 / sqrt(mean(x**2) + epsilon))) * weight

The mean of squares is accumulated in float64 (more accurate than the reference's float32 pairwise
sum; results agree to ~1e-7 relative), then every later step is float32 in the reference's order.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from olv_runtime.errors import InvalidArgument

from .config import JIT, PARALLEL_MIN_WORK, PJIT, check_array, check_out

__all__ = ["rms_norm"]


@njit(**JIT)
def _rms_norm_row(x, weight, eps, out):
    d = x.shape[0]
    acc = 0.0
    for i in range(d):
        v = np.float64(x[i])
        acc += v * v
    ms = np.float32(acc / d)
    rms = np.sqrt(ms + eps)
    rr = np.float32(1.0) / rms
    for i in range(d):
        out[i] = (x[i] * rr) * weight[i]


@njit(**PJIT)
def _rms_norm_par(x, weight, eps, out):
    for r in prange(x.shape[0]):
        _rms_norm_row(x[r], weight, eps, out[r])


@njit(**JIT)
def _rms_norm_ser(x, weight, eps, out):
    for r in range(x.shape[0]):
        _rms_norm_row(x[r], weight, eps, out[r])


def rms_norm(x: np.ndarray, weight: np.ndarray, epsilon: float, out=None) -> np.ndarray:
    """ONNX RMSNormalization (opset 23, axis=-1, stash_type=float32) of each row of ``x``.

    Parameters
    ----------
    x : ndarray of float32, shape [R, D], C-contiguous
    weight : ndarray of float32, shape [D]
        The ``scale`` input of the ONNX operator.
    epsilon : float
        Added to the mean of squares (cast to float32).
    out : ndarray of float32, shape [R, D], optional
        May be ``x`` itself (in place).

    Returns
    -------
    ndarray of float32, shape [R, D]
    """
    check_array(x, "x", dtype=np.float32, ndim=2)
    r, d = x.shape
    check_array(weight, "weight", dtype=np.float32, shape=(d,))
    try:
        eps = np.float32(epsilon)
    except (TypeError, ValueError):
        raise InvalidArgument(f"epsilon: expected a float, got {epsilon!r}") from None
    if not np.isfinite(eps) or eps < 0:
        raise InvalidArgument(f"epsilon: expected a finite value >= 0, got {epsilon!r}")
    out = check_out(out, "out", np.float32, (r, d))
    if r and d:
        if r * d >= PARALLEL_MIN_WORK and r > 1:
            _rms_norm_par(x, weight, eps, out)
        else:
            _rms_norm_ser(x, weight, eps, out)
    return out
