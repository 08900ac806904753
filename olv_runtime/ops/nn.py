"""Neural-network operators run by numba kernels: MatMul, RMSNormalization (opset 23),
RotaryEmbedding (opset 23) and Attention (opset 23, with past/present KV).

Shapes follow the ONNX operator specs; the kernels are in :mod:`olv_runtime.kernels`.
"""
from __future__ import annotations

import math

import numpy as np

from olv_runtime import kernels
from olv_runtime.errors import ValidationError
from olv_runtime.kernels.norm import _rms_norm_ser
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty
from olv_runtime.state import kv


@register("MatMul", 13)
class MatMul(Op):
    """ONNX MatMul (numpy matmul semantics). float32 2-D weights go through BLAS."""

    def run(self, a, b):
        if a.dtype != b.dtype:
            raise self.fail(f"inputs must have the same element type, got {a.dtype} and {b.dtype}")
        try:
            shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) if a.ndim > 1 and b.ndim > 1 else None
            if shape is not None and a.shape[-1] == b.shape[-2]:
                return (np.matmul(a, b, out=empty(shape + (a.shape[-2], b.shape[-1]), a.dtype)),)
            return (np.matmul(a, b),)
        except ValueError:
            raise self.fail(
                f"shapes {list(a.shape)} and {list(b.shape)} are not compatible for MatMul"
            ) from None


@register("RMSNormalization", 23)
class RMSNormalization(Op):
    """ONNX RMSNormalization-23 over the last axis: ``x / sqrt(mean(x^2) + epsilon) * scale``."""

    attributes = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}

    def last_axis(self, ndim: int) -> bool:
        return ndim > 0 and self.attrs["axis"] % ndim == ndim - 1

    def setup(self, info):
        self.eps = float(np.float32(self.attrs["epsilon"]))
        self.eps32 = np.float32(self.attrs["epsilon"])
        if not (np.isfinite(self.eps32) and self.eps32 >= 0):
            raise ValidationError(
                f"node {self.name!r} (RMSNormalization): epsilon must be finite and >= 0, got "
                f"{self.attrs['epsilon']}"
            )
        if self.attrs["stash_type"] != 1:
            raise ValidationError(
                f"node {self.name!r} (RMSNormalization): only stash_type 1 (FLOAT) is supported, "
                f"got {self.attrs['stash_type']}"
            )

    def run(self, x, scale):
        d = x.shape[-1] if x.ndim else 0
        if (x.dtype == np.float32 and scale.dtype == np.float32 and x.flags.c_contiguous
                and scale.shape == (d,) and self.last_axis(x.ndim) and scale.flags.c_contiguous
                and d and x.size <= 8 * d):
            # decode-sized fast path: shapes checked here, serial kernel called directly
            out = empty(x.shape, np.float32)
            _rms_norm_ser(x.reshape(-1, d), scale, self.eps32, out.reshape(-1, d))
            return (out,)
        axis = self.attrs["axis"] % x.ndim if x.ndim else 0
        if axis != x.ndim - 1:
            raise self.fail(f"only normalisation over the last axis is supported, got axis {axis}")
        if x.dtype != np.float32 or scale.dtype != np.float32:
            raise self.fail(f"expected float32 input and scale, got {x.dtype} and {scale.dtype}")
        d = x.shape[-1]
        if scale.shape != (d,):
            raise self.fail(f"scale must have shape [{d}], got {list(scale.shape)}")
        x2 = np.ascontiguousarray(x).reshape(-1, d)
        out = empty(x.shape, np.float32)
        kernels.rms_norm(x2, scale, self.eps, out=out.reshape(-1, d))
        return (out,)


def _cos_sin(op: Op, cos_cache, sin_cache, position_ids, b: int, s: int, half: int):
    if position_ids is not None:
        if position_ids.shape != (b, s):
            raise op.fail(f"position_ids must have shape [{b}, {s}], got {list(position_ids.shape)}")
        n = cos_cache.shape[0]
        if position_ids.size and (position_ids.min() < 0 or position_ids.max() >= n):
            raise op.fail(
                f"position_ids must lie in [0, {n - 1}] (cos_cache rows), got "
                f"[{position_ids.min()}, {position_ids.max()}]"
            )
        cos = np.ascontiguousarray(cos_cache[position_ids])
        sin = np.ascontiguousarray(sin_cache[position_ids])
    else:
        cos, sin = cos_cache, sin_cache
    if cos.shape != (b, s, half) or sin.shape != (b, s, half):
        raise op.fail(
            f"cos/sin caches must give shape [{b}, {s}, {half}], got {list(cos.shape)} and "
            f"{list(sin.shape)}"
        )
    return np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)


@register("RotaryEmbedding", 23)
class RotaryEmbedding(Op):
    """ONNX RotaryEmbedding-23 for 3-D ``[B, S, H*D]`` (with ``num_heads``) or 4-D ``[B, H, S, D]``."""

    attributes = {"interleaved": 0, "num_heads": 0, "rotary_embedding_dim": 0}

    def run(self, x, cos_cache, sin_cache, position_ids=None):
        if x.dtype != np.float32:
            raise self.fail(f"expected float32 input, got {x.dtype}")
        if x.ndim == 3:
            nh = self.attrs["num_heads"]
            if nh <= 0 or x.shape[2] % nh:
                raise self.fail(
                    f"3-D input needs num_heads dividing the hidden size {x.shape[2]}, got {nh}"
                )
            b, s = x.shape[:2]
            x4 = np.ascontiguousarray(x).reshape(b, s, nh, x.shape[2] // nh)
            back = None
        elif x.ndim == 4:
            b, nh, s, _ = x.shape
            x4 = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
            back = (0, 2, 1, 3)
        else:
            raise self.fail(f"input must be 3-D or 4-D, got rank {x.ndim}")
        d = x4.shape[3]
        r = self.attrs["rotary_embedding_dim"] or d
        if r > d or r % 2:
            raise self.fail(f"rotary_embedding_dim {r} must be even and <= head size {d}")
        cos, sin = _cos_sin(self, cos_cache, sin_cache, position_ids, b, s, r // 2)
        out = kernels.rotary_embedding(x4, cos, sin, bool(self.attrs["interleaved"]), r,
                                       out=empty(x4.shape, np.float32))
        if back is not None:
            return (np.ascontiguousarray(out.transpose(back)),)
        return (out.reshape(x.shape),)


@register("Attention", 23)
class Attention(Op):
    """ONNX Attention-23: GQA, optional past/present KV, causal mask aligned to the past.

    Supported: 3-D inputs (``q_num_heads``/``kv_num_heads``) or 4-D; ``is_causal``; ``scale``;
    ``past_key``/``past_value`` with ``present_key``/``present_value`` outputs. Not supported
    (rejected when the session is created or at the first run): ``attn_mask``, ``softcap``,
    ``qk_matmul_output_mode`` != 0 with a 4th output, ``softmax_precision`` other than FLOAT.
    """

    attributes = {
        "is_causal": 0, "kv_num_heads": 0, "q_num_heads": 0, "qk_matmul_output_mode": 0,
        "scale": None, "softcap": 0.0, "softmax_precision": 1,
    }

    def setup(self, info):
        node = self.node
        if len(node.input) > 3 and node.input[3]:
            raise ValidationError(f"node {self.name!r} (Attention): attn_mask is not supported")
        if len(node.input) > 6 and node.input[6]:
            raise ValidationError(
                f"node {self.name!r} (Attention): nonpad_kv_seqlen is not supported"
            )
        if self.attrs["softcap"]:
            raise ValidationError(f"node {self.name!r} (Attention): softcap is not supported")
        if len(node.output) > 3 and node.output[3]:
            raise ValidationError(
                f"node {self.name!r} (Attention): the qk_matmul_output output is not supported"
            )
        if self.attrs["softmax_precision"] not in (0, 1):
            raise ValidationError(
                f"node {self.name!r} (Attention): softmax_precision must be FLOAT"
            )
        has_past = len(node.input) > 4 and bool(node.input[4])
        if has_past != (len(node.input) > 5 and bool(node.input[5])):
            raise ValidationError(
                f"node {self.name!r} (Attention): past_key and past_value must be given together"
            )
        self.has_past = has_past
        opts = getattr(info, "options", None)
        self.kv_opts = {
            "initial_capacity": getattr(opts, "kv_initial_capacity", 256),
            "growth": getattr(opts, "kv_growth", 2.0),
            "counters": getattr(info, "counters", None),
        }

    def run(self, q, k, v, attn_mask=None, past_key=None, past_value=None):
        for nm, arr in (("Q", q), ("K", k), ("V", v)):
            if arr.dtype != np.float32:
                raise self.fail(f"{nm} must be float32, got {arr.dtype}")
        if q.ndim == 3:
            h, kvh = self.attrs["q_num_heads"], self.attrs["kv_num_heads"]
            if h <= 0 or kvh <= 0:
                raise self.fail("3-D inputs need q_num_heads and kv_num_heads")
            b, s, hd = q.shape
            if hd % h:
                raise self.fail(f"Q hidden size {hd} not divisible by q_num_heads {h}")
            d = hd // h
            if k.shape != (b, k.shape[1], kvh * d) or v.shape[:2] != k.shape[:2]:
                raise self.fail(
                    f"K/V must be [{b}, kv_sequence, {kvh * d}], got {list(k.shape)} and "
                    f"{list(v.shape)}"
                )
            dv = v.shape[2] // kvh
            q4 = np.ascontiguousarray(q).reshape(b, s, h, d)
            k_new = np.ascontiguousarray(k).reshape(b, k.shape[1], kvh, d)
            v_new = np.ascontiguousarray(v).reshape(b, v.shape[1], kvh, dv)
            three_d = True
        elif q.ndim == 4:
            b, h, s, d = q.shape
            kvh = k.shape[1]
            dv = v.shape[3]
            q4 = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
            k_new = np.ascontiguousarray(k.transpose(0, 2, 1, 3))
            v_new = np.ascontiguousarray(v.transpose(0, 2, 1, 3))
            three_d = False
        else:
            raise self.fail(f"Q must be 3-D or 4-D, got rank {q.ndim}")
        if dv != d:
            raise self.fail(f"value head size {dv} differs from query head size {d}")
        if h % kvh:
            raise self.fail(f"q_num_heads {h} is not a multiple of kv_num_heads {kvh}")
        s_kv = k_new.shape[1]
        if self.has_past:
            if past_key.shape[:2] != (b, kvh) or past_key.shape[3] != d:
                raise self.fail(
                    f"past_key must be [{b}, {kvh}, past, {d}], got {list(past_key.shape)}"
                )
            if past_value.shape != past_key.shape:
                raise self.fail(
                    f"past_value shape {list(past_value.shape)} differs from past_key "
                    f"{list(past_key.shape)}"
                )
            past_len = past_key.shape[2]
        else:
            past_len = 0
        if not self.has_past:
            past_key = past_value = np.empty((b, kvh, 0, d), np.float32)
        # In-place append into capacity buffers when the past is an exclusive prefix view
        # (olv_runtime.state.kv); otherwise a new buffer and one prefix copy.
        present_k, buf_k = kv.append(past_key, k_new.reshape(b, s_kv, kvh * d), **self.kv_opts)
        present_v, buf_v = kv.append(past_value, v_new.reshape(b, s_kv, kvh * d), **self.kv_opts)
        scale = self.attrs["scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        causal = bool(self.attrs["is_causal"])
        # The causal frontier is aligned to the end of the past (ONNX Attention with cache).
        out = kernels.attention(q4, buf_k, buf_v, past_len, float(np.float32(scale)), causal,
                                out=empty(q4.shape, np.float32))
        if three_d:
            y = out.reshape(b, s, h * d)
        else:
            y = np.ascontiguousarray(out.transpose(0, 2, 1, 3))
        return (y, present_k, present_v)
