"""Prefill attention in blocks of query positions (kernels/attention.py ``_attend_task``,
``QBLOCK`` rows per task sharing one pass over the keys all of them attend): every output row is
bitwise the row's own pass (``_attend_rows`` over its keys alone, the algorithm before the
blocks and the batching engine's row attention), on the serial and the parallel driver, causal
or not, with and without cached keys, for block-aligned and ragged query counts, and within the
float32 tolerance of a float64 softmax."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from numba import njit

att = importlib.import_module("olv_runtime.kernels.attention")


@njit(cache=False)
def _row_by_row(q, kc, vc, past_len, scale, is_causal, out):
    b_n, s_n, h_n, d = q.shape
    kvh = kc.shape[1]
    group = h_n // kvh
    m = np.empty(group, np.float32)
    l = np.empty(group, np.float32)
    sc = np.empty((group, att.TILE + att.SLACK), np.float32)
    p = np.empty((group, att.TILE + att.SLACK), np.float32)
    mx = np.empty(group, np.float32)
    for b in range(b_n):
        for g in range(kvh):
            for s in range(s_n):
                nkeys = past_len + s + 1 if is_causal else past_len + s_n
                o = out[b, s, g * group:(g + 1) * group]
                att._state_init(m, l, o, group)
                att._attend_rows(q[b, s, g * group:(g + 1) * group], group, kc[b, g], vc[b, g],
                                 np.int64(0), nkeys, scale, m, l, o, sc, p, mx)
                att._state_finish(l, o, group, o)


@pytest.mark.parametrize("h,kvh,d", [(16, 8, 128), (14, 2, 64), (4, 4, 40)])
@pytest.mark.parametrize("s,past", [(1, 0), (5, 3), (8, 0), (9, 60), (70, 0), (130, 37)])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_bitwise_equal_row_by_row(h, kvh, d, s, past, causal):
    assert att.QBLOCK > 1
    rng = np.random.default_rng(h * 1000 + s * 10 + past)
    b = 2
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    kc = rng.standard_normal((b, kvh, past + s + 3, d)).astype(np.float32)
    vc = rng.standard_normal((b, kvh, past + s + 3, d)).astype(np.float32)
    scale = np.float32(1.0 / np.sqrt(d))
    want = np.empty_like(q)
    _row_by_row(q, kc, vc, past, scale, causal, want)
    for driver in (att._attention_ser, att._attention_par):
        got = np.full_like(q, np.nan)
        driver(q, kc, vc, past, scale, causal, got)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), driver
    # and the public entry (parallel above its work threshold), against float64
    got = att.attention(q, kc, vc, past, float(scale), causal)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    g = h // kvh
    qd, kd, vd = (a.astype(np.float64) for a in (q, kc, vc))
    for hh in range(h):
        sc = np.einsum("bsd,btd->bst", qd[:, :, hh], kd[:, hh // g, :past + s]) * float(scale)
        if causal:
            mask = np.arange(past + s)[None, :] > (past + np.arange(s))[:, None]
            sc = np.where(mask[None], -np.inf, sc)
        w = np.exp(sc - sc.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        ref = np.einsum("bst,btd->bsd", w, vd[:, hh // g, :past + s])
        assert np.allclose(got[:, :, hh], ref, rtol=1e-4, atol=1e-5)
