"""Multi-head attention with grouped-query heads over a contiguous KV cache.

Source: ONNX ``Attention`` (opset 23) with ``past_key``/``past_value`` (internal cache),
``is_causal`` (bottom-right aligned: query ``i`` of the ``S`` new ones attends key ``j`` iff
``j <= past_len + i``), ``q_num_heads``/``kv_num_heads`` (query head ``h`` uses kv head
``h // (H // KVH)``), no attention mask, no softcap; softmax in float32.

Workspace: none. Each ``(b, h, s)`` task runs an *online* (streaming) softmax over the keys,
keeping the running max ``m``, the running sum ``l`` and the un-normalised output accumulator,
which lives directly in ``out[b, s, h, :]`` (rescaled by ``exp(m_old - m_new)`` when the max
grows) and is divided by ``l`` at the end. Scores are float32 dot products times ``scale``.
A query with no attendable key gets zeros (ONNX convention for fully masked rows).
Results agree with the reference (which materialises the score matrix and computes
``(Q*sqrt(scale)) @ (K*sqrt(scale)).T``) to ~1e-6 relative.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from olv_runtime.errors import InvalidArgument

from .rope import _rope_token
from .config import JIT, PARALLEL_MIN_WORK, PJIT, check_array, check_int, check_out

__all__ = ["attention", "append_kv", "kv_write", "rope_attention"]

#: Query-row x key x head-dim products above which attention splits its (b, h, s) rows over the
#: threads: each row's streaming softmax is serial scalar work, so even short contexts pay off.
ATTENTION_PARALLEL_WORK = 1 << 14


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"})
def _dot(a, b, n):
    """sum(a[:n] * b[:n]) in float32, reassociated so LLVM vectorises it (the summation order is
    fixed by the compiled code: deterministic, within float32 rounding of the sequential sum;
    no FMA contraction)."""
    s = np.float32(0.0)
    for i in range(n):
        s += a[i] * b[i]
    return s


@njit(**JIT)
def _attend_one(q, k, v, nkeys, scale, o):
    """q: [D]; k, v: [T, D] (one kv head); first ``nkeys`` keys; o: [D] output."""
    d = q.shape[0]
    for i in range(d):
        o[i] = 0.0
    if nkeys <= 0:
        return
    mx = np.float32(-np.inf)
    l = np.float32(0.0)
    for j in range(nkeys):
        sc = _dot(q, k[j], d) * scale
        if sc > mx:
            corr = np.exp(mx - sc)  # exp(-inf) = 0 on the first key
            l = l * corr + np.float32(1.0)
            for i in range(d):
                o[i] = o[i] * corr + v[j, i]
            mx = sc
        else:
            p = np.exp(sc - mx)
            l += p
            for i in range(d):
                o[i] += p * v[j, i]
    inv = np.float32(1.0) / l
    for i in range(d):
        o[i] *= inv


@njit(**JIT)
def _attend_task(t, q, k_cache, v_cache, past_len, scale, is_causal, out):
    """Task ``t`` of ``B*H*S``: one query row (b, h, s) over its visible keys."""
    b_n, s_n, h_n, d = q.shape
    group = h_n // k_cache.shape[1]
    b = t // (h_n * s_n)
    rem = t - b * (h_n * s_n)
    h = rem // s_n
    s = rem - h * s_n
    nkeys = past_len + s + 1 if is_causal else past_len + s_n
    _attend_one(q[b, s, h], k_cache[b, h // group], v_cache[b, h // group], nkeys, scale,
                out[b, s, h])


@njit(**PJIT)
def _attention_par(q, k_cache, v_cache, past_len, scale, is_causal, out):
    b_n, s_n, h_n, d = q.shape
    for t in prange(b_n * h_n * s_n):
        _attend_task(t, q, k_cache, v_cache, past_len, scale, is_causal, out)


@njit(**JIT)
def _attention_ser(q, k_cache, v_cache, past_len, scale, is_causal, out):
    b_n, s_n, h_n, d = q.shape
    for t in range(b_n * h_n * s_n):
        _attend_task(t, q, k_cache, v_cache, past_len, scale, is_causal, out)


@njit(**PJIT)
def _append_kv_par(past, new, out):
    b_n, kvh, p, d = past.shape
    s_n = new.shape[1]
    for t in prange(b_n * kvh):
        b = t // kvh
        g = t - b * kvh
        for j in range(p):
            for i in range(d):
                out[b, g, j, i] = past[b, g, j, i]
        for j in range(s_n):
            for i in range(d):
                out[b, g, p + j, i] = new[b, j, g * d + i]


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, past_len: int,
              scale: float, is_causal: bool, out=None) -> np.ndarray:
    """Scaled dot-product attention of ``S`` new queries over a KV cache (GQA).

    Parameters
    ----------
    q : ndarray of float32, shape [B, S, H, D], C-contiguous
        Queries (the 3-D ONNX ``[B, S, H*D]`` input reshaped without copy).
    k_cache, v_cache : ndarray of float32, shape [B, KVH, T, D], C-contiguous
        Keys/values of the past tokens followed by the ``S`` new ones (ONNX ``present_key`` /
        ``present_value``). ``T >= past_len + S``; only the first ``past_len + S`` keys are read
        (so a larger capacity buffer may be passed). ``H % KVH == 0``.
    past_len : int
        Number of cached tokens before the new ones.
    scale : float
        Multiplies ``q . k`` (ONNX ``scale``; usually ``1/sqrt(D)``).
    is_causal : bool
        Bottom-right aligned causal mask: query ``i`` attends key ``j`` iff ``j <= past_len + i``.
        Otherwise every query attends all ``past_len + S`` keys.
    out : ndarray of float32, shape [B, S, H, D], optional

    Returns
    -------
    ndarray of float32, shape [B, S, H, D]
        ``softmax(q k^T * scale) v`` per head; ONNX output ``Y`` viewed as [B, S, H, D].
    """
    check_array(q, "q", dtype=np.float32, ndim=4)
    b, s, h, d = q.shape
    check_array(k_cache, "k_cache", dtype=np.float32, ndim=4)
    kvh, t = k_cache.shape[1], k_cache.shape[2]
    check_array(k_cache, "k_cache", dtype=np.float32, shape=(b, None, None, d))
    check_array(v_cache, "v_cache", dtype=np.float32, shape=(b, kvh, t, d))
    if kvh == 0 or h % kvh != 0:
        raise InvalidArgument(f"k_cache: expected a kv head count dividing the {h} query heads, "
                              f"got {kvh}")
    past_len = check_int(past_len, "past_len", lo=0)
    if past_len + s > t:
        raise InvalidArgument(f"past_len: expected past_len + S <= T = {t} (cache length), got "
                              f"past_len={past_len}, S={s}")
    try:
        sc = np.float32(scale)
    except (TypeError, ValueError):
        raise InvalidArgument(f"scale: expected a float, got {scale!r}") from None
    out = check_out(out, "out", np.float32, (b, s, h, d))
    if out.size:
        work = b * s * h * (past_len + s) * d
        if work >= ATTENTION_PARALLEL_WORK and b * s * h > 1:
            _attention_par(q, k_cache, v_cache, past_len, sc, bool(is_causal), out)
        else:
            _attention_ser(q, k_cache, v_cache, past_len, sc, bool(is_causal), out)
    return out


def append_kv(cache_past: np.ndarray, new: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write ``concat(cache_past, new as [B, KVH, S, D], axis=2)`` into ``out``.

    The ``present_key``/``present_value`` computation of ONNX ``Attention`` (opset 23):
    ``new`` is the 3-D ``[B, S, KVH*D]`` key (or value) input, reshaped to ``[B, S, KVH, D]``
    and transposed to ``[B, KVH, S, D]``.

    Parameters
    ----------
    cache_past : ndarray of float32, shape [B, KVH, P, D], C-contiguous
    new : ndarray of float32, shape [B, S, KVH*D], C-contiguous
    out : ndarray of float32, shape [B, KVH, P+S, D], C-contiguous, allocated by the caller;
        must not overlap the inputs.

    Returns
    -------
    ndarray
        ``out``.
    """
    check_array(cache_past, "cache_past", dtype=np.float32, ndim=4)
    b, kvh, p, d = cache_past.shape
    check_array(new, "new", dtype=np.float32, ndim=3)
    check_array(new, "new", dtype=np.float32, shape=(b, None, kvh * d))
    s = new.shape[1]
    if out is None:
        raise InvalidArgument("out: expected a float32 array of shape "
                              f"[{b}, {kvh}, {p + s}, {d}], got None")
    check_out(out, "out", np.float32, (b, kvh, p + s, d))
    if np.may_share_memory(out, cache_past) or np.may_share_memory(out, new):
        raise InvalidArgument("out: expected a buffer not overlapping cache_past/new, got an "
                              "overlapping one")
    if out.size:
        _append_kv_par(cache_past, new, out)
    return out


@njit(**JIT)
def _kv_write_ser(cache, new, start):
    b_n, kvh, cap, d = cache.shape
    s_n = new.shape[1]
    for t in range(b_n * kvh):
        b = t // kvh
        g = t - b * kvh
        for j in range(s_n):
            for i in range(d):
                cache[b, g, start + j, i] = new[b, j, g * d + i]


def kv_write(cache: np.ndarray, new: np.ndarray, start: int) -> np.ndarray:
    """Write new keys (or values) into a KV capacity buffer at token position ``start``.

    Parameters
    ----------
    cache : ndarray of float32, shape [B, KVH, CAP, D], C-contiguous, writeable
        The capacity buffer (present tokens occupy ``[:, :, :start]``).
    new : ndarray of float32, shape [B, S, KVH*D], C-contiguous
        The ONNX 3-D K/V input of ``S`` new tokens.
    start : int
        First token slot written; ``start + S <= CAP``.

    Returns
    -------
    ndarray
        ``cache`` (slots ``[start, start + S)`` written, nothing else touched).
    """
    check_array(cache, "cache", dtype=np.float32, ndim=4)
    b, kvh, cap, d = cache.shape
    check_array(new, "new", dtype=np.float32, shape=(b, None, kvh * d))
    start = check_int(start, "start", lo=0)
    if start + new.shape[1] > cap:
        raise InvalidArgument(f"start: expected start + S <= capacity {cap}, got start={start}, "
                              f"S={new.shape[1]}")
    if not cache.flags.writeable:
        raise InvalidArgument("cache: expected a writeable buffer, got a read-only one")
    if new.shape[1]:
        _kv_write_ser(cache, new, start)
    return cache


@njit(**JIT)
def _rope_kv_ser(q, k, v, cos, sin, interleaved, rdim, kbuf, vbuf, start):
    """Rotate q [B,S,H,D] and k [B,S,KVH,D] in place, then write k, v into the KV buffers."""
    b_n, s_n = q.shape[0], q.shape[1]
    kvh, d = k.shape[2], k.shape[3]
    for b in range(b_n):
        for s in range(s_n):
            _rope_token(q[b, s], cos[b, s], sin[b, s], interleaved, rdim, q[b, s])
            _rope_token(k[b, s], cos[b, s], sin[b, s], interleaved, rdim, k[b, s])
            for g in range(kvh):
                for i in range(d):
                    kbuf[b, g, start + s, i] = k[b, s, g, i]
                    vbuf[b, g, start + s, i] = v[b, s, g, i]


def rope_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                   interleaved: bool, rotary_dim: int, kbuf: np.ndarray, vbuf: np.ndarray,
                   past_len: int, scale: float, is_causal: bool, out: np.ndarray) -> np.ndarray:
    """Decode/prefill attention block: RoPE on q and k (in place), KV append, attention.

    The same arithmetic as :func:`~.rope.rotary_embedding` + :func:`kv_write` +
    :func:`attention` in sequence, in two kernel calls. Shapes are checked by the caller
    (the fused session step validates them against the graph once per call shape).

    Parameters
    ----------
    q : float32 [B, S, H, D], C-contiguous, writeable (rotated in place)
    k : float32 [B, S, KVH, D], C-contiguous, writeable (rotated in place)
    v : float32 [B, S, KVH, D], C-contiguous
    cos, sin : float32 [B, S, rotary_dim/2], C-contiguous
    interleaved : bool
    rotary_dim : int
        Rotated features per head (even, <= D).
    kbuf, vbuf : float32 [B, KVH, CAP, D], C-contiguous
        Capacity buffers; slots ``[past_len, past_len + S)`` are written.
    past_len : int
    scale : float
    is_causal : bool
    out : float32 [B, S, H, D], C-contiguous

    Returns
    -------
    ndarray
        ``out``.
    """
    _rope_kv_ser(q, k, v, cos, sin, bool(interleaved), int(rotary_dim), kbuf, vbuf, int(past_len))
    b, s, h, d = q.shape
    sc = np.float32(scale)
    if b * s * h * (past_len + s) * d >= ATTENTION_PARALLEL_WORK and b * s * h > 1:
        _attention_par(q, kbuf, vbuf, int(past_len), sc, bool(is_causal), out)
    else:
        _attention_ser(q, kbuf, vbuf, int(past_len), sc, bool(is_causal), out)
    return out
