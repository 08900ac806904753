"""The compiled decode step's arguments as named bundles (llama2.c's ``RunState``): the weights,
the model's dimensions, the activations, the attention scratch and the KV cache (contiguous
capacity buffers or paged block tables), plus the workspace that owns the buffers.

The bundles are ``collections.namedtuple`` classes: numba types an instance as a named tuple
of its fields' types (one field access inside the compiled code is a struct member, no
boxing), so :func:`.decoder_layers._stack_thread` takes 13 parameters instead of 42 or 52, and
its contiguous and paged specialisations differ only by the type of the KV bundle
(:class:`KVContig` or :class:`KVPaged`). Shapes below: E hidden size, H query heads, KVH kv
heads, D head dim, L layers, V vocab, ``nt`` tasks, I the MLP's intermediate size.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from olv_runtime.errors import InvalidArgument

from . import packed_f32, packed_f32_vnni, packed_i8
from .attention import SLACK, TILE
from .step_sync import address, barrier_slots

__all__ = ["StepWeights", "StepDims", "RunState", "GGMLState", "AttState", "KVContig",
           "KVPaged", "StackWorkspace", "WeightTable"]

GROUP_ROWS = packed_i8.GROUP_ROWS
GROUP_BLOCK_BYTES = packed_i8.GROUP_BLOCK_BYTES

StepWeights = namedtuple("StepWeights", [
    "wt",        # int64 [P, 7]: per part of a linear (WeightTable.wt; columns W_*): address of
                 # the codes (INT4) or records (ggml), address of the scale (INT4) or record
                 # bytes (ggml), NG, KB (INT4 blocks / ggml records per group), kind (0 INT4, a
                 # ggml type id), first group in its linear, output rows
    "codes0",    # uint8 [NG, KB, 128] read-only: the type of every codes view (_weight), or
                 # None: no INT4 part (a GGUF file without Q4_0 tensors), no INT4 kernel
    "scale0",    # float32 or uint16 [NG, KB, 8] read-only: the type of every scale view
    "biases",    # float32 [L, N_qkv]: q/k/v bias (zeros where a layer has none)
    "has_bias",  # bool [L]
    "norms",     # float32 [2L + 1, E]: input and post-attention norm weights per layer, final
    "eps",       # float32: RMSNorm epsilon
    "wl",        # int64 [4L + 1, 4]: per linear (qkv, o, gate_up, down per layer, lm_head;
                 # columns L_*): first part row of wt, parts, NG (all parts), bytes per group
    "ggml0",     # uint8 [NG, NREC, RB] (GGMLPacked.data's type) or None: a stack without ggml
                 # weights (None) does not compile the ggml kernels
    "qk_norms",  # float32 [L, 2, D] read-only: per layer the q and the k head RMSNorm weights
                 # (Qwen3, epsilon ``eps``), or None: no head norm (none compiled)
], defaults=(None, None, None))

#: Columns of :attr:`WeightTable.wt` (one row per part of a linear).
W_A, W_B, W_NG, W_KB, W_KIND, W_G0, W_N = range(7)
#: Columns of :attr:`WeightTable.wl` (one row per linear).
L_P0, L_NP, L_NG, L_GB = range(4)

StepDims = namedtuple("StepDims", [
    "n_heads",      # int: H
    "n_kv",         # int: KVH (H % KVH == 0)
    "d",            # int: D
    "rdim",         # int: rotary dims per head (<= D, even)
    "interleaved",  # bool: RoPE on (even, odd) pairs instead of halves
    "att_scale",    # float: softmax scale of the scores
    "inter",        # int: I (gate rows [0, I), up rows [I, 2I) of the gate_up weight)
    "vnni",         # bool: the int8 kernels' VNNI path (packed_i8.use_vnni())
])

RunState = namedtuple("RunState", [
    "xa", "xb",  # float32 [1, E]: the residual stream's two buffers (x0 -> xa -> xb -> xa ...)
    "qkv",       # float32 [1, N_qkv]: q, k, v of the token (shared; keys rotated in place)
    "qpa",       # float32 [nt, 1, H*D]: per task, the rotated queries
    "qpa3",      # float32 [nt, H, D]: the same memory per head
    "gu",        # float32 [1, 2I]: gate rows then up rows
    "act",       # float32 [1, I]: SiLU(gate) * up
    "hx",        # float32 [nt, 1, E]: per task, the normed activations
    "facc32",    # float32 [nt, ROWS_MAX * 8]: per task, the float kernels' accumulators
    # per task, the ggml kernels' buffers ([nt, ...] arrays of GGMLState's fields), or None
    # when the stack has no ggml weights (flat: the parallel driver takes no nested tuples)
    "g_xs16", "g_xsum", "g_facc", "g_xq",
], defaults=(None, None, None, None))

GGMLState = namedtuple("GGMLState", [  # one task's rows of RunState.g_*
    "xs16",  # int32 [nt, 1, Kp/16]: per task, per-16 sums of the int8 activations (Q6_K)
    "xsum",  # float32 [nt, 1, Kp/32]: per task, per-32 float sums of the activations (Q4_1,
             # Q5_1, Q4_K, Q5_K; exact mode)
    "facc",  # float32 [nt, 1, 8]: per task, a partial last group's rows (store_group)
    "xq",    # int8 [nt, 1, 32]: the int8 codes argument of ggml_packed._act_sums in exact
             # mode (never read there)
])

AttState = namedtuple("AttState", [
    "pm", "pl",  # float32 [nt, H]: per task, the partial softmax max and sum of every head
    "po",        # float32 [nt, H, D]: per task, the partial (unnormalised) outputs
    "attn_p",    # float32 [nt, 1, H*D]: per task, the merged attention output (private copy)
    "asc",       # float32 [nt, H/KVH, W + SLACK]: per task, a tile's scores
    "ap",        # float32 [nt, H/KVH, W + SLACK]: per task, a tile's probabilities
    "amx",       # float32 [nt, H/KVH]: per task, the tile max
])

KVContig = namedtuple("KVContig", [
    "kvt",  # int64 [L, 3]: per layer address of the key and of the value capacity buffer
            # (float32 [1, KVH, CAP, D], C-contiguous), CAP
    "kv0",  # float32 [1, KVH, 1, D]: any C-contiguous writeable array of the views' type
    "pos",  # int64 [L]: the slot t the new key/value go to (the token attends to t + 1 keys)
])

KVPaged = namedtuple("KVPaged", [
    "tabs",   # typed list of L int64 [>= nblk[l], TABLE_COLS] block tables (.paged_attention)
    "nblk",   # int64 [L]: rows used (the last one is the open float32/float16 block)
    "pos",    # int64 [L]: the new token's index inside the open block
    "bs",     # int: block size BS (tokens)
    "scr",    # float32 [nt, BS, D]: per task, one decoded block and head
    "rmul",   # float32 [nt, BS + SLACK]: per task, its row multipliers
    "pend",   # int64 [nt, W, 2]: per task, a tile's block list
    "kvnew",  # float32 [nt, 2, KVH*D]: the new key and value rows (written by the last task)
    "iq",     # bool: int8 queries against INT8/INT4 key blocks (int8-activation mode)
    "qi",     # int8 [nt, H, D]: per task, the quantized queries
    "qip",    # int8 [nt, H, D]: the same in INT4 order
    "qmul",   # float32 [nt, H] (line-padded rows): per head scale
    "qsum",   # int32 [nt, H] (line-padded rows): per head code sum
])


# ------------------------------------------------------------------------------------------------
# workspace
# ------------------------------------------------------------------------------------------------
class StackWorkspace:
    """Buffers of :func:`.decoder_layers.decode_stack` for ``nt`` tasks (shared activations,
    per-task scratch)."""

    def __init__(self, nt, e, n_qkv, hd, n_gu, inter, vocab, k_max):
        kp = 32 * (-(-k_max // 32))
        kb = kp // 32
        self.nt = nt
        self.xa = np.zeros((1, e), np.float32)
        self.xb = np.zeros((1, e), np.float32)
        self.qkv = np.zeros((1, n_qkv), np.float32)
        self.attn = np.zeros((1, hd), np.float32)
        self.qp = np.zeros((nt, 1, hd), np.float32)        # private rotated queries
        self._qp3 = None
        self.gu = np.zeros((1, n_gu), np.float32)
        self.act = np.zeros((1, inter), np.float32)
        self.hx = np.zeros((nt, 1, e), np.float32)          # private normed activations
        self.xq = packed_i8._aligned_empty((nt, 1, kp), np.int8)
        self.xq[...] = 0
        self.xd = np.zeros((nt, 1, kb), np.float32)
        self.xs8 = np.zeros((nt, 1, kb), np.int32)
        # per-task scratch on cache lines of its own (packed_i8.task_scratch)
        self.facc8 = packed_i8.task_scratch(nt, (1, GROUP_ROWS), np.float32)
        self.facc32 = packed_i8.task_scratch(nt, (packed_f32.ROWS_MAX * GROUP_ROWS,), np.float32)
        # exact mode on the VNNI path: per-task activation digits (packed_f32_vnni)
        self.dgt = tuple(a.reshape((nt, 1) + a.shape[1:]) for a in
                         packed_f32_vnni.digit_buffers(nt, kb if packed_i8.HOST_VNNI else 0))
        self.bar = np.zeros(barrier_slots(nt), np.int64)
        self.vocab = vocab
        self.i8 = (self.xq, self.xd, self.xs8, self.facc8)  # int8 mode's per-task buffers
        self._att = None
        self._q3 = None
        self._kp = kp
        self._ggml = None

    def ggml_buffers(self, has_ggml):
        """The per-task buffers of the ggml kernels (a :class:`GGMLState` of ``[nt, ...]``
        arrays, made at the first call; RunState's ``g_*`` fields), or 4 None when the stack
        has no ggml weights."""
        if not has_ggml:
            return (None,) * 4
        if self._ggml is None:
            nt, kp = self.nt, self._kp
            self._ggml = GGMLState(np.zeros((nt, 1, kp // 16), np.int32),
                                   np.zeros((nt, 1, kp // 32), np.float32),
                                   packed_i8.task_scratch(nt, (1, GROUP_ROWS), np.float32),
                                   np.zeros((nt, 1, 32), np.int8))
        return self._ggml

    def qprivate(self, n_heads, d):
        """Per-task rotated queries ``[nt, 1, H*D]`` and the same memory as ``[nt, H, D]``."""
        if self.qp.shape[2] != n_heads * d:
            raise InvalidArgument(f"qprivate: {n_heads} x {d} query features, the workspace "
                                  f"holds {self.qp.shape[2]}")
        if self._qp3 is None:
            self._qp3 = self.qp.reshape(self.nt, n_heads, d)
        return self.qp, self._qp3

    def q3(self, n_heads, d):
        """The query part of ``qkv`` viewed as float32 [H, D] (no copy)."""
        if self._q3 is None or self._q3[0] is not self.qkv:
            self._q3 = (self.qkv, self.qkv[0, :n_heads * d].reshape(n_heads, d))
        return self._q3[1]

    def attention(self, n_heads, n_kv, d, width=TILE):
        """Attention buffers: per task partial max/sum/output ``pm, pl [nt, H]``, ``po [nt, H,
        D]``, the private merged output ``attn_p [nt, 1, H*D]``, scores/probabilities
        ``[nt, H/KVH, width]`` and the tile max ``[nt, H/KVH]``."""
        a = self._att
        if a is None or a[4].shape[2] != width + SLACK:
            nt, g = self.nt, n_heads // n_kv
            ts = packed_i8.task_scratch  # rows on cache lines of their own
            a = self._att = (ts(nt, (n_heads,), np.float32),
                             ts(nt, (n_heads,), np.float32),
                             ts(nt, (n_heads, d), np.float32),
                             ts(nt, (1, n_heads * d), np.float32),
                             ts(nt, (g, width + SLACK), np.float32),
                             ts(nt, (g, width + SLACK), np.float32),
                             ts(nt, (g,), np.float32))
        return a

    def paged(self, d, width, n_kv, bs, n_heads):
        """Paged-step scratch: one decoded block and head ``[nt, BS, D]`` with its row
        multipliers ``[nt, BS + 16]``, a tile's block list ``[nt, width, 2]`` int64, the new
        key/value rows ``[nt, 2, KVH*D]``; the int8 queries of int8-activation mode
        (:func:`~.paged_attention._quantize_heads`): codes and INT4-order codes ``[nt, H, D]``
        int8, ``qmul [nt, H]`` float32, ``qsum [nt, H]`` int32; the partial softmax max/sum
        ``pm, pl [nt, H]`` and the tile max ``[nt, H/KVH]`` of the paged step. Rows of the
        small per-task arrays are padded to whole 64-byte lines (views of ``[nt, >= 16]``
        arrays): the tasks update them all through the attention, and two tasks' rows in one
        cache line would bounce it between the cores."""
        a = getattr(self, "_paged", None)
        if a is None or a[2].shape[1] != width or a[0].shape[1] != bs or a[4].shape[1] != n_heads:
            nt = self.nt

            def padded(n, dtype):  # [nt, n] rows on 64-byte lines of their own
                return packed_i8.task_scratch(nt, (-(-n // 16) * 16,), dtype)[:, :n]

            ts = packed_i8.task_scratch  # shapes kept (checked above), 64-byte aligned
            a = self._paged = (ts(nt, (bs, d), np.float32, pad=False),
                               ts(nt, (bs + SLACK,), np.float32, pad=False),
                               ts(nt, (width, 2), np.int64, pad=False),
                               ts(nt, (2, n_kv * d), np.float32, pad=False),
                               ts(nt, (n_heads, d), np.int8, pad=False),
                               ts(nt, (n_heads, d), np.int8, pad=False),
                               padded(n_heads, np.float32),
                               padded(n_heads, np.int32),
                               padded(n_heads, np.float32),
                               padded(n_heads, np.float32),
                               padded(n_heads // n_kv, np.float32))
        return a

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, a).nbytes for a in (
            "xa", "xb", "qkv", "attn", "qp", "gu", "act", "hx", "xq", "xd", "xs8", "facc8",
            "facc32", "bar"))) + sum(a.nbytes for a in (self._att or ())) + sum(
                a.nbytes for a in self.dgt) + sum(a.nbytes for a in (self._ggml or ()))

    def exact_buffers(self, quant):
        """The per-task activation buffers argument of the compiled step: int8 mode's
        ``(xq, xd, xs8, facc8)``, exact mode's digits ``(dg, bz, xsc)`` on the VNNI path
        (:mod:`.packed_f32_vnni`), or None (exact mode, float path)."""
        if quant:
            return self.i8
        return self.dgt if packed_i8.use_vnni() else None


class WeightTable:
    """The packed weights of a stack as address tables (views of the arrays, not copies).

    A *linear* of the step (qkv, o, gate_up, down per layer, then the lm_head) is one or more
    *parts*: packed weights whose output rows follow each other (a GGUF file's q|k in one
    format and v in another, as llama.cpp's Q4_K_M writes them; the plan runs them as
    separate linears). Each part is an INT4 weight (:class:`~.packed_i8.PackedInt4I8`,
    kind 0) or ggml group records (:class:`~.ggml_packed.GGMLPacked`, kind = its ggml type
    id), so a linear knows its kind at run time, per part.

    Parameters
    ----------
    linears : list
        Per linear, a packed weight or a list of them (its parts, every part but the last a
        whole number of 8-row groups). The INT4 parts share one scale dtype; all C-contiguous.

    Attributes
    ----------
    wt : int64 [P, 7]
        Per part (columns ``W_*``): address of ``codes`` (uint8 [NG, KB, 128]) or of the
        ggml records (uint8 [NG, KB, RB]); address of ``scale`` ([NG, KB, 8] float32 or
        uint16) or, ggml, RB (record bytes); NG; KB (blocks / records per group); kind;
        first 8-row group of the part in its linear; output rows. With one INT4 part per
        linear, row ``i`` is linear ``i`` and the first 4 columns are those the rows step
        (:mod:`.rows_layers`) reads.
    wl : int64 [4L + 1, 4]
        Per linear (columns ``L_*``): first row of ``wt``, parts, NG of all parts, the
        largest bytes per 8-row group of its parts.
    codes0, scale0 : read-only views of the first INT4 part's arrays (their numba types are
        the types of every view :func:`.decoder_layers._weight` makes), or None when no part
        is INT4 (the step then does not compile the INT4 kernels).
    ggml0 : a view of the first ggml part's records (the type of every records view), or
        None when no part is ggml (the step then does not compile the ggml kernels).
    simple : bool
        Every linear is one INT4 part (what the rows step takes).
    qk_norms : float32 [L, 2, D] read-only, or None
        The ``qk_norms`` parameter: per layer the weights of the RMSNorm of each query head and
        of each key head (Qwen3), applied after the q|k|v linear and before RoPE; None: none.
    codes, scales : lists of the INT4 parts' arrays (inspection; with ``records`` the ggml
        parts' arrays, they keep the memory alive).
    """

    def __init__(self, linears, qk_norms=None):
        if qk_norms is not None and (qk_norms.dtype != np.float32 or qk_norms.ndim != 3
                                     or qk_norms.shape[1] != 2 or qk_norms.flags.writeable
                                     or not qk_norms.flags.c_contiguous):
            raise InvalidArgument(f"qk_norms: expected a read-only C-contiguous float32 "
                                  f"[L, 2, D] array, got {qk_norms.dtype} {qk_norms.shape}")
        self.qk_norms = qk_norms
        lins = [list(p) if isinstance(p, (list, tuple)) else [p] for p in linears]
        parts = [p for lin in lins for p in lin]
        int4 = [p for p in parts if _kind(p) == 0]
        ggml = [p for p in parts if _kind(p) != 0]
        sdt = int4[0].scale.dtype if int4 else np.dtype(np.uint16)
        wt = np.zeros((len(parts), 7), np.int64)
        wl = np.zeros((len(lins), 4), np.int64)
        row = 0
        for li, lin in enumerate(lins):
            g0 = 0
            gb = 0
            for j, p in enumerate(lin):
                kind = _kind(p)
                if kind == 0:
                    c, sc = p.codes, p.scale
                    ng, kb = c.shape[0], c.shape[1]
                    if (c.dtype != np.uint8 or c.shape != (ng, kb, GROUP_BLOCK_BYTES)
                            or sc.dtype != sdt or sc.shape != (ng, kb, GROUP_ROWS)
                            or not c.flags.c_contiguous or not sc.flags.c_contiguous):
                        raise InvalidArgument(f"weight {li} part {j}: not the packed layout "
                                              f"(codes {c.dtype} {c.shape}, scale {sc.dtype} "
                                              f"{sc.shape})")
                    wt[row] = (address(c), address(sc), ng, kb, 0, g0, p.n)
                    gb = max(gb, kb * GROUP_BLOCK_BYTES)
                else:
                    d = p.data
                    if d.dtype != np.uint8 or d.ndim != 3 or not d.flags.c_contiguous:
                        raise InvalidArgument(f"weight {li} part {j}: not ggml group records "
                                              f"({d.dtype} {d.shape})")
                    ng, kb, rb = d.shape
                    wt[row] = (address(d), rb, ng, kb, kind, g0, p.n)
                    gb = max(gb, kb * rb)
                if j + 1 < len(lin) and p.n % GROUP_ROWS:
                    raise InvalidArgument(f"weight {li} part {j}: {p.n} rows, not a whole "
                                          f"number of {GROUP_ROWS}-row groups before the next "
                                          f"part")
                g0 += ng
                row += 1
            wl[li] = (row - len(lin), len(lin), g0, gb)
        self.wt = wt
        self.wl = wl
        self.simple = not ggml and all(len(lin) == 1 for lin in lins)
        self.codes = [p.codes for p in int4]  # the arrays the addresses point into
        self.scales = [p.scale for p in int4]
        self.records = [p.data for p in ggml]
        if int4:
            self.codes0 = _readonly(int4[0].codes)
            self.scale0 = _readonly(int4[0].scale)
        else:  # every linear is ggml: no INT4 kernel compiled (decoder_layers._int4_part)
            self.codes0 = self.scale0 = None
        self.ggml0 = ggml[0].data[:1] if ggml else None


def _kind(p) -> int:
    """0 for an INT4 packed weight, the ggml type id for ggml group records."""
    return int(getattr(p, "kind", 0))


def _readonly(a):
    v = a.view()
    v.flags.writeable = False
    return v
