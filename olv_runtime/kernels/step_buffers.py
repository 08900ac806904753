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

__all__ = ["StepWeights", "StepDims", "RunState", "AttState", "KVContig", "KVPaged",
           "StackWorkspace", "WeightTable"]

GROUP_ROWS = packed_i8.GROUP_ROWS
GROUP_BLOCK_BYTES = packed_i8.GROUP_BLOCK_BYTES

StepWeights = namedtuple("StepWeights", [
    "wt",        # int64 [4L + 1, 4]: per packed weight (qkv, o, gate_up, down per layer, then
                 # the lm_head) address of codes, address of scale, NG, KB (WeightTable.wt)
    "codes0",    # uint8 [NG, KB, 128] read-only: the type of every codes view (_weight)
    "scale0",    # float32 or uint16 [NG, KB, 8] read-only: the type of every scale view
    "biases",    # float32 [L, N_qkv]: q/k/v bias (zeros where a layer has none)
    "has_bias",  # bool [L]
    "norms",     # float32 [2L + 1, E]: input and post-attention norm weights per layer, final
    "eps",       # float32: RMSNorm epsilon
])

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
        self.facc8 = np.zeros((nt, 1, GROUP_ROWS), np.float32)
        self.facc32 = np.zeros((nt, packed_f32.ROWS_MAX * GROUP_ROWS), np.float32)
        # exact mode on the VNNI path: per-task activation digits (packed_f32_vnni)
        self.dgt = tuple(a.reshape((nt, 1) + a.shape[1:]) for a in
                         packed_f32_vnni.digit_buffers(nt, kb if packed_i8.HOST_VNNI else 0))
        self.bar = np.zeros(barrier_slots(nt), np.int64)
        self.vocab = vocab
        self.i8 = (self.xq, self.xd, self.xs8, self.facc8)  # int8 mode's per-task buffers
        self._att = None
        self._q3 = None

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
            a = self._att = (np.zeros((nt, n_heads), np.float32),
                             np.zeros((nt, n_heads), np.float32),
                             np.zeros((nt, n_heads, d), np.float32),
                             np.zeros((nt, 1, n_heads * d), np.float32),
                             np.zeros((nt, g, width + SLACK), np.float32),
                             np.zeros((nt, g, width + SLACK), np.float32),
                             np.zeros((nt, g), np.float32))
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

            def padded(n, dtype):  # [nt, n] rows 64-byte aligned apart
                w = -(-n // 16) * 16
                return np.zeros((nt, w), dtype)[:, :n]

            a = self._paged = (np.zeros((nt, bs, d), np.float32),
                               np.zeros((nt, bs + SLACK), np.float32),
                               np.zeros((nt, width, 2), np.int64),
                               np.zeros((nt, 2, n_kv * d), np.float32),
                               np.zeros((nt, n_heads, d), np.int8),
                               np.zeros((nt, n_heads, d), np.int8),
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
                a.nbytes for a in self.dgt)

    def exact_buffers(self, quant):
        """The per-task activation buffers argument of the compiled step: int8 mode's
        ``(xq, xd, xs8, facc8)``, exact mode's digits ``(dg, bz, xsc)`` on the VNNI path
        (:mod:`.packed_f32_vnni`), or None (exact mode, float path)."""
        if quant:
            return self.i8
        return self.dgt if packed_i8.use_vnni() else None


class WeightTable:
    """The packed weights of a stack as an address table (views of the arrays, not copies).

    Parameters
    ----------
    packed : list of :class:`~.packed_i8.PackedInt4I8`
        4 per layer (qkv, o, gate_up, down), then the lm_head; one scale dtype, C-contiguous.

    Attributes
    ----------
    wt : int64 [W, 4]
        Per weight: address of ``codes`` (uint8 [NG, KB, 128]), address of ``scale``
        ([NG, KB, 8] float32 or uint16), NG, KB.
    codes0, scale0 : read-only views of the first weight's arrays (their numba types are the
        types of every view :func:`.decoder_layers._weight` makes).
    codes, scales : lists of the arrays themselves (inspection; they keep the memory alive).
    """

    def __init__(self, packed):
        wt = np.zeros((len(packed), 4), np.int64)
        sdt = packed[0].scale.dtype
        for i, p in enumerate(packed):
            c, sc = p.codes, p.scale
            ng, kb = c.shape[0], c.shape[1]
            if (c.dtype != np.uint8 or c.shape != (ng, kb, GROUP_BLOCK_BYTES) or sc.dtype != sdt
                    or sc.shape != (ng, kb, GROUP_ROWS) or not c.flags.c_contiguous
                    or not sc.flags.c_contiguous):
                raise InvalidArgument(f"weight {i}: not the packed layout (codes {c.dtype} "
                                 f"{c.shape}, scale {sc.dtype} {sc.shape})")
            wt[i] = (address(c), address(sc), ng, kb)
        self.wt = wt
        self.codes = [p.codes for p in packed]  # the arrays the addresses point into
        self.scales = [p.scale for p in packed]
        self.codes0 = _readonly(packed[0].codes)
        self.scale0 = _readonly(packed[0].scale)


def _readonly(a):
    v = a.view()
    v.flags.writeable = False
    return v
