"""Sealing: conversion of one block of the paged KV cache into a quantized format (int8, int4
or codebook2), :func:`convert_block`. Formats and arrays as in :mod:`.paged_attention`.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types

from olv_runtime.errors import InvalidArgument

from .config import JIT, lazy_njit
from .paged_table import _COD, _SCL, _SIDE, _TAB, ChunkSide

__all__ = ["convert_block"]


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
            bad = np.float32(0.0)  # NaN once a NaN/inf is seen (``a > amax`` skips NaN)
            for t in range(ntok):
                _load_row(sfmt, sf32, su16, scodes, sscale, stable, sslot, g, t, row)
                for i in range(d):
                    a = abs(row[i])
                    bad += a - a
                    if a > amax:
                        amax = a
            bscale = (amax + bad) / qmax
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
                    bad = np.float32(0.0)
                    for j in range(32):
                        a = abs(row[grp * 32 + j])
                        bad += a - a
                        if a > amax:
                            amax = a
                    amax += bad
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
                bad = np.float32(0.0)
                for i in range(d):
                    a = abs(row[i])
                    bad += a - a
                    if a > amax:
                        amax = a
                s = (amax + bad) / qmax
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
