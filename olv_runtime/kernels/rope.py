"""Rotary position embedding.

Source: ONNX ``RotaryEmbedding`` (opset 23), arithmetic as in
``onnx/reference/ops/op_rotary_embedding.py``: for each head, the first ``rotary_dim`` features
are split into pairs ``(x1, x2)`` — halves ``x[:R/2], x[R/2:R]`` (``interleaved=False``) or
``x[2i], x[2i+1]`` (``interleaved=True``) — and rotated::

    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2

Features past ``rotary_dim`` are copied. Same operation order as the reference, no FMA contraction
(``fastmath=False``), so results are bit-identical to it.

Layout here is ``[B, S, NH, D]`` (the 3-D ``[B, S, NH*D]`` ONNX input reshaped without copy);
``cos``/``sin`` are the caches already gathered per position, ``[B, S, R/2]``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from olv_runtime.errors import InvalidArgument

from .config import JIT, PARALLEL_MIN_WORK, PJIT, check_array, check_int, check_out

__all__ = ["rotary_embedding"]


@njit(**JIT)
def _rope_token(x, cos, sin, interleaved, rdim, out):
    """One token: x/out [NH, D], cos/sin [R/2]."""
    nh = x.shape[0]
    d = x.shape[1]
    half = rdim // 2
    for h in range(nh):
        if interleaved:
            for i in range(half):
                x1 = x[h, 2 * i]
                x2 = x[h, 2 * i + 1]
                out[h, 2 * i] = cos[i] * x1 - sin[i] * x2
                out[h, 2 * i + 1] = sin[i] * x1 + cos[i] * x2
        else:
            for i in range(half):
                x1 = x[h, i]
                x2 = x[h, half + i]
                out[h, i] = cos[i] * x1 - sin[i] * x2
                out[h, half + i] = sin[i] * x1 + cos[i] * x2
        for i in range(rdim, d):
            out[h, i] = x[h, i]


@njit(**PJIT)
def _rope_par(x, cos, sin, interleaved, rdim, out):
    b = x.shape[0]
    s = x.shape[1]
    for t in prange(b * s):
        bi = t // s
        si = t - bi * s
        _rope_token(x[bi, si], cos[bi, si], sin[bi, si], interleaved, rdim, out[bi, si])


@njit(**JIT)
def _rope_ser(x, cos, sin, interleaved, rdim, out):
    for bi in range(x.shape[0]):
        for si in range(x.shape[1]):
            _rope_token(x[bi, si], cos[bi, si], sin[bi, si], interleaved, rdim, out[bi, si])


def rotary_embedding(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool,
                     rotary_dim: int, out=None) -> np.ndarray:
    """ONNX RotaryEmbedding (opset 23) on ``[B, S, NH, D]`` activations.

    Parameters
    ----------
    x : ndarray of float32, shape [B, S, NH, D], C-contiguous
    cos, sin : ndarray of float32, shape [B, S, rotary_dim/2], C-contiguous
        Cosine/sine of the rotation angle per position (the caches gathered by position).
    interleaved : bool
        Pairs are ``(2i, 2i+1)`` when True, ``(i, i + rotary_dim/2)`` when False.
    rotary_dim : int
        Number of rotated features per head: even, ``0 < rotary_dim <= D``; 0 means ``D``
        (ONNX ``rotary_embedding_dim`` default).
    out : ndarray of float32, shape [B, S, NH, D], optional
        May be ``x`` itself (in place).

    Returns
    -------
    ndarray of float32, shape [B, S, NH, D]
    """
    check_array(x, "x", dtype=np.float32, ndim=4)
    b, s, nh, d = x.shape
    rdim = check_int(rotary_dim, "rotary_dim", lo=0, hi=d)
    if rdim == 0:
        rdim = d
    if rdim % 2:
        raise InvalidArgument(f"rotary_dim: expected an even number, got {rdim}")
    check_array(cos, "cos", dtype=np.float32, shape=(b, s, rdim // 2))
    check_array(sin, "sin", dtype=np.float32, shape=(b, s, rdim // 2))
    if not isinstance(interleaved, (bool, np.bool_, int)):
        raise InvalidArgument(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    out = check_out(out, "out", np.float32, x.shape)
    if x.size:
        if x.size >= PARALLEL_MIN_WORK and b * s > 1:
            _rope_par(x, cos, sin, bool(interleaved), rdim, out)
        else:
            _rope_ser(x, cos, sin, bool(interleaved), rdim, out)
    return out
