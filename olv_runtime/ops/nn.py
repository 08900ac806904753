"""Neural-network operators run by numba kernels: MatMul, RMSNormalization (opset 23),
RotaryEmbedding (opset 23) and Attention (opset 23, with past/present KV).

Shapes follow the ONNX operator specs; the kernels are in :mod:`olv_runtime.kernels`.
"""
from __future__ import annotations

import math

import numpy as np

from olv_runtime import kernels
from olv_runtime.errors import ValidationError
from olv_runtime.kernels.activations import erf
from olv_runtime.kernels.norm import _rms_norm_ser
from olv_runtime.kv import contiguous as kv
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty


@register("MatMul", 1)
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

    @staticmethod
    def _last_axis_f32(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
        """RMS norm of float32 ``x`` over its last axis with a float32 ``scale[D]``."""
        d = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, d)
        out = empty(x.shape, np.float32)
        if x2.shape[0] <= 8:
            _rms_norm_ser(x2, np.ascontiguousarray(scale, np.float32), np.float32(eps),
                          out.reshape(-1, d))
        else:
            kernels.rms_norm(x2, np.ascontiguousarray(scale, np.float32), eps,
                             out=out.reshape(-1, d))
        return out

    def run(self, x, scale):
        d = x.shape[-1] if x.ndim else 0
        if (x.dtype == np.float32 and scale.dtype == np.float32 and x.flags.c_contiguous
                and scale.shape == (d,) and self.last_axis(x.ndim) and scale.flags.c_contiguous
                and d and x.size <= 8 * d):
            # decode-sized fast path: shapes checked here, serial kernel called directly
            out = empty(x.shape, np.float32)
            _rms_norm_ser(x.reshape(-1, d), scale, self.eps32, out.reshape(-1, d))
            return (out,)
        axis = self.attrs["axis"]
        if not -x.ndim <= axis < max(x.ndim, 1):
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        axis %= max(x.ndim, 1)
        if x.dtype.kind != "f" or scale.dtype != x.dtype:
            raise self.fail(f"expected floating-point input and scale of one type, got {x.dtype} "
                            f"and {scale.dtype}")
        if axis != x.ndim - 1 or x.dtype != np.float32 or scale.shape != (x.shape[-1],):
            return (_normalize(self, x, scale, None, axis, self.eps, rms=True),)
        d = x.shape[-1]
        x2 = np.ascontiguousarray(x).reshape(-1, d)
        out = empty(x.shape, np.float32)
        kernels.rms_norm(x2, scale, self.eps, out=out.reshape(-1, d))
        return (out,)


def _normalize(op: Op, x, scale, bias, axis: int, eps: float, rms: bool, stats: bool = False):
    """RMS / layer normalisation over axes ``axis..rank-1`` in float32 (float64 inputs in
    float64); ``scale`` and ``bias`` broadcast to the normalised dims (ONNX rules)."""
    norm_shape = x.shape[axis:]
    for nm, p in (("scale", scale), ("bias", bias)):
        if p is None:
            continue
        try:
            np.broadcast_shapes(p.shape, x.shape)
        except ValueError:
            raise op.fail(f"{nm} shape {list(p.shape)} does not broadcast to the normalised "
                          f"shape {list(norm_shape)}") from None
        if p.ndim > len(norm_shape):
            raise op.fail(f"{nm} has rank {p.ndim}, more than the {len(norm_shape)} normalised "
                          "dims")
    ct = np.float64 if x.dtype == np.float64 else np.float32
    xf = x.astype(ct, copy=False)
    axes = tuple(range(axis, x.ndim))
    if rms:
        mean = None
        var = np.mean(xf * xf, axis=axes, keepdims=True)
        inv = (1.0 / np.sqrt(var + ct(eps))).astype(ct)
        y = xf * inv
    else:
        mean = np.mean(xf, axis=axes, keepdims=True)
        c = xf - mean
        var = np.mean(c * c, axis=axes, keepdims=True)
        inv = (1.0 / np.sqrt(var + ct(eps))).astype(ct)
        y = c * inv
    y = y * scale.astype(ct, copy=False)
    if bias is not None:
        y = y + bias.astype(ct, copy=False)
    y = y.astype(x.dtype, copy=False)
    if stats:
        return y, mean, inv
    return y


@register("LayerNormalization", 17)
class LayerNormalization(Op):
    """ONNX LayerNormalization-17 over axes ``axis..rank-1``: ``(x - mean) / sqrt(var + eps) *
    scale + bias``; float16 inputs are computed in float32. Optional outputs ``Mean`` and
    ``InvStdDev`` (float32, reduced axes kept as 1)."""

    attributes = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}

    def setup(self, info):
        if self.attrs["stash_type"] != 1:
            raise ValidationError(
                f"node {self.name!r} (LayerNormalization): only stash_type 1 (FLOAT) is "
                f"supported, got {self.attrs['stash_type']}"
            )

    def run(self, x, scale, bias=None):
        axis = self.attrs["axis"]
        if not -x.ndim <= axis < max(x.ndim, 1):
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        axis %= max(x.ndim, 1)
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        y, mean, inv = _normalize(self, x, scale, bias, axis, self.attrs["epsilon"], rms=False,
                                  stats=True)
        return (y, mean.astype(np.float32), inv.astype(np.float32))


@register("Gelu", 20)
class Gelu(Op):
    """ONNX Gelu-20: ``approximate="none"`` ``0.5 x (1 + erf(x / sqrt 2))`` or ``"tanh"``
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; float16 computed in float32."""

    attributes = {"approximate": "none"}

    def setup(self, info):
        if self.attrs["approximate"] not in ("none", "tanh"):
            raise ValidationError(
                f"node {self.name!r} (Gelu): approximate must be 'none' or 'tanh', got "
                f"{self.attrs['approximate']!r}"
            )

    def run(self, x):
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        return (gelu(x, self.attrs["approximate"]),)


def gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """GELU of a float array (ONNX Gelu-20 / com.microsoft Gelu), result in ``x``'s dtype."""
    ct = np.float64 if x.dtype == np.float64 else np.float32
    xf = x.astype(ct, copy=False)
    if approximate == "tanh":
        inner = ct(math.sqrt(2.0 / math.pi)) * (xf + ct(0.044715) * xf * xf * xf)
        y = ct(0.5) * xf * (ct(1) + np.tanh(inner))
    else:
        y = ct(0.5) * xf * (ct(1) + erf(xf * ct(1.0 / math.sqrt(2.0))))
    return y.astype(x.dtype, copy=False)


@register("Gemm", 7)
class Gemm(Op):
    """ONNX Gemm-7..13: ``alpha * A' @ B' + beta * C`` (A', B' optionally transposed, C
    unidirectionally broadcast). float32 uses BLAS through numpy."""

    attributes = {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}

    def run(self, a, b, c=None):
        if a.ndim != 2 or b.ndim != 2:
            raise self.fail(f"A and B must be 2-D, got shapes {list(a.shape)} and {list(b.shape)}")
        if a.dtype != b.dtype or (c is not None and c.dtype != a.dtype):
            raise self.fail("A, B and C must have one element type")
        at = a.T if self.attrs["transA"] else a
        bt = b.T if self.attrs["transB"] else b
        if at.shape[1] != bt.shape[0]:
            raise self.fail(f"A' {list(at.shape)} and B' {list(bt.shape)} do not multiply")
        y = at @ bt
        alpha, beta = self.attrs["alpha"], self.attrs["beta"]
        if alpha != 1.0:
            y = y * a.dtype.type(alpha)
        if c is not None:
            try:
                np.broadcast_shapes(c.shape, y.shape)
            except ValueError:
                raise self.fail(f"C shape {list(c.shape)} does not broadcast to "
                                f"{list(y.shape)}") from None
            y = y + (c * a.dtype.type(beta) if beta != 1.0 else c)
        return (np.asarray(y, a.dtype),)


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


_SOFTMAX_PRECISIONS = {1: "FLOAT", 10: "FLOAT16", 11: "DOUBLE", 16: "BFLOAT16"}


class Attention(Op):
    """ONNX Attention-23/24/25: GQA, optional past/present KV, causal mask aligned to the past.

    Every input form of the spec runs: 3-D inputs (``q_num_heads``/``kv_num_heads``) or 4-D;
    ``is_causal``; ``scale``; ``softcap``; ``attn_mask`` (bool: True attends; float: added to
    the scores; broadcast to ``[B, H, S, T]``, padded with masked columns when shorter than the
    total key length); ``past_key``/``past_value`` with ``present_key``/``present_value``;
    ``nonpad_kv_seqlen`` (opset 24: keys at or after ``nonpad_kv_seqlen[b]`` are masked, the
    causal frontier is ``nonpad_kv_seqlen[b] - S``); ``left_window_size``/``right_window_size``
    (opset 25 sliding window); the ``qk_matmul_output`` output (modes 0-3, as the onnx
    reference); a value head size different from the query's; float16 inputs.

    float32 inputs without mask, softcap, window, nonpad lengths or qk output, with equal query
    and value head sizes, run the numba kernel (:func:`olv_runtime.kernels.attention`) when the
    query and new key lengths are equal or the attention is not causal. Every other form is
    computed in numpy in float32 (float64 when ``softmax_precision`` is DOUBLE), float16 inputs
    converted to float32 and the outputs rounded back to float16 (the spec computes in the input
    type; float32 is at least as accurate). A row with every key masked gives 0 (onnx
    reference). Source: https://onnx.ai/onnx/operators/onnx__Attention.html.
    """

    attributes = {
        "is_causal": 0, "kv_num_heads": 0, "q_num_heads": 0, "qk_matmul_output_mode": 0,
        "scale": None, "softcap": 0.0, "softmax_precision": 1,
    }

    def setup(self, info):
        node = self.node
        if self.attrs["softmax_precision"] not in _SOFTMAX_PRECISIONS:
            raise ValidationError(
                f"node {self.name!r} (Attention): softmax_precision must be one of "
                f"{sorted(_SOFTMAX_PRECISIONS)} (FLOAT, FLOAT16, DOUBLE, BFLOAT16), got "
                f"{self.attrs['softmax_precision']}"
            )
        if self.attrs["qk_matmul_output_mode"] not in (0, 1, 2, 3):
            raise ValidationError(
                f"node {self.name!r} (Attention): qk_matmul_output_mode must be 0-3, got "
                f"{self.attrs['qk_matmul_output_mode']}"
            )
        self.left = int(self.attrs.get("left_window_size", -1))
        self.right = int(self.attrs.get("right_window_size", -1))
        if self.left < -1 or self.right < -1:
            raise ValidationError(
                f"node {self.name!r} (Attention): left/right_window_size must be -1 or >= 0, got "
                f"{self.left} and {self.right}"
            )
        has_past = len(node.input) > 4 and bool(node.input[4])
        if has_past != (len(node.input) > 5 and bool(node.input[5])):
            raise ValidationError(
                f"node {self.name!r} (Attention): past_key and past_value must be given together"
            )
        self.has_past = has_past
        self.has_mask = len(node.input) > 3 and bool(node.input[3])
        self.has_nonpad = len(node.input) > 6 and bool(node.input[6])
        if self.has_nonpad and has_past:
            raise ValidationError(
                f"node {self.name!r} (Attention): nonpad_kv_seqlen cannot be combined with "
                "past_key/past_value"
            )
        self.want_qk = len(node.output) > 3 and bool(node.output[3])
        self.simple = not (self.has_mask or self.has_nonpad or self.want_qk
                           or self.attrs["softcap"] or self.left >= 0 or self.right >= 0)
        opts = getattr(info, "options", None)
        self.kv_opts = {
            "initial_capacity": getattr(opts, "kv_initial_capacity", 256),
            "growth": getattr(opts, "kv_growth", 2.0),
            "counters": getattr(info, "counters", None),
        }

    def run(self, q, k, v, attn_mask=None, past_key=None, past_value=None,
            nonpad_kv_seqlen=None):
        for nm, arr in (("Q", q), ("K", k), ("V", v)):
            if arr.dtype not in (np.float32, np.float16):
                raise self.fail(f"{nm} must be float32 or float16, got {arr.dtype}")
        if not q.dtype == k.dtype == v.dtype:
            raise self.fail(f"Q, K and V must have one element type, got {q.dtype}, {k.dtype}, "
                            f"{v.dtype}")
        if q.ndim == 3:
            h, kvh = self.attrs["q_num_heads"], self.attrs["kv_num_heads"]
            if h <= 0 or kvh <= 0:
                raise self.fail("3-D inputs need q_num_heads and kv_num_heads")
            if k.ndim != 3 or v.ndim != 3:
                raise self.fail(f"K and V must be 3-D like Q, got ranks {k.ndim} and {v.ndim}")
            b, s, hd = q.shape
            if hd % h or k.shape[2] % kvh or v.shape[2] % kvh:
                raise self.fail(
                    f"hidden sizes Q {hd}, K {k.shape[2]}, V {v.shape[2]} must divide by "
                    f"q_num_heads {h} / kv_num_heads {kvh}"
                )
            d = hd // h
            if k.shape[0] != b or k.shape[2] != kvh * d or v.shape[:2] != k.shape[:2]:
                raise self.fail(
                    f"K/V must be [{b}, kv_sequence, {kvh * d}] / [{b}, kv_sequence, "
                    f"{kvh} * v_head], got {list(k.shape)} and {list(v.shape)}"
                )
            dv = v.shape[2] // kvh
            q4 = np.ascontiguousarray(q).reshape(b, s, h, d)
            k_new = np.ascontiguousarray(k).reshape(b, k.shape[1], kvh, d)
            v_new = np.ascontiguousarray(v).reshape(b, v.shape[1], kvh, dv)
            three_d = True
        elif q.ndim == 4:
            if k.ndim != 4 or v.ndim != 4:
                raise self.fail(f"K and V must be 4-D like Q, got ranks {k.ndim} and {v.ndim}")
            b, h, s, d = q.shape
            kvh = k.shape[1]
            dv = v.shape[3]
            if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
                raise self.fail(
                    f"K must be [{b}, kv_heads, kv_sequence, {d}] and V [{b}, kv_heads, "
                    f"kv_sequence, v_head], got {list(k.shape)} and {list(v.shape)}"
                )
            q4 = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
            k_new = np.ascontiguousarray(k.transpose(0, 2, 1, 3))
            v_new = np.ascontiguousarray(v.transpose(0, 2, 1, 3))
            three_d = False
        else:
            raise self.fail(f"Q must be 3-D or 4-D, got rank {q.ndim}")
        if kvh <= 0 or h % kvh:
            raise self.fail(f"q_num_heads {h} is not a multiple of kv_num_heads {kvh}")
        s_kv = k_new.shape[1]
        if self.has_past:
            if (past_key.ndim != 4 or past_key.shape[:2] != (b, kvh) or past_key.shape[3] != d
                    or past_value.ndim != 4 or past_value.shape[:3] != past_key.shape[:3]
                    or past_value.shape[3] != dv):
                raise self.fail(
                    f"past_key must be [{b}, {kvh}, past, {d}] and past_value [{b}, {kvh}, past, "
                    f"{dv}], got {list(past_key.shape)} and {list(past_value.shape)}"
                )
            if past_key.dtype != q.dtype or past_value.dtype != q.dtype:
                raise self.fail(f"past_key/past_value must be {q.dtype}, got {past_key.dtype} "
                                f"and {past_value.dtype}")
            past_len = past_key.shape[2]
        else:
            past_len = 0
        scale = self.attrs["scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        causal = bool(self.attrs["is_causal"])
        if (self.simple and q.dtype == np.float32 and dv == d and (s_kv == s or not causal)
                and past_len + s_kv >= s):
            if not self.has_past:
                past_key = past_value = np.empty((b, kvh, 0, d), np.float32)
            # In-place append into capacity buffers when the past is an exclusive prefix view
            # (olv_runtime.kv.contiguous); otherwise a new buffer and one prefix copy.
            present_k, buf_k = kv.append(past_key, k_new.reshape(b, s_kv, kvh * d), **self.kv_opts)
            present_v, buf_v = kv.append(past_value, v_new.reshape(b, s_kv, kvh * d),
                                         **self.kv_opts)
            # The kernel attends keys [0, past + S) with the causal frontier past + i: with
            # kv_sequence != S (non-causal only) it gets the key count less S as "past".
            kpast = past_len + s_kv - s
            out = kernels.attention(q4, buf_k, buf_v, kpast, float(np.float32(scale)), causal,
                                    out=empty(q4.shape, np.float32))
            if three_d:
                y = out.reshape(b, s, h * d)
            else:
                y = np.ascontiguousarray(out.transpose(0, 2, 1, 3))
            return (y, present_k, present_v)
        return self._general(q, q4, k_new, v_new, attn_mask, past_key, past_value,
                             nonpad_kv_seqlen, b, s, h, kvh, d, dv, s_kv, past_len,
                             float(scale), causal, three_d)

    def _general(self, q, q4, k_new, v_new, attn_mask, past_key, past_value, nonpad, b, s, h,
                 kvh, d, dv, s_kv, past_len, scale, causal, three_d):
        """Every attribute and input of the spec, in numpy (see the class docstring)."""
        io = q.dtype
        ct = np.float64 if self.attrs["softmax_precision"] == 11 else np.float32
        qh = q4.transpose(0, 2, 1, 3).astype(ct)                     # [B, H, S, D]
        kh = k_new.transpose(0, 2, 1, 3)                             # [B, KVH, s_kv, D]
        vh = v_new.transpose(0, 2, 1, 3)
        if self.has_past:
            present_k = np.concatenate([past_key, kh.astype(io)], axis=2)
            present_v = np.concatenate([past_value, vh.astype(io)], axis=2)
        else:
            present_k = np.ascontiguousarray(kh, io)
            present_v = np.ascontiguousarray(vh, io)
        t = present_k.shape[2]
        rep = h // kvh
        kf = np.repeat(present_k.astype(ct), rep, axis=1)            # [B, H, T, D]
        vf = np.repeat(present_v.astype(ct), rep, axis=1)
        scores = np.matmul(qh, kf.transpose(0, 1, 3, 2)) * ct(scale)  # [B, H, S, T]
        cap = float(self.attrs["softcap"])
        if cap > 0:
            scores = ct(cap) * np.tanh(scores / ct(cap))
        bias = np.zeros((1, 1, s, t), ct)
        if attn_mask is not None:
            m = attn_mask
            if m.ndim < 1 or m.ndim > 4:
                raise self.fail(f"attn_mask must have rank 1-4, got shape {list(m.shape)}")
            if m.shape[-1] > t or (m.ndim > 1 and m.shape[-2] not in (1, s)):
                raise self.fail(
                    f"attn_mask must broadcast to [{b}, {h}, {s}, {t}] (last dim <= {t}), got "
                    f"{list(m.shape)}"
                )
            if m.dtype == np.bool_:
                mb = np.where(m, ct(0), ct(-np.inf))
            elif m.dtype.kind == "f":
                mb = m.astype(ct)
            else:
                raise self.fail(f"attn_mask must be bool or floating point, got {m.dtype}")
            if mb.shape[-1] < t:
                pad = [(0, 0)] * (mb.ndim - 1) + [(0, t - mb.shape[-1])]
                mb = np.pad(mb, pad, constant_values=-np.inf)
            try:
                bias = bias + mb.reshape((1,) * (4 - mb.ndim) + mb.shape)
            except ValueError:
                raise self.fail(f"attn_mask shape {list(m.shape)} does not broadcast to "
                                f"[{b}, {h}, {s}, {t}]") from None
        if nonpad is not None:
            if nonpad.shape != (b,) or nonpad.dtype.kind not in "iu":
                raise self.fail(f"nonpad_kv_seqlen must be int [{b}], got {nonpad.dtype}"
                                f"{list(nonpad.shape)}")
            if nonpad.size and (nonpad.min() < 0 or nonpad.max() > t):
                raise self.fail(f"nonpad_kv_seqlen must lie in [0, {t}], got {nonpad.tolist()}")
            offset = (nonpad.astype(np.int64) - s).reshape(b, 1, 1, 1)
        else:
            offset = np.full((1, 1, 1, 1), past_len, np.int64)
        i_idx = np.arange(s).reshape(1, 1, s, 1)
        j_idx = np.arange(t).reshape(1, 1, 1, t)
        if causal:
            bias = bias + np.where(j_idx <= i_idx + offset, ct(0), ct(-np.inf))
        if self.left >= 0 or self.right >= 0:
            diff = (i_idx + offset) - j_idx
            allowed = np.ones(diff.shape, bool)
            if self.left >= 0:
                allowed &= diff <= self.left
            if self.right >= 0:
                allowed &= -diff <= self.right
            bias = bias + np.where(allowed, ct(0), ct(-np.inf))
        if nonpad is not None:
            bias = bias + np.where(j_idx < nonpad.reshape(b, 1, 1, 1), ct(0), ct(-np.inf))
        with np.errstate(invalid="ignore", over="ignore"):
            biased = scores + bias
            masked_row = np.isneginf(np.max(bias, axis=-1, keepdims=True))
            mx = np.max(biased, axis=-1, keepdims=True)
            mx = np.where(np.isfinite(mx), mx, ct(0))
            e = np.exp(biased - mx)
            den = np.sum(e, axis=-1, keepdims=True)
            p = e / np.where(den == 0, ct(1), den)
        p = np.where(masked_row, ct(0), p)
        y = np.matmul(p, vf)                                         # [B, H, S, Dv]
        if three_d:
            y = y.transpose(0, 2, 1, 3).reshape(b, s, h * dv)
        outs = [np.ascontiguousarray(y, io), present_k, present_v]
        if self.want_qk:
            mode = self.attrs["qk_matmul_output_mode"]
            qk = {0: scores, 1: scores, 2: np.broadcast_to(biased, np.broadcast_shapes(
                biased.shape, (b, h, s, t))), 3: p}[mode]
            outs.append(np.ascontiguousarray(np.broadcast_to(qk, (b, h, s, t)), io))
        return tuple(outs)


@register("Attention", 23, 24)
class Attention23(Attention):
    """ONNX Attention-23 and -24 (``nonpad_kv_seqlen`` input from 24)."""


@register("Attention", 25)
class Attention25(Attention):
    """ONNX Attention-25: Attention-24 plus ``left_window_size``/``right_window_size``."""

    attributes = dict(Attention.attributes, left_window_size=-1, right_window_size=-1)
