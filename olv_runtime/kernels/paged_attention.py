"""Fused attention over a paged KV cache whose blocks have heterogeneous encodings.

Source: ONNX ``Attention`` (opset 23) semantics (GQA: query head ``h`` reads kv head
``h // (H / KVH)``; bottom-right aligned causal mask: the query at absolute position ``p`` attends
keys at positions ``<= p``; softmax in float32), seed 000 "Quantized and paged caches use the same
feedback" (no full-cache copy or dequantization), online softmax (Milakov & Gimelshein 2018;
FlashAttention's streaming form).

Block storage (see :mod:`olv_runtime.kv.paged`): block slots live in *chunks*; one chunk holds
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

The attention kernel reads blocks through a *block table*: an int64 array with one row per block
(:data:`TABLE_COLS`: per side the format code, the slot's raw address, the scale address and a
per-token-scale flag; then the block's first position and its valid tokens; :func:`table_row`).
The table is plain data, so a compiled decode step takes it as an argument
(:mod:`olv_runtime.kernels.decoder_layers`). Each (kv head, query) task makes one pass over the
blocks for every query head of its group (GQA): consecutive blocks fill one softmax tile of up to
:func:`tile_width` keys. Scores of float32 rows are read straight from the block; a side of
another format is decoded one block and kv head at a time (``BS x D`` floats, 4 KiB for 16 x 64)
into a private scratch that stays in L1 -- INT8/INT4 codes converted by one vector loop and
multiplied by the token's (or block's) scale, float16 by ``fpext``, codebook indices by table
lookup -- and used at once by every query head of the group, then overwritten by the next block.
Then one online-softmax update per head and tile with vectorised exponentials
(:func:`~.attention._softmax_tile`), then ``o += p @ V`` (the value side decoded the same way,
its scales folded into the probabilities; with ``D % 16 == 0`` the output rows of four query
heads stay in registers over a block's keys, :func:`~.paged_ir._make_pv`).

With ``int8_query`` (the compiled decode step in int8-activation mode) the scores of INT8/INT4
key blocks are integer dot products: each query head is quantized to int8 once per call (one
scale per head), 16 keys at a time are scored by ``vpdpbusd`` (AVX-512 VNNI) or ``vpmaddwd``
(AVX2; chosen at run time by :func:`~.packed_i8.isa`, bitwise equal) on the block's own codes,
and the exact integer sum times ``(query scale * attention scale) * key scale`` is the score
(:func:`~.paged_ir._qk16_i8`). On the VNNI path (``D <= 256``) the 16 key rows are loaded and transposed in
registers once for all the query heads of the group, each head then taking one ``vpdpbusd`` per
4 features with no horizontal sums (:func:`~.paged_ir._qkblk_i8`). On the AVX2 path the 8 query
heads of a pass sit in the lanes of one vector instead (:func:`~.paged_ir._qkg_i8`, INT8 keys,
``D <= 256``): each key row is loaded and sign-extended once, one ``vpmaddwd`` accumulator per head,
the 8 accumulators summed across lanes in one shuffle tree and the 8 keys' results transposed into
the score rows -- the same exact sums and epilogue (bitwise equal). float16 key rows (any mode,
``D % 64 == 0``) are scored the same way against the float32 queries (:func:`~.paged_ir._qkg_f16`:
converted in registers by ``vcvtph2ps``, one fused multiply-add per 8 features and head, no decoded
scratch). INT8/INT4 value rows are decoded in
registers inside ``p @ V`` (codes sign-extended, converted, times the row's scale; up to eight
query heads per pass, :func:`~.paged_ir._make_pvq`): no decoded copy of a quantized value
block. The block format -- codes and scales -- is read as it is. The cache is never dequantized into a buffer
(``bytes_dequantized`` stays 0): the workspace of a call (:func:`workspace_bytes`) depends on the
query and head counts and the block size only.

A query with no attendable key gets zeros (fully masked rows are defined). Sealing (conversion of
a full block into a quantized format) is :func:`convert_block`.

The code, by role (every name is importable from here, as before the split):
:mod:`.paged_table` the block table and chunk sides; :mod:`.paged_ir` the LLVM-IR intrinsics;
:mod:`.paged_blocks` the per-block kernels (scores, ``p @ V``, int8 queries, prefetch) and the
bundles the tile loop passes them (:class:`SoftmaxState`, :class:`TileScratch`,
:class:`Int8Query`); :mod:`.paged_convert` the sealing; this module the tile loop over a block
range (:func:`_attend_blocks`), the parallel driver and :func:`paged_attention`.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types

from olv_runtime.errors import InvalidArgument

from .attention import SLACK, _state_finish, _state_init, _tile_max_init
from .config import JIT, PJIT, lazy_njit
from .packed_i8 import use_vnni

# the pieces of the kernel, by role (re-exported: other modules import them from here)
from .paged_blocks import (  # noqa: F401
    PREFETCH_BLOCKS,
    Int8Query,
    SoftmaxState,
    TileScratch,
    _block_accum,
    _block_scores,
    _block_scores_i8,
    _flush,
    _prefetch_block,
    _quantize_heads,
)
from .paged_convert import convert_block
from .paged_ir import QKBLK_MAX_D, _f32_to_half, _f32p, _half_to_f32, _u8p, _u16p  # noqa: F401
from .paged_table import (  # noqa: F401
    F16_TABLE,
    FORMAT_CODES,
    T_KADDR,
    T_KFMT,
    T_KPT,
    T_KSADDR,
    T_LEN,
    T_START,
    T_VADDR,
    T_VFMT,
    T_VPT,
    T_VSADDR,
    TABLE_COLS,
    ChunkSide,
    dummy_side,
    table_row,
)

__all__ = ["FORMAT_CODES", "ChunkSide", "paged_attention", "convert_block", "F16_TABLE",
           "dummy_side"]

#: Keys per softmax tile of the paged kernel (16 blocks of 16): per tile and kv head one call
#: over its blocks, one online-softmax update per query head (:func:`_softmax_tile`). Wider than
#: the contiguous kernel's :data:`~.attention.TILE` (64): the paged kernel's per-tile costs
#: (block list, rescales, calls) are paid 4x less often -- one layer of 4096 INT8 keys and 14
#: query heads, 1 thread: 204-217 us against 261 us at 64 keys (bench-only run, 2026-12-01).
PAGED_TILE = 256


def tile_width(block_size: int) -> int:
    """Keys per softmax tile of the paged kernel: :data:`PAGED_TILE`, or the block size if
    larger."""
    return max(PAGED_TILE, int(block_size))


def workspace_bytes(s: int, h: int, kvh: int, d: int, block_size: int = 16) -> int:
    """Bytes of the attention workspace of one call for ``S`` queries: per (kv head, query) task
    the running max/sum and output accumulator of the group's heads, two tiles of scores, four
    decoded block and head with its row multipliers and the tile's block list -- independent of
    the context length."""
    g = h // kvh
    w = tile_width(block_size)
    bs = int(block_size)
    per_task = 4 * (3 * g + g * d + 2 * g * (w + SLACK) + bs * d + bs) + 16 * w
    return s * kvh * per_task


@njit(**JIT)
def _attend_blocks(qg, ng, table, b0, b1, g, bs, qpos, causal, scale, st, ws, qq, bmax, pfh):
    """Blocks ``table[b0:b1]`` of kv head ``g`` into the partial softmax state ``st`` of the
    ``ng`` query heads ``qg`` float32 [ng, D] of the query at position ``qpos`` (keys at
    positions ``> qpos`` skipped when ``causal``; ``scale`` multiplies ``q . k``).

    ``st`` (:class:`SoftmaxState`): running max ``m`` and sum ``l`` float32 [ng], output
    accumulator ``o`` float32 [ng, D]. ``ws`` (:class:`TileScratch`): consecutive blocks share
    one softmax tile of up to ``W = ws.sc.shape[1] - SLACK`` keys, ``W >= BS``. ``qq``
    (:class:`Int8Query`): when ``qq.on`` and ``D % 64 == 0``, scores of INT8/INT4 key blocks
    from the int8 queries (:func:`_quantize_heads`; ``qq.vnni`` the instruction path;
    ``ws.rmul`` then [BS + 16]). The rows of kv heads ``g .. g + pfh - 1`` of blocks before
    ``bmax`` are prefetched :data:`PREFETCH_BLOCKS` ahead (``pfh`` 0: none)."""
    d = qg.shape[1]
    # the bundles unpacked once per call (a field read inside the loop would update the
    # array's reference count per block)
    on, vnni, qi, qip, qmul, qsum = qq
    sc, p, mx, scr, rmul, pend = ws
    iq = on and d % 64 == 0
    w = sc.shape[1] - SLACK
    c = 0
    npend = 0
    _tile_max_init(mx, ng)
    for bi in range(b0, b1):
        nk = table[bi, T_LEN]
        if causal:
            nk = min(nk, qpos - table[bi, T_START] + 1)
        if nk <= 0:
            continue
        if pfh and bi + PREFETCH_BLOCKS < bmax:
            _prefetch_block(table, bi + PREFETCH_BLOCKS, g, pfh, bs, d)
        if c + nk > w:
            _flush(table, npend, ng, g, bs, d, c, st, ws)
            c = 0
            npend = 0
            _tile_max_init(mx, ng)
        kf = table[bi, T_KFMT]
        if iq and (kf == 2 or kf == 3):
            _block_scores_i8(qi, qip, qmul, qsum, ng, (kf, table[bi, T_KADDR],
                             table[bi, T_KSADDR], table[bi, T_KPT]), g, bs, d, nk, sc, c, mx,
                             rmul, vnni)
        else:
            _block_scores(qg, ng, kf, table[bi, T_KADDR], table[bi, T_KSADDR],
                          table[bi, T_KPT], g, bs, d, nk, scale, sc, c, mx, scr, rmul)
        pend[npend, 0] = bi
        pend[npend, 1] = nk
        npend += 1
        c += nk
    if c:
        _flush(table, npend, ng, g, bs, d, c, st, ws)


@njit(**JIT)
def _paged_task(t, q, table, nblocks, past_len, scale, causal, kvh, bs, w, iq, vnni, out):
    s_n, h_n, d = q.shape
    ng = h_n // kvh
    s = t // kvh
    g = t - s * kvh
    m = np.empty(ng, np.float32)
    l = np.empty(ng, np.float32)
    mx = np.empty(ng, np.float32)
    sc = np.empty((ng, w + SLACK), np.float32)
    p = np.empty((ng, w + SLACK), np.float32)
    scr = np.empty((bs, d), np.float32)
    rmul = np.zeros(bs + SLACK, np.float32)
    pend = np.empty((w, 2), np.int64)
    qi = np.zeros((ng, d), np.int8)
    qip = np.zeros((ng, d), np.int8)
    qmul = np.zeros(ng, np.float32)
    qsum = np.zeros(ng, np.int32)
    qg = q[s, g * ng:(g + 1) * ng]
    if iq:
        _quantize_heads(qg, 0, ng, scale, qi, qip, qmul, qsum)
    o = out[s, g * ng:(g + 1) * ng]
    _state_init(m, l, o, ng)
    _attend_blocks(qg, ng, table, 0, nblocks, g, bs, past_len + s, causal, scale,
                   SoftmaxState(m, l, o), TileScratch(sc, p, mx, scr, rmul, pend),
                   Int8Query(iq, vnni, qi, qip, qmul, qsum), nblocks, 1)
    _state_finish(l, o, ng, o)


_PAGED_SIG = types.void(
    types.Array(types.float32, 3, "C"),   # q [S, H, D]
    types.Array(types.int64, 2, "C"),     # table [>= n, TABLE_COLS]
    types.int64, types.int64, types.float32, types.boolean,  # n blocks, past_len, scale, causal
    types.int64, types.int64, types.int64,  # KVH, BS, tile width
    types.boolean, types.boolean,         # int8 queries, VNNI path
    types.Array(types.float32, 3, "C"),   # out [S, H, D]
)


@lazy_njit(_PAGED_SIG, **PJIT)
def _paged_par(q, table, nblocks, past_len, scale, causal, kvh, bs, w, iq, vnni, out):
    for t in prange(q.shape[0] * kvh):
        _paged_task(t, q, table, nblocks, past_len, scale, causal, kvh, bs, w, iq, vnni, out)


def paged_attention(q: np.ndarray, table: np.ndarray, nblocks: int, past_len: int, scale: float,
                    is_causal: bool, kv_heads: int, block_size: int, out: np.ndarray,
                    keepalive=None, int8_query: bool = False) -> np.ndarray:
    """Attention of ``S`` new queries over paged KV blocks (GQA, online softmax, fused dequant).

    Parameters
    ----------
    q : ndarray of float32, shape [S, H, D], C-contiguous
        Queries of one sequence (batch 1), RoPE applied.
    table : ndarray of int64, shape [>= nblocks, TABLE_COLS], C-contiguous
        Block table: per block the key and value side's format code (:data:`FORMAT_CODES`), the
        slot's address, its scale address and per-token-scale flag, then the absolute position
        of the block's first token and its valid tokens (rows from :func:`table_row`). The
        addresses are raw: the caller keeps the chunks alive (``keepalive``) for the call.
        Blocks may come in any order (the online softmax is order independent up to rounding).
    nblocks : int
        Rows of ``table`` read.
    past_len : int
        Tokens before the new ones; query ``s`` sits at position ``past_len + s``.
    scale : float
        Multiplies ``q . k``.
    is_causal : bool
        Query at position ``p`` attends keys at positions ``<= p``; otherwise all keys.
    kv_heads : int
        ``KVH``; ``H % KVH == 0``.
    block_size : int
        ``BS``, tokens per block slot.
    out : ndarray of float32, shape [S, H, D], C-contiguous
    int8_query : bool
        Scores of INT8/INT4 key blocks as integer dot products (``D % 64 == 0``; other blocks
        and head sizes as without it): each query head is quantized to int8 once per call
        (``d = max|q| / 127``, codes ``rint(q / d)`` clipped to [-127, 127], as the int8
        activations of the linears), the score of key ``t`` is
        ``float32(sum_i qcode_i * kcode_{t,i}) * ((d * scale) * kscale_t)`` -- the key codes and
        scales of the block format used as they are. The compiled decode step does this in
        int8-activation mode (``SessionOptions(quantize_activations=True)``).

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
    if (table.dtype != np.int64 or table.ndim != 2 or table.shape[1] != TABLE_COLS
            or table.shape[0] < nblocks or not table.flags.c_contiguous):
        raise InvalidArgument(f"table: expected a C-contiguous int64 [>= {nblocks}, "
                              f"{TABLE_COLS}] array, got {table.dtype} {list(table.shape)}")
    if s:
        _paged_par(q, table, int(nblocks), int(past_len), np.float32(scale), bool(is_causal),
                   int(kv_heads), int(block_size), tile_width(block_size), bool(int8_query),
                   use_vnni(), out)
    return out
