"""What the packed INT4 / ggml linear kernels share: argument checks, workspace arguments, the
int8 quantization of one activation block, zero padding of activation rows.

The kernels themselves: :mod:`.packed_i8` (the 8-row group layout of symmetric INT4 weights,
int8 activations), :mod:`.packed_i8_gemm` (its prefill GEMM and checked wrapper),
:mod:`.packed_f32` / :mod:`.packed_f32_vnni` (float32 activations on the same layout),
:mod:`.packed_zp` (the layout with zero points), :mod:`.ggml_packed` (ggml blocks in group
records); :func:`~.dispatch.dispatch` chooses among them. (The 64-row tiled layout that lived here
was chosen by nothing once the 8-row groups served every INT4 weight; it is gone, and so is its
persisted layout name ``olv.PackedInt4``.)
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

from olv_runtime.errors import InvalidArgument

from .config import JIT, check_array, check_int, check_out

__all__ = ["BLOCK", "prepare_call", "workspace_args", "quantize_block", "pad_rows"]

BLOCK = 32  # quantization block along K (the only block size of the packed layouts)


def workspace_args(m_max, k_max, n_tasks) -> tuple[int, int, int]:
    """Validated (m_max, k_max, n_tasks) of a ``make_workspace*`` call; ``n_tasks`` defaults to
    ``numba.config.NUMBA_NUM_THREADS`` (shared by every packed-kernel workspace)."""
    m_max = check_int(m_max, "m_max", lo=1)
    k_max = check_int(k_max, "k_max", lo=1)
    if n_tasks is None:
        n_tasks = int(numba.config.NUMBA_NUM_THREADS)
    return m_max, k_max, check_int(n_tasks, "n_tasks", lo=1)


@njit(**JIT)
def quantize_block(x, i, k0, ln, xq):
    """Symmetric int8 quantization of ``x[i, k0:k0+ln]`` into ``xq[i, k0:k0+32]`` (zero padded;
    ``xq`` may be int8 or int16). Returns ``(d, sum of the codes)`` with ``d = max|x| / 127`` and
    codes ``rint(x / d)`` (round half to even) clipped to [-127, 127]."""
    amax = np.float32(0.0)
    for p in range(ln):
        a = abs(x[i, k0 + p])
        if a > amax:
            amax = a
    d = amax / np.float32(127.0)
    tot = 0
    if amax > np.float32(0.0):
        for p in range(ln):
            v = np.rint(x[i, k0 + p] / d)
            if v > np.float32(127.0):
                v = np.float32(127.0)
            elif v < np.float32(-127.0):
                v = np.float32(-127.0)
            qv = np.int32(v)
            xq[i, k0 + p] = qv
            tot += qv
        for p in range(ln, BLOCK):
            xq[i, k0 + p] = 0
    else:
        for p in range(BLOCK):
            xq[i, k0 + p] = 0
    return d, tot


@njit(**JIT)
def pad_rows(x, m, k, kp, xpad):
    """``xpad[i, :k] = x[i, :k]`` and ``xpad[i, k:kp] = 0`` for rows ``i < m`` (float32)."""
    for i in range(m):
        for p in range(k):
            xpad[i, p] = x[i, p]
        for p in range(k, kp):
            xpad[i, p] = np.float32(0.0)


#: Old names, still imported elsewhere (kernels/paged_attention.py).
_quantize_block = quantize_block
_pad_rows = pad_rows


def prepare_call(x, packed, packed_cls, out, workspace, ws_cls, make_ws, ws_rows=None):
    """Argument handling shared by the packed linear wrappers.

    Checks ``packed`` is a ``packed_cls``, ``x`` is float32 ``[M, K]``, ``out`` is float32
    ``[M, N]`` (allocated when None) and ``workspace`` is a ``ws_cls`` serving ``M`` rows and
    ``Kp`` columns (made by ``make_ws(ws_rows or M, Kp, n_tasks=numba threads)`` when None).
    Returns ``(M, out, workspace)``; the workspace is None when ``M == 0``.

    Raises
    ------
    InvalidArgument
        Any argument of the wrong type, dtype or shape (expected vs got).
    """
    if not isinstance(packed, packed_cls):
        raise InvalidArgument(f"packed: expected a {packed_cls.__name__}, got {type(packed).__name__}")
    k, n, kp = packed.k, packed.n, packed.k_padded
    check_array(x, "x", dtype=np.float32, shape=(None, k))
    m = x.shape[0]
    out = check_out(out, "out", np.float32, (m, n))
    if m == 0:
        return m, out, None
    ws = workspace
    if ws is None:
        ws = make_ws(ws_rows or m, kp, n_tasks=numba.get_num_threads())
    elif not isinstance(ws, ws_cls):
        raise InvalidArgument(f"workspace: expected a {ws_cls.__name__}, got {type(ws).__name__}")
    elif ws.m_max < m or ws.k_max < kp:
        raise InvalidArgument(f"workspace: expected m_max >= {m} and k_max >= {kp}, got "
                              f"m_max={ws.m_max}, k_max={ws.k_max}")
    return m, out, ws
