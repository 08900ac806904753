"""``olv.PagedAttention`` (since version 1): attention whose KV cache is a whole struct value.

Inputs ``Q [B, S, H*D]``, ``K [B, S, KVH*D]``, ``V [B, S, KVH*D]`` (float32, RoPE applied, as
ONNX Attention's 3-D inputs) and ``past_cache`` (a ``PagedKVCache`` struct value, see
:mod:`olv_runtime.kv.paged`); outputs ``Y [B, S, H*D]`` and ``present_cache`` (the next cache
value: the past blocks shared, new tokens appended, full blocks sealed by the policy). Batch 1:
one cache value holds one sequence.

Attributes
----------
q_num_heads, kv_num_heads : int (required)
    ``H`` and ``KVH``; ``H % KVH == 0`` is checked when the session is created.
scale : float
    Multiplies ``q . k`` (default ``1/sqrt(D)``).
is_causal : int
    1: the query at position ``p`` attends positions ``<= p`` (past + new, as ONNX Attention
    with a cache); 0: every key.
block_size : int
    Tokens per block (default 16); must equal the block type's declared BS when declared.
key_policy, value_policy : str
    Seal policies (:class:`~olv_runtime.kv.paged.SealPolicy`), value defaults to key.
open_format : str
    ``float32`` or ``float16``: format of the newest block.
scales : str
    ``token`` or ``block``: INT8/INT4 scales per token and head or per block and head.
chunk_blocks : int
    Block slots per chunk allocation (default 64).

Semantics equal ONNX ``Attention`` (opset 23, 3-D inputs, ``past_key``/``past_value``) when every
block is dense float32; quantized blocks are read as their decoded values. The encoded blocks are
never decoded into buffers (``bytes_dequantized`` is not touched).
"""
from __future__ import annotations

import math

import numpy as np

from olv_runtime.errors import ValidationError
from olv_runtime.kv import paged
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty


@register("PagedAttention", 1, domain="olv")
class PagedAttention(Op):
    accepts_structured = True  # the session lets a struct-typed graph input reach this op

    attributes = {
        "q_num_heads": Op.REQUIRED, "kv_num_heads": Op.REQUIRED, "scale": None, "is_causal": 1,
        "block_size": paged.DEFAULT_BLOCK_SIZE, "key_policy": "float32", "value_policy": "",
        "open_format": "float32", "scales": "token", "chunk_blocks": paged.DEFAULT_CHUNK_BLOCKS,
    }

    def setup(self, info):
        a = self.attrs
        h, kvh = int(a["q_num_heads"]), int(a["kv_num_heads"])
        if h <= 0 or kvh <= 0 or h % kvh:
            raise ValidationError(
                f"node {self.name!r} (PagedAttention): q_num_heads {h} must be a positive "
                f"multiple of kv_num_heads {kvh} (GQA)")
        if int(a["block_size"]) <= 0 or int(a["chunk_blocks"]) <= 0:
            raise ValidationError(f"node {self.name!r} (PagedAttention): block_size and "
                                  "chunk_blocks must be positive")
        try:
            self.policy = paged.SealPolicy(a["key_policy"], a["value_policy"], a["open_format"],
                                           a["scales"])
        except Exception as exc:
            raise ValidationError(f"node {self.name!r} (PagedAttention): {exc}") from None
        self.h, self.kvh = h, kvh
        self.counters = getattr(info, "counters", None)
        self._managers: dict[int, paged.PagedKV] = {}

    def _manager(self, d: int) -> paged.PagedKV:
        mgr = self._managers.get(d)
        if mgr is None:
            geom = paged.Geometry(self.kvh, int(self.attrs["block_size"]), d)
            try:
                mgr = paged.PagedKV(geom, self.policy, int(self.attrs["chunk_blocks"]),
                                    self.counters)
            except Exception as exc:
                raise self.fail(str(exc)) from None
            self._managers[d] = mgr
        return mgr

    def run(self, q, k, v, past_cache):
        for nm, arr in (("Q", q), ("K", k), ("V", v)):
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 3:
                raise self.fail(f"{nm} must be a float32 [B, S, hidden] array")
        b, s, hq = q.shape
        if b != 1:
            raise self.fail(f"batch must be 1 (one paged cache holds one sequence), got {b}")
        if hq % self.h:
            raise self.fail(f"Q hidden size {hq} is not divisible by q_num_heads {self.h}")
        d = hq // self.h
        if k.shape != (1, s, self.kvh * d) or v.shape != k.shape:
            raise self.fail(f"K/V must be [1, {s}, {self.kvh * d}], got {list(k.shape)} and "
                            f"{list(v.shape)}")
        scale = self.attrs["scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        mgr = self._manager(d)
        q3 = np.ascontiguousarray(q[0]).reshape(s, self.h, d)
        k3 = np.ascontiguousarray(k[0]).reshape(s, self.kvh, d)
        v3 = np.ascontiguousarray(v[0]).reshape(s, self.kvh, d)
        out, present = mgr.run(past_cache, q3, k3, v3, float(np.float32(scale)),
                               bool(self.attrs["is_causal"]))
        y = empty((1, s, hq), np.float32)
        y[0] = out.reshape(s, hq)
        return (y, present)
