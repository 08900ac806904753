"""Fused attention over a paged KV cache whose blocks have heterogeneous encodings.

Source: ONNX ``Attention`` (opset 23) semantics (GQA: query head ``h`` reads kv head
``h // (H / KVH)``; bottom-right aligned causal mask: the query at absolute position ``p`` attends
keys at positions ``<= p``; softmax in float32), seed 000 "Quantized and paged caches use the same
feedback" (no full-cache copy or dequantization), online softmax (Milakov & Gimelshein 2018;
FlashAttention's streaming form).

Block storage (see :mod:`olv_runtime.state.paged`): block slots live in *chunks*; one chunk holds
``capacity`` slots of one (key format, value format) pair. The kernel sees one chunk side (K or V)
as five arrays, only those of its format being real (the others are 1-element dummies):

============ ============================================ =======================================
format       arrays                                       element ``(slot, g, t, i)``
============ ============================================ =======================================
0 float32    ``f32``  float32 [cap, KVH, BS, D]            ``f32[slot, g, t, i]``
1 float16    ``u16``  uint16  [cap, KVH, BS, D] (bits)     ``table[u16[...]]`` (65536-entry LUT)
2 int8       ``codes`` uint8 [cap, KVH, BS, 1, D],         ``int8(codes[slot, g, t, 0, i]) *
             ``scale`` float32 [cap, KVH, SB, 1]            scale[slot, g, t or 0, 0]``
3 int4       ``codes`` uint8 [cap, KVH, BS, 1, D/2]        signed nibble ``i % 2`` (low first)
             (two codes per byte, low nibble first)          of byte ``i // 2``, times the scale
4 codebook2  ``codes`` uint8 [cap, KVH, BS, D/32, 8]       ``table[index] * scale[slot, g, t, i//32]``
             (32 x 2-bit indices, LSB first), ``scale``     with ``index`` = bits ``2*(i%4)`` of
             float32 [cap, KVH, BS, D/32], ``table`` [4]     byte ``(i % 32) // 4`` (type 1102)
============ ============================================ =======================================

``SB`` is ``BS`` (scales per token and head) or 1 (per block and head).

Dequantization happens inside the loop, one ``D``-row of one kv head at a time into a private
``[D]`` scratch row: no block is ever dequantized into a buffer. The workspace of one call is the
running max ``m[S, H]``, sum ``l[S, H]`` and un-normalised output ``acc[S, H, D]`` plus two rows
per kv head: ``4 * (S*H*(D+2) + 2*KVH*D)`` bytes, independent of the context length.

Three tiers (STYLE.md): ``_load_row`` (serial, inlined), ``_paged_segment`` (parallel over kv
heads, one chunk's blocks), and the public :func:`paged_attention` (validates, calls once per
chunk, normalises). A query with no attendable key gets zeros (fully masked rows are defined).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from olv_runtime.errors import InvalidArgument

from .config import JIT, PJIT, lazy_njit

__all__ = ["FORMAT_CODES", "ChunkSide", "paged_attention", "convert_block", "F16_TABLE",
           "dummy_side"]

#: Block format name -> kernel code.
FORMAT_CODES = {"float32": 0, "float16": 1, "int8": 2, "int4": 3, "codebook2": 4}

#: float16 bits -> float32, exact (numba has no float16 arithmetic).
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_F32 = types.Array(types.float32, 4, "A")
_U16 = types.Array(types.uint16, 4, "A")
_COD = types.Array(types.uint8, 5, "A")
_SCL = types.Array(types.float32, 4, "A")
_TAB = types.Array(types.float32, 1, "A")
_SIDE = (types.int64, _F32, _U16, _COD, _SCL, _TAB)


@njit(inline="always", **JIT)
def _load_row(fmt, f32, u16, codes, scale, table, slot, g, t, row):
    """Dequantize token ``t`` of kv head ``g`` of block ``slot`` into ``row[D]`` (registers/L1)."""
    d = row.shape[0]
    if fmt == 0:
        for i in range(d):
            row[i] = f32[slot, g, t, i]
    elif fmt == 1:
        for i in range(d):
            row[i] = table[u16[slot, g, t, i]]
    elif fmt == 2:
        st = t if scale.shape[2] > 1 else 0
        s = scale[slot, g, st, 0]
        for i in range(d):
            c = np.int32(codes[slot, g, t, 0, i])
            row[i] = np.float32((c ^ 128) - 128) * s
    elif fmt == 3:
        st = t if scale.shape[2] > 1 else 0
        s = scale[slot, g, st, 0]
        for i in range(d):
            b = np.int32(codes[slot, g, t, 0, i >> 1])
            n = (b >> ((i & 1) * 4)) & 15
            row[i] = np.float32((n ^ 8) - 8) * s
    else:
        for i in range(d):
            grp = i >> 5
            j = i & 31
            b = np.int32(codes[slot, g, t, grp, j >> 2])
            idx = (b >> ((j & 3) * 2)) & 3
            row[i] = table[idx] * scale[slot, g, t, grp]


_SEG_SIG = types.void(
    types.Array(types.float32, 3, "C"),        # q [S, H, D]
    types.Array(types.int64, 1, "C"),          # kslots [n]
    types.Array(types.int64, 1, "C"),          # vslots [n]
    types.Array(types.int64, 1, "C"),          # starts [n] (absolute position of token 0)
    types.Array(types.int64, 1, "C"),          # lens [n] (valid tokens)
    types.int64, types.float32, types.boolean,  # past_len, scale, causal
    *_SIDE, *_SIDE,                             # K side, V side
    types.Array(types.float32, 2, "C"),        # m [S, H]
    types.Array(types.float32, 2, "C"),        # l [S, H]
    types.Array(types.float32, 3, "C"),        # acc [S, H, D]
    types.Array(types.float32, 2, "C"),        # krow [KVH, D]
    types.Array(types.float32, 2, "C"),        # vrow [KVH, D]
)


@lazy_njit(_SEG_SIG, **PJIT)
def _paged_segment(q, kslots, vslots, starts, lens, past_len, scale, causal,
                   kfmt, kf32, ku16, kcodes, kscale, ktable,
                   vfmt, vf32, vu16, vcodes, vscale, vtable,
                   m, l, acc, krow, vrow):
    s_n, h_n, d = q.shape
    kvh = krow.shape[0]
    group = h_n // kvh
    nb = kslots.shape[0]
    for g in prange(kvh):
        kr = krow[g]
        vr = vrow[g]
        for bi in range(nb):
            kslot = kslots[bi]
            vslot = vslots[bi]
            start = starts[bi]
            for t in range(lens[bi]):
                pos = start + t
                s0 = 0
                if causal:
                    s0 = pos - past_len
                    if s0 < 0:
                        s0 = 0
                    if s0 >= s_n:
                        break  # later tokens of the block are later still
                _load_row(kfmt, kf32, ku16, kcodes, kscale, ktable, kslot, g, t, kr)
                _load_row(vfmt, vf32, vu16, vcodes, vscale, vtable, vslot, g, t, vr)
                for hh in range(group):
                    h = g * group + hh
                    for s in range(s0, s_n):
                        qv = q[s, h]
                        a0 = np.float32(0.0)
                        a1 = np.float32(0.0)
                        a2 = np.float32(0.0)
                        a3 = np.float32(0.0)
                        d4 = d - d % 4
                        for i in range(0, d4, 4):
                            a0 += qv[i] * kr[i]
                            a1 += qv[i + 1] * kr[i + 1]
                            a2 += qv[i + 2] * kr[i + 2]
                            a3 += qv[i + 3] * kr[i + 3]
                        for i in range(d4, d):
                            a0 += qv[i] * kr[i]
                        sc = ((a0 + a1) + (a2 + a3)) * scale
                        o = acc[s, h]
                        mx = m[s, h]
                        if sc > mx:
                            corr = np.exp(mx - sc)  # exp(-inf) = 0 for the first key
                            l[s, h] = l[s, h] * corr + np.float32(1.0)
                            for i in range(d):
                                o[i] = o[i] * corr + vr[i]
                            m[s, h] = sc
                        else:
                            p = np.exp(sc - mx)
                            l[s, h] += p
                            for i in range(d):
                                o[i] += p * vr[i]


@njit(**JIT)
def _finish(m, l, acc, out):
    s_n, h_n, d = acc.shape
    for s in range(s_n):
        for h in range(h_n):
            if l[s, h] > 0:
                inv = np.float32(1.0) / l[s, h]
                for i in range(d):
                    out[s, h, i] = acc[s, h, i] * inv
            else:  # fully masked row (no key attended): zeros, as the contiguous kernel
                for i in range(d):
                    out[s, h, i] = np.float32(0.0)


class ChunkSide:
    """The kernel arrays of one side (K or V) of one chunk (see the module table).

    Attributes
    ----------
    fmt : int
        Format code (:data:`FORMAT_CODES`).
    f32, u16, codes, scale, table : numpy.ndarray
        The format's arrays (dummies for the others).
    row_bytes : int
        Payload bytes the kernel reads per token and kv head (codes + its share of scales).
    """

    __slots__ = ("fmt", "f32", "u16", "codes", "scale", "table", "row_bytes")

    def __init__(self, fmt, f32=None, u16=None, codes=None, scale=None, table=None, row_bytes=0):
        self.fmt = int(fmt)
        self.f32 = _DUMMY_F32 if f32 is None else f32
        self.u16 = _DUMMY_U16 if u16 is None else u16
        self.codes = _DUMMY_COD if codes is None else codes
        self.scale = _DUMMY_SCL if scale is None else scale
        self.table = _DUMMY_TAB if table is None else table
        self.row_bytes = int(row_bytes)

    def args(self):
        return (self.fmt, self.f32, self.u16, self.codes, self.scale, self.table)


_DUMMY_F32 = np.zeros((1, 1, 1, 1), np.float32)
_DUMMY_U16 = np.zeros((1, 1, 1, 1), np.uint16)
_DUMMY_COD = np.zeros((1, 1, 1, 1, 1), np.uint8)
_DUMMY_SCL = np.zeros((1, 1, 1, 1), np.float32)
_DUMMY_TAB = np.zeros(1, np.float32)


def dummy_side() -> ChunkSide:
    return ChunkSide(0)


def workspace_bytes(s: int, h: int, kvh: int, d: int) -> int:
    """Bytes of the attention workspace for ``S`` queries (independent of the context)."""
    return 4 * (s * h * (d + 2) + 2 * kvh * d)


def paged_attention(q: np.ndarray, segments, past_len: int, scale: float, is_causal: bool,
                    kv_heads: int, out: np.ndarray, workspace=None) -> np.ndarray:
    """Attention of ``S`` new queries over paged KV blocks (GQA, online softmax, fused dequant).

    Parameters
    ----------
    q : ndarray of float32, shape [S, H, D], C-contiguous
        Queries of one sequence (batch 1), RoPE applied.
    segments : iterable of (ChunkSide, ChunkSide, kslots, vslots, starts, lens)
        Per (K chunk, V chunk) pair: its K and V sides and the blocks read from it: ``kslots`` /
        ``vslots`` int64 [n] (slots in the chunks), ``starts`` int64 [n] (absolute position of the block's first token),
        ``lens`` int64 [n] (valid tokens). Blocks may come in any order (the online softmax is
        order independent up to rounding).
    past_len : int
        Tokens before the new ones; query ``s`` sits at position ``past_len + s``.
    scale : float
        Multiplies ``q . k``.
    is_causal : bool
        Query at position ``p`` attends keys at positions ``<= p``; otherwise all keys.
    kv_heads : int
        ``KVH``; ``H % KVH == 0``.
    out : ndarray of float32, shape [S, H, D], C-contiguous
    workspace : tuple of arrays, optional
        ``(m [S,H], l [S,H], acc [S,H,D], krow [KVH,D], vrow [KVH,D])`` float32, reused.

    Returns
    -------
    ndarray
        ``out``.

    Raises
    ------
    InvalidArgument
        Shapes or dtypes that do not match, ``H`` not a multiple of ``KVH``.
    """
    if q.dtype != np.float32 or q.ndim != 3 or not q.flags.c_contiguous:
        raise InvalidArgument(f"q: expected a C-contiguous float32 [S, H, D] array, got "
                              f"{q.dtype} {list(q.shape)}")
    s, h, d = q.shape
    if kv_heads <= 0 or h % kv_heads:
        raise InvalidArgument(f"kv_heads: expected a divisor of the {h} query heads, got {kv_heads}")
    if out.shape != q.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InvalidArgument(f"out: expected float32 {list(q.shape)}, got {out.dtype} "
                              f"{list(out.shape)}")
    if workspace is None:
        workspace = make_workspace(s, h, kv_heads, d)
    m, l, acc, krow, vrow = workspace
    m[:s].fill(-np.inf)
    l[:s].fill(0.0)
    acc[:s].fill(0.0)
    m, l, acc = m[:s], l[:s], acc[:s]
    sc = np.float32(scale)
    for kside, vside, kslots, vslots, starts, lens in segments:
        if len(kslots):
            _paged_segment(q, kslots, vslots, starts, lens, int(past_len), sc, bool(is_causal),
                           *kside.args(), *vside.args(), m, l, acc, krow, vrow)
    _finish(m, l, acc, out)
    return out


def make_workspace(s: int, h: int, kvh: int, d: int):
    """The float32 workspace arrays of :func:`paged_attention` for up to ``S`` queries."""
    return (np.empty((s, h), np.float32), np.empty((s, h), np.float32),
            np.empty((s, h, d), np.float32), np.empty((kvh, d), np.float32),
            np.empty((kvh, d), np.float32))


# -- sealing: conversion of one block into another format ---------------------------------------
_CONV_SIG = types.void(*_SIDE, types.int64, types.int64,          # source side, slot, tokens
                       types.int64, _COD, _SCL, _TAB, types.int64,  # dest fmt, codes, scale, table, slot
                       types.Array(types.float32, 1, "C"))          # row scratch [D]


@lazy_njit(_CONV_SIG, **JIT)
def _convert_block(sfmt, sf32, su16, scodes, sscale, stable, sslot, ntok,
                   dfmt, dcodes, dscale, dtable, dslot, row):
    """Quantize block ``sslot`` (any format) into ``dslot`` of an int8/int4/codebook2 side.

    Symmetric: int8 codes round(x / s) with s = absmax / 127; int4 s = absmax / 7 (codes in
    [-7, 7]); codebook2 s = absmax of the 32-group, index = nearest codebook entry of x / s.
    Scales per token and head when ``dscale.shape[2] > 1``, else per block and head (absmax over
    the block's valid tokens). Tokens past ``ntok`` get code 0 (and scale 0 per token).
    """
    kvh = dscale.shape[1]
    bs = dcodes.shape[2]
    d = row.shape[0]
    per_token = dscale.shape[2] > 1
    qmax = np.float32(127.0) if dfmt == 2 else np.float32(7.0)
    for g in range(kvh):
        if dfmt != 4 and not per_token:
            amax = np.float32(0.0)
            for t in range(ntok):
                _load_row(sfmt, sf32, su16, scodes, sscale, stable, sslot, g, t, row)
                for i in range(d):
                    a = abs(row[i])
                    if a > amax:
                        amax = a
            bscale = amax / qmax
            dscale[dslot, g, 0, 0] = bscale
        for t in range(bs):
            if t >= ntok:
                for gi in range(dcodes.shape[3]):
                    for j in range(dcodes.shape[4]):
                        dcodes[dslot, g, t, gi, j] = 0
                if per_token or dfmt == 4:
                    for gi in range(dscale.shape[3]):
                        dscale[dslot, g, t, gi] = 0.0
                continue
            _load_row(sfmt, sf32, su16, scodes, sscale, stable, sslot, g, t, row)
            if dfmt == 4:
                for grp in range(d >> 5):
                    amax = np.float32(0.0)
                    for j in range(32):
                        a = abs(row[grp * 32 + j])
                        if a > amax:
                            amax = a
                    dscale[dslot, g, t, grp] = amax
                    inv = np.float32(1.0) / amax if amax > 0 else np.float32(0.0)
                    for jb in range(8):
                        byte = 0
                        for k in range(4):
                            x = row[grp * 32 + jb * 4 + k] * inv
                            best = 0
                            bd = abs(x - dtable[0])
                            for c in range(1, 4):
                                dd = abs(x - dtable[c])
                                if dd < bd:
                                    bd = dd
                                    best = c
                            byte |= best << (2 * k)
                        dcodes[dslot, g, t, grp, jb] = byte
                continue
            if per_token:
                amax = np.float32(0.0)
                for i in range(d):
                    a = abs(row[i])
                    if a > amax:
                        amax = a
                s = amax / qmax
                dscale[dslot, g, t, 0] = s
            else:
                s = dscale[dslot, g, 0, 0]
            inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
            if dfmt == 2:
                for i in range(d):
                    c = np.int32(np.rint(row[i] * inv))
                    c = min(max(c, -127), 127)
                    dcodes[dslot, g, t, 0, i] = np.uint8(c & 255)
            else:
                for i in range(0, d, 2):
                    c0 = min(max(np.int32(np.rint(row[i] * inv)), -7), 7)
                    c1 = min(max(np.int32(np.rint(row[i + 1] * inv)), -7), 7)
                    dcodes[dslot, g, t, 0, i >> 1] = np.uint8((c0 & 15) | ((c1 & 15) << 4))


def convert_block(src: ChunkSide, src_slot: int, ntok: int, dst: ChunkSide, dst_slot: int,
                  head_dim: int) -> None:
    """Convert one block side into a quantized format (int8, int4 or codebook2).

    Parameters
    ----------
    src : ChunkSide
        Source chunk side (any format), block ``src_slot`` with ``ntok`` valid tokens.
    dst : ChunkSide
        Destination chunk side of format int8, int4 or codebook2; slot ``dst_slot`` is written.
    head_dim : int
        ``D`` (int4 needs it even, codebook2 a multiple of 32).
    """
    if dst.fmt not in (2, 3, 4):
        raise InvalidArgument(f"dst: expected an int8/int4/codebook2 side, got format {dst.fmt}")
    row = np.empty(head_dim, np.float32)
    _convert_block(*src.args(), int(src_slot), int(ntok), dst.fmt, dst.codes, dst.scale,
                   dst.table, int(dst_slot), row)
