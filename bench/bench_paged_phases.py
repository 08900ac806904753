"""Where the paged decode attention's time goes: one layer of Qwen2.5-0.5B's geometry (H=14,
KVH=2, D=64, block_size 16), one thread, the loop of the compiled paged decode step
(:func:`olv_runtime.kernels.decoder_layers._stack_thread_paged`: one softmax tile of blocks at a
time for every kv head, int8 queries as in int8-activation mode), split into phases:

* ``full``: :func:`~olv_runtime.kernels.paged_attention._attend_blocks` over every tile, as the
  step calls it (:func:`~.paged_attention._attend_blocks`: scores, online softmax, ``p @ V``,
  prefetch, block bookkeeping);
* ``scores``: the block scores alone (:func:`~olv_runtime.kernels.paged_blocks._block_scores_i8`:
  INT8/INT4 keys against the int8 queries);
* ``scores+softmax``: the same plus the online-softmax update of each tile;
* ``p@V``: the value side alone (:func:`~olv_runtime.kernels.paged_blocks._block_accum`: INT8/INT4 codes
  decoded in registers, times the row scales).

``hot``: the cache stays in L2/L3 between repetitions (median of 20 x 7 calls); ``cold``: a
64 MiB read between calls evicts it first (the decode step streams ~280 MB of weights per
token, so its KV comes from DRAM; min / median of 11). Bench only: it reads kernel internals.

    python bench/bench_paged_phases.py [--contexts 1024,4096] [--kinds int8,int4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit

from olv_runtime.kernels import paged_attention as pk
from olv_runtime.kernels.attention import SLACK, _softmax_tile, _state_init, _tile_max_init
from olv_runtime.kernels.packed_i8 import isa, use_vnni
from olv_runtime.kv.paged import Geometry, PagedKV, SealPolicy, empty_paged_cache

H, KVH, D, BS = 14, 2, 64, 16


@njit(cache=False)
def _run(qg, table, nb, reps, vnni, tb, mode):
    ng, d = qg.shape
    w = BS * tb
    m = np.full(ng, -np.inf, np.float32)
    l = np.zeros(ng, np.float32)
    mx = np.empty(ng, np.float32)
    sc = np.zeros((ng, w + SLACK), np.float32)
    p = np.zeros((ng, w + SLACK), np.float32)
    scr = np.zeros((BS, d), np.float32)
    rmul = np.zeros(BS + SLACK, np.float32)
    pend = np.zeros((w, 2), np.int64)
    qi = np.zeros((ng, d), np.int8)
    qip = np.zeros((ng, d), np.int8)
    qmul = np.zeros(ng, np.float32)
    qsum = np.zeros(ng, np.int32)
    o = np.zeros((ng, d), np.float32)
    pk._quantize_heads(qg, 0, ng, np.float32(0.125), qi, qip, qmul, qsum)
    m2 = np.empty((KVH, ng), np.float32)
    l2 = np.empty((KVH, ng), np.float32)
    o2 = np.empty((KVH, ng, d), np.float32)
    for _ in range(reps):
        if mode == 0:  # as the step: one tile of blocks at a time for every kv head
            for g in range(KVH):
                _state_init(m2[g], l2[g], o2[g], ng)
            for c0 in range(0, nb, tb):
                for g in range(KVH):
                    pk._attend_blocks(qg, ng, table, c0, min(c0 + tb, nb), g, BS, 0, False,
                                      np.float32(0.125), pk.SoftmaxState(m2[g], l2[g], o2[g]),
                                      pk.TileScratch(sc, p, mx, scr, rmul, pend),
                                      pk.Int8Query(True, vnni, qi, qip, qmul, qsum), nb,
                                      KVH if g == 0 else 0)
            continue
        for g in range(KVH):
            for c0 in range(0, nb, tb):
                _tile_max_init(mx, ng)
                c = 0
                for bi in range(c0, min(c0 + tb, nb)):
                    if table[bi, pk.T_KFMT] < 2 or table[bi, pk.T_VFMT] < 2:
                        continue  # a dense (open) block: not in the quantized phases
                    if mode == 3:
                        pk._block_accum(p, c, ng, table[bi, pk.T_VFMT], table[bi, pk.T_VADDR],
                                        table[bi, pk.T_VSADDR], table[bi, pk.T_VPT], g, BS, d,
                                        BS, o, scr, rmul)
                    else:
                        pk._block_scores_i8(qi, qip, qmul, qsum, ng,
                                            (table[bi, pk.T_KFMT], table[bi, pk.T_KADDR],
                                             table[bi, pk.T_KSADDR], table[bi, pk.T_KPT]), g, BS,
                                            d, BS, sc, c, mx, rmul, vnni)
                    c += BS
                if mode == 2:
                    _softmax_tile(sc, ng, c, mx, m, l, o, p)
    return o[0, 0] + o2[0, 0, 0] + sc[0, 0]


@njit(cache=False)
def _evict(a):
    s = np.float32(0.0)
    for i in range(0, a.size, 16):
        s += a[i]
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--kinds", default="int8,int4")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    vnni = use_vnni()
    tb = pk.tile_width(BS) // BS
    big = np.ones(16 << 20, np.float32)
    print(f"paged decode attention phases, one layer H={H} KVH={KVH} D={D} BS={BS}, 1 thread, "
          f"tile {tb * BS} keys, int8 queries ({isa()})")
    print(f"{'kind':<6}{'context':>8}  {'phase':<16}{'hot us':>9}{'cold min us':>13}"
          f"{'cold median us':>16}")
    for kind in args.kinds.split(","):
        for ctx in (int(c) for c in args.contexts.split(",")):
            mgr = PagedKV(Geometry(KVH, BS, D), SealPolicy(kind), chunk_blocks=64)
            k = rng.standard_normal((ctx, KVH, D)).astype(np.float32)
            v = rng.standard_normal((ctx, KVH, D)).astype(np.float32)
            q = rng.standard_normal((ctx, H, D)).astype(np.float32)
            _, cache = mgr.run(empty_paged_cache(), q, k, v, 0.125, True)
            table, _ = cache.meta.table.rows(KVH)
            nb = table.shape[0]
            qg = np.ascontiguousarray(rng.standard_normal((H // KVH, D)).astype(np.float32))
            for mode, name in ((0, "full"), (1, "scores"), (2, "scores+softmax"), (3, "p@V")):
                _run(qg, table, nb, 1, vnni, tb, mode)
                hot = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    _run(qg, table, nb, 20, vnni, tb, mode)
                    hot.append((time.perf_counter() - t0) / 20)
                cold = []
                for _ in range(11):
                    _evict(big)
                    t0 = time.perf_counter()
                    _run(qg, table, nb, 1, vnni, tb, mode)
                    cold.append(time.perf_counter() - t0)
                print(f"{kind:<6}{ctx:>8}  {name:<16}{statistics.median(hot) * 1e6:>9.1f}"
                      f"{min(cold) * 1e6:>13.1f}{statistics.median(cold) * 1e6:>16.1f}")


if __name__ == "__main__":
    main()
