"""Decode attention: time and KV bytes read per token, contiguous float32 vs paged INT8 / INT4.

Geometry of Qwen2.5-0.5B's attention (H=14, KVH=2, D=64), block_size 16, one layer, batch 1.
For each context (128, 1024, 4096) the cache is filled by one prefill call, then one decode
token is timed (median of ``--reps``):

* ``contiguous fp32``: :func:`olv_runtime.kernels.attention` over a capacity buffer
  (the kernel alone; the KV append is a separate ``kv_write``);
* ``paged fp32`` / ``paged int8`` / ``paged int4``: :meth:`olv_runtime.kv.paged.PagedKV.run`
  for one token — append, attention over the blocks (decoded inside the kernel), sealing — and
  the kernel alone (:func:`olv_runtime.kernels.paged_attention.paged_attention` over the cache
  value's block table: the ``ctx`` cached tokens);
* ``paged int8 q8`` / ``paged int4 q8``: the same with ``int8_query=True`` (integer scores of the
  quantized key blocks against the int8-rounded query, as the compiled decode step does in
  int8-activation mode; the step column still runs the float-query ``PagedKV.run``).

Bytes read per token are the KV payload the attention reads (codes and scales), from the
``bytes_read_kv_attention`` counter for paged caches and ``2 * KVH * T * D * 4`` for contiguous.

    python bench/bench_attention.py [--reps 50] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from olv_runtime import kernels
from olv_runtime.counters import recording
from olv_runtime.kernels.paged_attention import paged_attention
from olv_runtime.kv.paged import Geometry, PagedKV, SealPolicy, empty_paged_cache

H, KVH, D, BS = 14, 2, 64, 16


def _median(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def contiguous(ctx, reps, rng):
    kbuf = rng.standard_normal((1, KVH, ctx + 1, D)).astype(np.float32)
    vbuf = rng.standard_normal((1, KVH, ctx + 1, D)).astype(np.float32)
    q = rng.standard_normal((1, 1, H, D)).astype(np.float32)
    out = np.empty_like(q)
    t = _median(lambda: kernels.attention(q, kbuf, vbuf, ctx, 0.125, True, out=out), reps)
    return t, t, 2 * KVH * (ctx + 1) * D * 4


def paged(fmt, ctx, reps, rng, int8_query=False):
    mgr = PagedKV(Geometry(KVH, BS, D), SealPolicy(fmt), chunk_blocks=64)
    k = rng.standard_normal((ctx, KVH, D)).astype(np.float32)
    v = rng.standard_normal((ctx, KVH, D)).astype(np.float32)
    q = rng.standard_normal((ctx, H, D)).astype(np.float32)
    _, cache = mgr.run(empty_paged_cache(), q, k, v, 0.125, True)
    q1 = rng.standard_normal((1, H, D)).astype(np.float32)
    k1 = rng.standard_normal((1, KVH, D)).astype(np.float32)
    v1 = rng.standard_normal((1, KVH, D)).astype(np.float32)
    mgr.counters = None
    # one decode call (append + attention + sealing) from the same past cache each time: the
    # first claims the open slot in place, the others copy its few tokens (branching) -- so time
    # the kernel separately as well
    step = _median(lambda: mgr.run(cache, q1, k1, v1, 0.125, True), reps)
    with recording() as rec:
        mgr.counters = rec
        mgr.run(cache, q1, k1, v1, 0.125, True)
        mgr.counters = None
    rows, _ = cache.meta.table.rows(KVH)  # the value's block table (raw slot addresses)
    out = np.empty((1, H, D), np.float32)
    kern = _median(lambda: paged_attention(q1, rows, rows.shape[0], ctx - 1, 0.125, True, KVH,
                                           BS, out, int8_query=int8_query), reps)
    return step, kern, rec["bytes_read_kv_attention"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        kernels.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"decode attention, one layer: H={H} KVH={KVH} D={D} block_size={BS}, "
          f"threads={kernels.get_num_threads()}, median of {args.reps}")
    print(f"{'cache':<18}{'context':>8}{'step us':>10}{'kernel us':>11}{'KV bytes/token':>16}"
          f"{'GB/s (kernel)':>15}")
    for ctx in (128, 1024, 4096):
        rows = [("contiguous fp32",) + contiguous(ctx, args.reps, rng),
                ("paged fp32",) + paged("float32", ctx, args.reps, rng),
                ("paged int8",) + paged("int8", ctx, args.reps, rng),
                ("paged int4",) + paged("int4", ctx, args.reps, rng),
                ("paged int8 q8",) + paged("int8", ctx, args.reps, rng, True),
                ("paged int4 q8",) + paged("int4", ctx, args.reps, rng, True)]
        for name, step, kern, nbytes in rows:
            print(f"{name:<18}{ctx:>8}{step * 1e6:>10.1f}{kern * 1e6:>11.1f}{nbytes:>16,}"
                  f"{nbytes / kern / 1e9:>15.2f}")


if __name__ == "__main__":
    main()
