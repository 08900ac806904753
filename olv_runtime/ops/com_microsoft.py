"""Operators of the ``com.microsoft`` domain that onnxruntime-genai and onnxruntime's quantizers
write (version 1; semantics from onnxruntime's docs/ContribOperators.md):

* ``MatMulNBits`` — ``Y = A @ dequant(B).T (+ bias)`` with 4- or 8-bit blocked weights. The
  weight is recognised at session creation as an affine value (:mod:`olv_runtime.structs.recognize`,
  zero-copy) and the session fuses the node into a linear step on the packed INT4 kernels (zero
  points supported). ``accuracy_level`` (0-4) is read and recorded: olv computes with float32
  activations unless ``SessionOptions(quantize_activations=True)``, which is what accuracy level 4
  permits (int8 activations); lower levels forbid int8 activations, and olv never quantizes them
  by default, so every level is honoured in the default mode. 8-bit weights are decoded once at
  the first run (``bytes_dequantized``) and multiplied in float32. ``g_idx`` is rejected.
* ``GatherBlockQuantized`` — embedding lookup in a blocked 4-bit table (rows decoded on demand).
* ``GroupQueryAttention`` — GQA with ``past_key``/``past_value`` ``[B, KVH, P, D]``,
  ``seqlens_k`` (total length - 1 per row), ``total_sequence_length``, packed or separate Q/K/V,
  rotary (``do_rotary``, ``cos_cache``/``sin_cache`` ``[max_pos, rot/2]``, interleaved or not),
  ``softcap``, ``local_window_size``. Rows whose lengths differ from ``past + S`` (padded
  batches) are rejected with an InvalidArgument naming the lengths.
* ``SimplifiedLayerNormalization`` (RMS norm) and ``SkipSimplifiedLayerNormalization`` (RMS norm
  of ``input + skip (+ bias)``, which it also returns as output 3).
* ``RotaryEmbedding`` — ``(input, position_ids, cos_cache, sin_cache)`` on ``[B, S, H*D]`` or
  ``[B, H, S, D]``.
"""
from __future__ import annotations

import math

import numpy as np

from olv_runtime import kernels
from olv_runtime.errors import ValidationError
from olv_runtime.kv import contiguous as kv
from olv_runtime.ops.nn import RMSNormalization, RotaryEmbedding, _normalize
from olv_runtime.ops.olv import EncodedGather
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty
from olv_runtime.proto import TensorProto
from olv_runtime.structs.recognize import (
    from_gather_block_quantized,
    from_matmul_nbits,
    gather_table,
    mark_source,
)

MS = "com.microsoft"


def _const(info, op: Op, idx: int, what: str, required: bool = True):
    names = op.node.input
    name = names[idx] if idx < len(names) else ""
    if not name:
        if required:
            raise ValidationError(f"node {op.name!r} ({op.node.op_type}): input {what} is required")
        return None
    consts = getattr(info, "_constants", {})
    if name not in consts:
        raise ValidationError(
            f"node {op.name!r} ({op.node.op_type}): input {what} ({name!r}) must be an "
            "initializer (weights are recognised at session creation)")
    return consts[name]


@register("MatMulNBits", 1, domain=MS)
class MatMulNBits(Op):
    """``Y[..., N] = A[..., K] @ W.T + bias`` with ``W`` the dequantized ``B`` (see module)."""

    attributes = {"K": Op.REQUIRED, "N": Op.REQUIRED, "bits": 4, "block_size": Op.REQUIRED,
                  "accuracy_level": 0}

    def setup(self, info):
        if len(self.node.input) > 4 and self.node.input[4]:
            raise ValidationError(
                f"node {self.name!r} (MatMulNBits): g_idx (act-order) is not supported")
        a = self.attrs
        if not 0 <= a["accuracy_level"] <= 4:
            raise ValidationError(
                f"node {self.name!r} (MatMulNBits): accuracy_level must be 0-4, got "
                f"{a['accuracy_level']}")
        b = _const(info, self, 1, "B")
        scales = _const(info, self, 2, "scales")
        zp = _const(info, self, 3, "zero_points", required=False)
        self.bias = _const(info, self, 5, "bias", required=False)
        self.weight = mark_source(
            from_matmul_nbits(self.name, np.asarray(b), np.asarray(scales),
                              None if zp is None else np.asarray(zp), a["N"], a["K"], a["bits"],
                              a["block_size"]),
            (self.node.input[1], self.node.input[2],
             self.node.input[3] if len(self.node.input) > 3 else ""),
            f"com.microsoft.MatMulNBits K={a['K']} N={a['N']} bits={a['bits']} "
            f"block_size={a['block_size']}")
        if self.bias is not None and self.bias.shape != (a["N"],):
            raise ValidationError(
                f"node {self.name!r} (MatMulNBits): bias must be [{a['N']}], got "
                f"{list(self.bias.shape)}")
        self.counters = getattr(info, "counters", None)
        self.cache_dense = a["bits"] == 8
        self._dense = None

    def run(self, x, *_):
        n, k = self.attrs["N"], self.attrs["K"]
        if x.dtype not in (np.float32, np.float16) or x.shape[-1:] != (k,):
            raise self.fail(f"A must be float32/float16 [..., {k}], got {x.dtype}{list(x.shape)}")
        w = self._dense
        if w is None:
            w = self.weight.decode().astype(np.float32, copy=False)
            if self.counters is not None:
                self.counters.add("bytes_dequantized", w.nbytes)
            if self.cache_dense:  # 8-bit: decoded once, kept
                self._dense = w
        y = x.astype(np.float32, copy=False).reshape(-1, k) @ w.T
        if self.bias is not None:
            y = y + self.bias.astype(np.float32)
        return (y.reshape(*x.shape[:-1], n).astype(x.dtype, copy=False),)


@register("GatherBlockQuantized", 1, domain=MS)
class GatherBlockQuantized(Op):
    """``output = dequant(data)[indices]`` along ``gather_axis`` 0 (rows decoded on demand)."""

    attributes = {"gather_axis": 0, "quantize_axis": 1, "block_size": 128, "bits": 4}

    def setup(self, info):
        if self.attrs["gather_axis"] != 0:
            raise ValidationError(
                f"node {self.name!r} (GatherBlockQuantized): only gather_axis 0 is supported, got "
                f"{self.attrs['gather_axis']}")
        if self.attrs["bits"] != 4:
            raise ValidationError(
                f"node {self.name!r} (GatherBlockQuantized): only bits 4 is supported, got "
                f"{self.attrs['bits']}")
        proto, payload = _initializer_through_reshape(info, self.node.input[0])
        if proto is None or payload is None:
            raise ValidationError(
                f"node {self.name!r} (GatherBlockQuantized): data ({self.node.input[0]!r}) must be "
                "an initializer (or a Reshape of one, as tied embeddings are written)")
        scales = np.asarray(_const(info, self, 2, "scales"))
        zp = _const(info, self, 3, "zero_points", required=False)
        av = from_gather_block_quantized(self.name, proto, payload, scales,
                                         None if zp is None else np.asarray(zp),
                                         self.attrs["block_size"], self.attrs["quantize_axis"])
        self.table = gather_table(av, getattr(info, "counters", None))
        self.out_dtype = scales.dtype

    def run(self, data, indices, *_):
        if indices.dtype not in (np.int32, np.int64):
            raise self.fail(f"indices must be int32 or int64, got {indices.dtype}")
        v = self.table.shape[0]
        if indices.size and (indices.min() < -v or indices.max() >= v):
            raise self.fail(f"indices must lie in [{-v}, {v - 1}], got [{indices.min()}, "
                            f"{indices.max()}]")
        ids = np.where(indices < 0, indices + v, indices)
        (y,) = EncodedGather(self.name, self.table)(ids)
        return (y.astype(self.out_dtype, copy=False),)


def _initializer_through_reshape(info, name: str):
    """(TensorProto, payload) of initializer ``name``, or of the initializer a chain of
    Reshape nodes views (the tied-embedding form: GatherBlockQuantized reads
    ``Reshape(lm_head B [V, blocks, blob] -> [V, blocks * blob])``); the returned proto has the
    reshaped 2-D dims [V, rest] (same bytes, zero-copy)."""
    protos = getattr(info, "_initializer_protos", {})
    payloads = getattr(info, "_initializer_payloads", {})
    if name in protos:
        return protos[name], payloads.get(name)
    graph = info.model.proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    n = producer.get(name)
    while n is not None and n.op_type == "Reshape" and n.domain in ("", "ai.onnx"):
        src = n.input[0]
        if src in protos:
            t = protos[src]
            dims = [int(d) for d in t.dims]
            if not dims:
                return None, None
            view = TensorProto(name=src, data_type=t.data_type)
            view.dims.extend([dims[0], int(np.prod(dims[1:], dtype=np.int64))])
            return view, payloads.get(src)
        n = producer.get(src)
    return None, None


@register("SimplifiedLayerNormalization", 1, domain=MS)
@register("SimplifiedLayerNormalization", 1)  # onnxruntime registers it in the ONNX domain too
class SimplifiedLayerNormalization(Op):
    """RMS normalisation over axes ``axis..``: ``x / sqrt(mean(x^2) + epsilon) * scale``
    (outputs Y and, optionally, inv_std_var)."""

    attributes = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}

    def run(self, x, scale):
        axis = self.attrs["axis"]
        if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        eps = float(np.float32(self.attrs["epsilon"]))
        if axis % x.ndim == x.ndim - 1 and x.dtype == np.float32 and scale.shape == x.shape[-1:]:
            y = RMSNormalization._last_axis_f32(x, scale, eps)
        else:
            y = _normalize(self, x, scale, None, axis % x.ndim, eps, rms=True)
        if len(self.node.output) > 1 and self.node.output[1]:
            xf = x.astype(np.float32)
            axes = tuple(range(axis % x.ndim, x.ndim))
            inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=axes, keepdims=True) + np.float32(eps))
            return (y, inv.astype(np.float32))
        return (y,)


@register("SkipSimplifiedLayerNormalization", 1, domain=MS)
class SkipSimplifiedLayerNormalization(Op):
    """``s = input + skip (+ bias)``; ``output = s / sqrt(mean(s^2) + epsilon) * gamma``;
    outputs (output, mean (unused: empty), inv_std_var, input_skip_bias_sum)."""

    attributes = {"epsilon": 1e-5}

    def run(self, x, skip, gamma, bias=None):
        if x.dtype != skip.dtype or x.shape[-1:] != skip.shape[-1:]:
            raise self.fail(f"input {x.dtype}{list(x.shape)} and skip {skip.dtype}"
                            f"{list(skip.shape)} must share dtype and hidden size")
        try:
            s = np.add(x, skip, out=empty(np.broadcast_shapes(x.shape, skip.shape), x.dtype))
        except ValueError:
            raise self.fail(f"skip shape {list(skip.shape)} does not broadcast to "
                            f"{list(x.shape)}") from None
        if bias is not None:
            np.add(s, bias, out=s)
        eps = float(np.float32(self.attrs["epsilon"]))
        if s.dtype == np.float32 and gamma.shape == s.shape[-1:]:
            y = RMSNormalization._last_axis_f32(s, gamma, eps)
        else:
            y = _normalize(self, s, gamma, None, s.ndim - 1, eps, rms=True)
        outs = [y, None, None, s]
        if len(self.node.output) > 2 and self.node.output[2]:
            sf = s.astype(np.float32)
            outs[2] = (1.0 / np.sqrt(np.mean(sf * sf, axis=-1, keepdims=True)
                                     + np.float32(eps))).astype(np.float32)
        if len(self.node.output) > 1 and self.node.output[1]:
            outs[1] = np.mean(s.astype(np.float32), axis=-1, keepdims=True)
        return tuple(outs[: len(self.node.output)])


@register("RotaryEmbedding", 1, domain=MS)
class RotaryEmbeddingMS(Op):
    """com.microsoft RotaryEmbedding: inputs (input, position_ids, cos_cache, sin_cache);
    ``position_ids`` [B, S] or a scalar start offset; ``cos_cache`` [max_pos, rot/2]."""

    attributes = {"interleaved": 0, "num_heads": 0, "rotary_embedding_dim": 0, "scale": 1.0,
                  "is_packed_batching": 0}

    def setup(self, info):
        if self.attrs["scale"] != 1.0 or self.attrs["is_packed_batching"]:
            raise ValidationError(
                f"node {self.name!r} (com.microsoft RotaryEmbedding): scale != 1 and "
                "is_packed_batching are not supported")

    def run(self, x, position_ids, cos_cache, sin_cache):
        if x.dtype != np.float32:
            raise self.fail(f"expected float32 input, got {x.dtype}")
        if x.ndim == 3:
            b, s = x.shape[:2]
        elif x.ndim == 4:
            b, s = x.shape[0], x.shape[2]
        else:
            raise self.fail(f"input must be 3-D or 4-D, got rank {x.ndim}")
        pos = np.asarray(position_ids).astype(np.int64)
        if pos.size == 1 and pos.ndim <= 1:
            pos = np.broadcast_to(pos.reshape(()) + np.arange(s), (b, s))
        return RotaryEmbedding.run(self, x, cos_cache, sin_cache, np.ascontiguousarray(pos))


@register("GroupQueryAttention", 1, domain=MS)
class GroupQueryAttention(Op):
    """com.microsoft GroupQueryAttention (see the module docstring for what is supported)."""

    attributes = {"num_heads": Op.REQUIRED, "kv_num_heads": Op.REQUIRED, "scale": 0.0,
                  "do_rotary": 0, "rotary_interleaved": 0, "local_window_size": -1,
                  "softcap": 0.0, "smooth_softmax": 0, "qk_output": 0}

    def setup(self, info):
        a = self.attrs
        node = self.node
        if a["smooth_softmax"]:
            raise ValidationError(f"node {self.name!r} (GroupQueryAttention): smooth_softmax is "
                                  "not supported")
        if a["qk_output"]:
            raise ValidationError(f"node {self.name!r} (GroupQueryAttention): qk_output is not "
                                  "supported")
        for idx, what in ((10, "attention_bias"), (11, "head_sink")):
            if len(node.input) > idx and node.input[idx]:
                raise ValidationError(
                    f"node {self.name!r} (GroupQueryAttention): input {what} is not supported")
        if a["num_heads"] <= 0 or a["kv_num_heads"] <= 0 or a["num_heads"] % a["kv_num_heads"]:
            raise ValidationError(
                f"node {self.name!r} (GroupQueryAttention): num_heads {a['num_heads']} must be a "
                f"positive multiple of kv_num_heads {a['kv_num_heads']}")
        if not (len(node.input) > 4 and node.input[3] and node.input[4]):
            raise ValidationError(
                f"node {self.name!r} (GroupQueryAttention): past_key and past_value are required")
        self.packed = not (len(node.input) > 2 and node.input[1] and node.input[2])
        opts = getattr(info, "options", None)
        self.kv_opts = {
            "initial_capacity": getattr(opts, "kv_initial_capacity", 256),
            "growth": getattr(opts, "kv_growth", 2.0),
            "counters": getattr(info, "counters", None),
        }

    def run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
            total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None, *_):
        # key/value are optional (packed QKV); past_key/past_value are checked in setup
        if seqlens_k is None or total_sequence_length is None:
            raise self.fail("seqlens_k and total_sequence_length are required")
        a = self.attrs
        h, kvh = a["num_heads"], a["kv_num_heads"]
        if query.dtype != np.float32 or query.ndim != 3:
            raise self.fail(f"query must be float32 [B, S, hidden], got {query.dtype}"
                            f"{list(query.shape)}")
        b, s, hid = query.shape
        if past_key.ndim != 4 or past_key.shape[:2] != (b, kvh) or past_value.shape != past_key.shape:
            raise self.fail(f"past_key/past_value must be [{b}, {kvh}, past, head_size], got "
                            f"{list(past_key.shape)} and {list(past_value.shape)}")
        d = past_key.shape[3]
        if self.packed:
            if hid != (h + 2 * kvh) * d:
                raise self.fail(f"packed QKV must have {(h + 2 * kvh) * d} features, got {hid}")
            q = np.ascontiguousarray(query[:, :, : h * d])
            k = np.ascontiguousarray(query[:, :, h * d: (h + kvh) * d])
            v = np.ascontiguousarray(query[:, :, (h + kvh) * d:])
        else:
            q = np.array(query, np.float32, order="C")
            k = np.array(key, np.float32, order="C")
            v = np.ascontiguousarray(value, np.float32)
            if q.shape != (b, s, h * d) or k.shape != (b, s, kvh * d) or v.shape != k.shape:
                raise self.fail(f"query/key/value must be [{b}, {s}, {h * d}] / [{b}, {s}, "
                                f"{kvh * d}], got {list(q.shape)}, {list(k.shape)}, "
                                f"{list(v.shape)}")
        past = past_key.shape[2]
        sk = np.asarray(seqlens_k).reshape(-1)
        if sk.shape != (b,) or np.any(sk.astype(np.int64) + 1 != past + s):
            raise self.fail(
                f"seqlens_k must be past + S - 1 = {past + s - 1} for every row (padded batches "
                f"are not supported), got {sk.tolist()}")
        total = int(np.asarray(total_sequence_length).reshape(()))
        if total != past + s:
            raise self.fail(f"total_sequence_length must be past + S = {past + s}, got {total}")
        scale = a["scale"] or 1.0 / math.sqrt(d)
        q4, k4, v4 = q.reshape(b, s, h, d), k.reshape(b, s, kvh, d), v.reshape(b, s, kvh, d)
        rot = 0
        if a["do_rotary"]:
            if cos_cache is None or sin_cache is None:
                raise self.fail("do_rotary needs cos_cache and sin_cache")
            half = cos_cache.shape[1]
            rot = 2 * half
            if position_ids is not None:
                pos = np.asarray(position_ids, np.int64).reshape(b, s)
            else:
                pos = np.broadcast_to(past + np.arange(s), (b, s))
            if pos.size and (pos.min() < 0 or pos.max() >= cos_cache.shape[0]):
                raise self.fail(f"positions [{pos.min()}, {pos.max()}] exceed the "
                                f"{cos_cache.shape[0]} cos_cache rows")
            cos = np.ascontiguousarray(cos_cache[pos], np.float32)
            sin = np.ascontiguousarray(sin_cache[pos], np.float32)
        if a["softcap"] or a["local_window_size"] >= 0:
            return self._general(q4, k4, v4, past_key, past_value, cos if rot else None,
                                 sin if rot else None, rot, past, scale)
        kbuf, t = kv.reserve(past_key, s, **self.kv_opts)
        vbuf, _ = kv.reserve(past_value, s, **self.kv_opts)
        out = empty((b, s, h, d), np.float32)
        if rot:
            kernels.rope_attention(q4, k4, v4, cos, sin, bool(a["rotary_interleaved"]), rot,
                                   kbuf, vbuf, t, float(np.float32(scale)), True, out)
        else:
            kbuf[:, :, t:t + s] = k4.transpose(0, 2, 1, 3)
            vbuf[:, :, t:t + s] = v4.transpose(0, 2, 1, 3)
            kernels.attention(q4, kbuf, vbuf, t, float(np.float32(scale)), True, out=out)
        counters = self.kv_opts.get("counters")
        if counters is not None:
            counters.add("bytes_copied_kv_append", k.nbytes + v.nbytes)
        return out.reshape(b, s, h * d), kv.present(kbuf, t + s), kv.present(vbuf, t + s)

    def _general(self, q4, k4, v4, past_key, past_value, cos, sin, rot, past, scale):
        a = self.attrs
        b, s, h, d = q4.shape
        kvh = k4.shape[2]
        if rot:
            il = bool(a["rotary_interleaved"])
            q4 = kernels.rotary_embedding(q4, cos, sin, il, rot)
            k4 = kernels.rotary_embedding(k4, cos, sin, il, rot)
        pk = np.concatenate([past_key, k4.transpose(0, 2, 1, 3)], axis=2)
        pv = np.concatenate([past_value, v4.transpose(0, 2, 1, 3)], axis=2)
        t = pk.shape[2]
        kf = np.repeat(pk, h // kvh, axis=1)
        vf = np.repeat(pv, h // kvh, axis=1)
        sc = np.matmul(q4.transpose(0, 2, 1, 3), kf.transpose(0, 1, 3, 2)) * np.float32(scale)
        cap = float(a["softcap"])
        if cap > 0:
            sc = np.float32(cap) * np.tanh(sc / np.float32(cap))
        i = past + np.arange(s).reshape(s, 1)
        j = np.arange(t).reshape(1, t)
        allowed = j <= i
        if a["local_window_size"] >= 0:
            allowed &= j > i - a["local_window_size"]
        sc = np.where(allowed, sc, -np.inf)
        sc = sc - sc.max(axis=-1, keepdims=True)
        p = np.exp(sc)
        p /= p.sum(axis=-1, keepdims=True)
        y = np.matmul(p, vf).transpose(0, 2, 1, 3).reshape(b, s, h * d)
        return (np.ascontiguousarray(y, np.float32), pk, pv)
