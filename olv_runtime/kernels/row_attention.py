"""Attention of rows from many sequences over one pool of KV blocks (the batching engine's step).

A step of :class:`olv_runtime.engine.Engine` runs ``R`` rows at once: decode rows of running
sequences and chunks of prompts, each row at its own position in its own sequence. Their keys and
values live in one pool of fixed-size blocks shared by every sequence (vLLM's paged attention;
llama.cpp's unified KV cache), per layer ``[NB, KVH, BS, D]``; a sequence is a block table (the
pool's block ids in position order). Row ``r`` of sequence ``s`` at position ``p`` attends keys
``0..p`` of ``s`` (causal): blocks ``0 .. p // BS`` of its table, the last one up to ``p % BS``.

Each task is one (row, kv head) pair and serves the kv head's ``H/KVH`` query heads, as each row
of the contiguous prefill attention's blocks (:func:`olv_runtime.kernels.attention._attend_task`):
the same online-softmax tile function (:func:`~olv_runtime.kernels.attention._attend_rows`) is
called once per block, over the block's rows. When the block size is a multiple of the tile
(:data:`~olv_runtime.kernels.attention.TILE`, 64), the tiles are the contiguous kernel's, so a row's
output is bitwise what the contiguous prefill computes for it; in every case a row's output depends
only on its query and its sequence's keys -- never on the other rows of the step, on how the prompt
was chunked, or on which block ids the pool handed out (batch invariance). Inside a tile the
``p @ V`` of each query head keeps its output row in registers (:func:`~olv_runtime.kernels
.attention._pv16`, keys in order) for head dims that are a multiple of 16.

Storage formats of the pool (``kv_dtype``): float32 (read in place), float16 (uint16 bits, read
through a float32 scratch of one block), int8 and int4 (symmetric, one float32 scale per token
and kv head, written by :func:`quantize_rows`; int4 two per byte, element ``2i`` in the low
nibble, stored as ``q + 8``; read through the scratch). A token's stored form depends on
that token's values alone.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core.extending import overload

from olv_runtime.errors import InvalidArgument

from .attention import (
    ATTENTION_PARALLEL_WORK,
    SLACK,
    TILE,
    _attend_rows,
    _state_finish,
    _state_init,
)
from .config import JIT, PJIT
from .paged_ir import _half_to_f32

__all__ = ["FORMATS", "attend_rows", "quantize_rows", "write_rows"]

#: Pool storage formats: name -> numpy dtype of the stored K/V elements.
FORMATS = {"float32": np.float32, "float16": np.uint16, "int8": np.int8, "int4": np.uint8}

_OV = {"fastmath": False, "error_model": "numpy"}  # the JIT flags overload implementations take


def _decode_block(src, scl, blk, g, n, dst):
    """Rows ``0..n`` of block ``blk``, kv head ``g`` into ``dst`` float32 [BS, D]: float16 bits
    (uint16 pool) converted, or int8 times the per-token scale ``scl[blk, g, t]``."""


@overload(_decode_block, jit_options=_OV)
def _ov_decode_block(src, scl, blk, g, n, dst):
    if src.dtype == types.uint16:
        def f16(src, scl, blk, g, n, dst):
            d = dst.shape[1]
            for t in range(n):
                for i in range(d):
                    dst[t, i] = _half_to_f32(src[blk, g, t, i])
        return f16
    if src.dtype == types.uint8:
        def i4(src, scl, blk, g, n, dst):
            half = dst.shape[1] // 2
            for t in range(n):
                s = scl[blk, g, t]
                for i in range(half):
                    b = np.int32(src[blk, g, t, i])
                    dst[t, 2 * i] = np.float32((b & 15) - 8) * s
                    dst[t, 2 * i + 1] = np.float32((b >> 4) - 8) * s
        return i4

    def i8(src, scl, blk, g, n, dst):
        d = dst.shape[1]
        for t in range(n):
            s = scl[blk, g, t]
            for i in range(d):
                dst[t, i] = np.float32(src[blk, g, t, i]) * s
    return i8


@njit(inline="always", **JIT)
def _task_f32(task, q, kp, vp, tables, row_seq, pos, scale, bs, out):
    kvh = kp.shape[1]
    h_n = q.shape[1]
    group = h_n // kvh
    r = task // kvh
    g = task - r * kvh
    p = pos[r]
    tab = tables[row_seq[r]]
    m = np.empty(group, np.float32)
    l = np.empty(group, np.float32)
    sc = np.empty((group, TILE + SLACK), np.float32)
    pr = np.empty((group, TILE + SLACK), np.float32)
    mx = np.empty(group, np.float32)
    o = out[r, g * group:(g + 1) * group]
    _state_init(m, l, o, group)
    qg = q[r, g * group:(g + 1) * group]
    zero = np.int64(0)
    for b in range(p // bs + 1):
        n = np.int64(min(bs, p + 1 - b * bs))
        blk = tab[b]
        _attend_rows(qg, group, kp[blk, g], vp[blk, g], zero, n, scale, m, l, o, sc, pr, mx)
    _state_finish(l, o, group, o)


@njit(inline="always", **JIT)
def _task_enc(task, q, kp, vp, ks, vs, tables, row_seq, pos, scale, bs, out):
    kvh = kp.shape[1]
    d = q.shape[2]  # the head dim (an int4 pool stores D/2 bytes per row)
    h_n = q.shape[1]
    group = h_n // kvh
    r = task // kvh
    g = task - r * kvh
    p = pos[r]
    tab = tables[row_seq[r]]
    m = np.empty(group, np.float32)
    l = np.empty(group, np.float32)
    sc = np.empty((group, TILE + SLACK), np.float32)
    pr = np.empty((group, TILE + SLACK), np.float32)
    mx = np.empty(group, np.float32)
    kb = np.empty((bs, d), np.float32)
    vb = np.empty((bs, d), np.float32)
    o = out[r, g * group:(g + 1) * group]
    _state_init(m, l, o, group)
    qg = q[r, g * group:(g + 1) * group]
    zero = np.int64(0)
    for b in range(p // bs + 1):
        n = np.int64(min(bs, p + 1 - b * bs))
        blk = tab[b]
        _decode_block(kp, ks, blk, g, n, kb)
        _decode_block(vp, vs, blk, g, n, vb)
        _attend_rows(qg, group, kb, vb, zero, n, scale, m, l, o, sc, pr, mx)
    _state_finish(l, o, group, o)


@njit(**PJIT)
def _attend_f32_par(q, kp, vp, tables, row_seq, pos, scale, bs, out):
    for task in prange(q.shape[0] * kp.shape[1]):
        _task_f32(task, q, kp, vp, tables, row_seq, pos, scale, bs, out)


@njit(**JIT)
def _attend_f32_ser(q, kp, vp, tables, row_seq, pos, scale, bs, out):
    for task in range(q.shape[0] * kp.shape[1]):
        _task_f32(task, q, kp, vp, tables, row_seq, pos, scale, bs, out)


@njit(**JIT)
def _attend_enc_ser(q, kp, vp, ks, vs, tables, row_seq, pos, scale, bs, out):
    for task in range(q.shape[0] * kp.shape[1]):
        _task_enc(task, q, kp, vp, ks, vs, tables, row_seq, pos, scale, bs, out)


@njit(**PJIT)
def _attend_enc_par(q, kp, vp, ks, vs, tables, row_seq, pos, scale, bs, out):
    for task in prange(q.shape[0] * kp.shape[1]):
        _task_enc(task, q, kp, vp, ks, vs, tables, row_seq, pos, scale, bs, out)


def attend_rows(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, k_scale, v_scale,
                tables: np.ndarray, row_seq: np.ndarray, pos: np.ndarray, scale: float,
                out: np.ndarray) -> np.ndarray:
    """Causal GQA attention of ``R`` rows, each over its own sequence's blocks.

    Parameters
    ----------
    q : float32 [R, H, D], C-contiguous
        The rows' rotated queries.
    k_pool, v_pool : [NB, KVH, BS, D], C-contiguous, one layer of the pool
        float32, uint16 (float16 bits) or int8 (see ``k_scale``). ``H % KVH == 0``.
    k_scale, v_scale : float32 [NB, KVH, BS] or None
        Per token and kv head scales of an int8 pool (None otherwise).
    tables : int32 [S, MB]
        Block table per sequence of the step (pool block ids in position order).
    row_seq : int32 [R]
        The sequence (row of ``tables``) of each row.
    pos : int64 [R]
        Each row's position; its keys ``0..pos`` must have been written.
    scale : float
        Multiplies ``q . k`` (float32).
    out : float32 [R, H, D], C-contiguous

    Returns
    -------
    ``out``.

    Raises
    ------
    InvalidArgument
        Shapes or dtypes that disagree, a position beyond its table.
    """
    r_n, h_n, d = q.shape
    _, kvh, bs, d2 = k_pool.shape
    if k_pool.dtype == np.uint8:  # int4: two per byte
        d2 *= 2
    if (q.dtype != np.float32 or d2 != d or h_n % kvh or v_pool.shape != k_pool.shape
            or out.shape != q.shape or out.dtype != np.float32 or row_seq.shape != (r_n,)
            or pos.shape != (r_n,) or tables.dtype != np.int32 or tables.ndim != 2):
        raise InvalidArgument(
            f"attend_rows: q {q.dtype}{list(q.shape)}, pool {k_pool.dtype}{list(k_pool.shape)}, "
            f"tables {tables.dtype}{list(tables.shape)}, row_seq {list(row_seq.shape)}, "
            f"pos {list(pos.shape)}, out {out.dtype}{list(out.shape)} do not agree")
    if r_n and int(pos.max()) // bs >= tables.shape[1]:
        raise InvalidArgument(f"attend_rows: a position {int(pos.max())} is beyond the block "
                              f"table ({tables.shape[1]} blocks of {bs})")
    sc = np.float32(scale)
    # the same tasks serially or over the threads (a parallel start costs more than a few
    # short rows' work, as in the contiguous kernel)
    par = r_n * kvh > 1 and (int(pos.sum()) + r_n) * h_n * d >= ATTENTION_PARALLEL_WORK
    if k_pool.dtype == np.float32:
        fn = _attend_f32_par if par else _attend_f32_ser
        fn(q, k_pool, v_pool, tables, row_seq, pos, sc, np.int64(bs), out)
    else:
        if k_pool.dtype == np.uint16:
            k_scale = v_scale = _NO_SCALE
        fn = _attend_enc_par if par else _attend_enc_ser
        fn(q, k_pool, v_pool, k_scale, v_scale, tables, row_seq, pos, sc, np.int64(bs), out)
    return out


_NO_SCALE = np.zeros((1, 1, 1), np.float32)


def quantize_rows(x: np.ndarray, qmax: int = 127):
    """Symmetric quantization of ``x`` float32 [R, KVH, D] with one scale per (row, kv head):
    ``scale = max|x| / qmax`` (1 where the row is zero), ``q = rint(x / scale)`` in
    ``[-qmax, qmax]`` (127: int8, 7: int4). Returns ``(q int8 [R, KVH, D], scale float32
    [R, KVH])``; each row's result depends on that row only."""
    amax = np.abs(x).max(axis=2)
    scale = (amax / np.float32(qmax)).astype(np.float32)
    scale[scale == 0] = 1.0
    q = np.rint(x / scale[:, :, None]).clip(-qmax, qmax).astype(np.int8)
    return q, scale


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 [R, KVH, D] in [-7, 7] -> uint8 [R, KVH, D/2]: ``(q[2i] + 8) | (q[2i+1] + 8) << 4``."""
    u = (q + 8).astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def write_rows(k_pool, v_pool, k_scale, v_scale, blocks: np.ndarray, offsets: np.ndarray,
               k: np.ndarray, v: np.ndarray) -> None:
    """Store rows ``k``, ``v`` float32 [R, KVH, D] at (block ``blocks[r]``, row ``offsets[r]``) of
    one layer of the pool, in the pool's format (float16 rounds to nearest even; int8 and int4 per
    :func:`quantize_rows`)."""
    if k_pool.dtype == np.float32:
        k_pool[blocks, :, offsets, :] = k
        v_pool[blocks, :, offsets, :] = v
    elif k_pool.dtype == np.uint16:
        k_pool[blocks, :, offsets, :] = k.astype(np.float16).view(np.uint16)
        v_pool[blocks, :, offsets, :] = v.astype(np.float16).view(np.uint16)
    else:
        int4 = k_pool.dtype == np.uint8
        qk, sk = quantize_rows(k, 7 if int4 else 127)
        qv, sv = quantize_rows(v, 7 if int4 else 127)
        k_pool[blocks, :, offsets, :] = _pack_int4(qk) if int4 else qk
        v_pool[blocks, :, offsets, :] = _pack_int4(qv) if int4 else qv
        k_scale[blocks, :, offsets] = sk
        v_scale[blocks, :, offsets] = sv
