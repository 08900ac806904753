"""Kernel benchmarks (pytest-benchmark) at the exact shapes of the Qwen2.5-0.5B-shaped model.

    pytest bench/bench_kernels.py                       # everything (~5 min on 2 cores)
    pytest bench/bench_kernels.py -k "linear and M1"    # the decode GEMVs only
    OLV_BENCH_THREADS=1 pytest bench/bench_kernels.py --benchmark-json out.json

Not run by the test command (pytest's ``testpaths`` is ``tests/``). Threads: ``OLV_BENCH_THREADS``
(default 2). Every benchmark puts its figure into ``extra_info`` beside the measured streaming-read
bandwidth (numba parallel sum over ``OLV_BENCH_STREAM_BYTES``, default 1 GiB, best of 5, same
threads), computed from the *minimum* time (the cleanest figure on a shared machine) and from
the median:

* INT4 linear -- the kernels the session runs: ``linear_packed_i8_exact`` (exact mode, float
  activations: the VNNI block fixed-point kernel where the CPU has VNNI; ``exact_float`` forces
  its float fallback, for the side-by-side ratio) and ``linear_packed_i8`` (quantized mode, int8
  activation blocks) on
  ``prepack_int4_i8`` weights (float16 block scales, the converter default) -- for q 896x896,
  k/v 128x896, o 896x896, the merged q/k/v 1152x896, gate/up 4864x896 and merged 9728x896, down
  896x4864, lm_head 151936x896 at M = 1, 4, 32, 128, and the layer shapes at M = 512 (prefill;
  M >= 8 runs the register-blocked VNNI tile GEMM in quantized mode where the CPU has VNNI):
  ``weight_GBps`` = packed weight bytes / time (and ``pct_of_stream``), ``GFLOPs`` = 2*M*N*K /
  time. For M <= 4 the call cycles through enough copies of the packed weight (>= the stream
  size, above the L3 cache the CPU reports) that every call reads its weight from DRAM, as in
  decode; for M >= 32 (compute-bound) one copy is reused.
* decode attention (``attention``: 14 query heads, 2 KV heads, D 64, one new query) at contexts
  128 / 1024 / 4096: ``kv_GBps`` (K+V bytes read / time) and ``GFLOPs`` (4*H*T*D / time).
* RMSNorm (``rms_norm``, [M, 896]) and RoPE (``rotary_embedding``, [1, M, 14, 64]) at M = 1 and
  128: ``GBps`` (bytes read + written / time).

``other_load_pct`` is the CPU other processes used while the test ran: with 2 threads on 2 cores
a busy neighbour stalls each parallel region by a scheduler time slice (ms), so a test with a
high figure there must be re-run on a quiet machine. The summary table is printed at the end of
the session, before pytest-benchmark's own timing table.
"""
from __future__ import annotations

import functools
import os
import pathlib
import time

import numba
import numpy as np

from _bandwidth import above_bound, stream_bandwidth, stream_sum
import pytest
from numba import njit, prange

from olv_runtime import kernels
from olv_runtime.kernels.packed_f32 import linear_packed_i8_exact, make_workspace_f32
from olv_runtime.kernels.packed_i8 import (PackedInt4I8, linear_packed_i8, make_workspace_i8,
                                           prepack_int4_i8, set_isa)

THREADS = int(os.environ.get("OLV_BENCH_THREADS", "2"))
STREAM_BYTES = int(os.environ.get("OLV_BENCH_STREAM_BYTES", str(1 << 30)))

SHAPES = [  # name, N, K
    ("q", 896, 896), ("kv", 128, 896), ("o", 896, 896), ("qkv", 1152, 896),
    ("gate_up", 4864, 896), ("gate_up_merged", 9728, 896), ("down", 896, 4864),
    ("lm_head", 151936, 896),
]
MS = [1, 4, 32, 128]
H, KVH, D = 14, 2, 64


def _l3_bytes() -> int:
    try:
        txt = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1], 1)
        return int(txt.rstrip("KMG")) * mult
    except (OSError, ValueError):
        return 0


_stream_sum = stream_sum  # bench/_bandwidth.py


class _Summary:
    """Prints every benchmark's extra_info figures (before pytest-benchmark's own table)."""

    def __init__(self):
        self.rows = []

    def write(self, tr):
        if not self.rows or tr is None:
            return
        tr.write_line("")
        tr.section(f"olv kernel figures ({THREADS} threads; from the min time, median in brackets)")
        stream = self.rows[0][1].get("stream_GBps")
        tr.write_line(f"streaming read: {stream} GB/s (fastest of the read kernels of "
                      f"bench/_bandwidth.py over {STREAM_BYTES / 2**30:.2f} GiB, best of 5)")
        for name, info in self.rows:
            parts = []
            for key in ("weight_GBps", "kv_GBps", "GBps"):
                if key in info:
                    flag = ""
                    if above_bound(info[key], info["stream_GBps"]):
                        flag = (" ABOVE the DRAM streaming bound (data cache-resident)"
                                if info.get("cache_resident") else
                                " ABOVE the streaming bound: check the measurement")
                    parts.append(f"{info[key]:8.2f} GB/s ({info[key + '_median']:.2f}) "
                                 f"{info['pct_of_stream']:5.1f} % of stream{flag}")
            parts.append(f"{info['GFLOPs']:8.2f} GFLOP/s ({info['GFLOPs_median']:.2f})")
            if "other_load_pct" in info:
                parts.append(f"other load {info['other_load_pct']:.0f} %")
            tr.write_line(f"{name:<52s} " + "   ".join(parts))


_SUMMARY = _Summary()


@pytest.fixture(scope="session", autouse=True)
def threads(request):
    kernels.set_num_threads(THREADS)
    yield THREADS
    # printed at session teardown (before pytest-benchmark's timing table)
    pm = request.config.pluginmanager
    capman = pm.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled():
        _SUMMARY.write(pm.get_plugin("terminalreporter"))


@pytest.fixture(scope="session")
def stream_gbps(threads):
    """Streaming-read bandwidth (GB/s) with the benchmark's thread count: the fastest read
    kernel of bench/_bandwidth.py (vectorised float32 / uint32 sums, numpy.sum), best of 5."""
    return stream_bandwidth(STREAM_BYTES, 5, numba.get_num_threads())[0]


def _busy_jiffies():
    try:
        f = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return f[0] + f[1] + f[2] + f[5] + f[6]  # user nice system irq softirq


@pytest.fixture(autouse=True)
def _other_load(request):
    """extra_info["other_load_pct"]: CPU other processes used during the test (% of all cores).

    With 2 threads on 2 cores, any other busy process stalls every parallel region for a
    scheduler time slice: figures taken while this is high are not comparable."""
    if "benchmark" not in request.fixturenames:
        yield
        return
    bench = request.getfixturevalue("benchmark")
    j0, p0, t0 = _busy_jiffies(), time.process_time(), time.perf_counter()
    yield
    j1, p1, wall = _busy_jiffies(), time.process_time(), time.perf_counter() - t0
    if j0 is not None and j1 is not None and wall > 0:
        other = (j1 - j0) / os.sysconf("SC_CLK_TCK") - (p1 - p0)
        bench.extra_info["other_load_pct"] = round(max(0.0, 100 * other / (wall * (os.cpu_count() or 1))), 1)


def _times(benchmark):
    st = benchmark.stats.stats
    return st.min, st.median


def _report(benchmark, stream, nbytes=None, flops=None, key="GBps"):
    tmin, tmed = _times(benchmark)
    info = benchmark.extra_info
    _SUMMARY.rows.append((benchmark.name, info))
    info["stream_GBps"] = round(stream, 2)
    info["threads"] = THREADS
    if nbytes is not None:
        info[key] = round(nbytes / tmin / 1e9, 2)
        info[key + "_median"] = round(nbytes / tmed / 1e9, 2)
        info["pct_of_stream"] = round(100 * nbytes / tmin / 1e9 / stream, 1)
    if flops is not None:
        info["GFLOPs"] = round(flops / tmin / 1e9, 2)
        info["GFLOPs_median"] = round(flops / tmed / 1e9, 2)


def _rounds(seconds_per_call: float, budget: float = 2.0, lo: int = 3, hi: int = 200) -> int:
    return int(max(lo, min(hi, budget / max(seconds_per_call, 1e-6))))


# ------------------------------------------------------------------------------------------------
# INT4 linear
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _weights(n, k, cycled):
    """A packed random weight (float16 block scales) and, if ``cycled``, views of enough copies
    to exceed the L3 cache."""
    rng = np.random.default_rng(n * 7 + k)
    kb = k // 32
    payload = rng.integers(0, 256, size=n * k // 2, dtype=np.uint8)
    scale = (rng.random((n, kb), dtype=np.float32) * 0.02 + 1e-3).astype(np.float16)
    pk = prepack_int4_i8(payload, scale, None, n, k, 32)
    if not cycled:
        return [pk]
    target = max(STREAM_BYTES, 2 * _l3_bytes())
    ncopy = max(2, -(-target // pk.nbytes))
    codes = np.empty((ncopy,) + pk.codes.shape, pk.codes.dtype)
    codes[:] = pk.codes
    scales = np.empty((ncopy,) + pk.scale.shape, pk.scale.dtype)
    scales[:] = pk.scale
    return [PackedInt4I8(codes[i], scales[i], n, k) for i in range(ncopy)]


# prefill shapes: M = 512 as well (not the lm_head: a prefill computes its last row only)
LINEAR_CASES = ([(name, n, k, m) for name, n, k in SHAPES for m in MS]
                + [(name, n, k, 512) for name, n, k in SHAPES if name != "lm_head"])


@pytest.mark.parametrize("mode", ["exact", "exact_float", "quant"])
@pytest.mark.parametrize("name,n,k,m", LINEAR_CASES,
                         ids=[f"{nm}_{n}x{k}-M{m}" for nm, n, k, m in LINEAR_CASES])
def test_linear_int4(benchmark, stream_gbps, name, n, k, m, mode):
    cycled = m <= 4
    pks = _weights(n, k, cycled)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    out = np.empty((m, n), np.float32)
    qa = mode == "quant"
    ws = make_workspace_i8(m, k) if qa else make_workspace_f32(m, k)
    fn = linear_packed_i8 if qa else linear_packed_i8_exact
    i = [0]

    def call():
        p = pks[i[0] % len(pks)]
        i[0] += 1
        fn(x, p, out, workspace=ws)

    set_isa("avx2" if mode == "exact_float" else None)  # exact_float: the float fallback
    try:
        call()
        t0 = time.perf_counter()
        call()
        rounds = _rounds(time.perf_counter() - t0)
        benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)
    finally:
        set_isa(None)
    benchmark.extra_info.update(shape=f"{n}x{k}", M=m, mode=mode, packed_bytes=pks[0].nbytes,
                                copies_cycled=len(pks), cache_resident=not cycled)
    _report(benchmark, stream_gbps, nbytes=pks[0].nbytes, flops=2 * m * n * k, key="weight_GBps")


# ------------------------------------------------------------------------------------------------
# decode attention, RMSNorm, RoPE
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx", [128, 1024, 4096])
def test_attention_decode(benchmark, stream_gbps, ctx):
    rng = np.random.default_rng(ctx)
    q = rng.standard_normal((1, 1, H, D)).astype(np.float32)
    kc = rng.standard_normal((1, KVH, ctx, D)).astype(np.float32)
    vc = rng.standard_normal((1, KVH, ctx, D)).astype(np.float32)
    out = np.empty_like(q)
    benchmark(kernels.attention, q, kc, vc, ctx - 1, 1.0 / np.sqrt(D), True, out)
    benchmark.extra_info.update(context=ctx, heads=H, kv_heads=KVH, head_dim=D,
                                cache_resident=True)
    _report(benchmark, stream_gbps, nbytes=kc.nbytes + vc.nbytes, flops=4 * H * ctx * D,
            key="kv_GBps")


@pytest.mark.parametrize("m", [1, 128])
def test_rms_norm(benchmark, stream_gbps, m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 896)).astype(np.float32)
    w = rng.standard_normal(896).astype(np.float32)
    out = np.empty_like(x)
    benchmark(kernels.rms_norm, x, w, 1e-6, out)
    benchmark.extra_info.update(shape=f"{m}x896", cache_resident=True)
    _report(benchmark, stream_gbps, nbytes=2 * x.nbytes + w.nbytes, flops=4 * x.size)


@pytest.mark.parametrize("m", [1, 128])
def test_rotary_embedding(benchmark, stream_gbps, m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((1, m, H, D)).astype(np.float32)
    ang = rng.random((1, m, D // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.empty_like(x)
    benchmark(kernels.rotary_embedding, x, cos, sin, False, D, out)
    benchmark.extra_info.update(shape=f"1x{m}x{H}x{D}", cache_resident=True)
    _report(benchmark, stream_gbps, nbytes=2 * x.nbytes + cos.nbytes + sin.nbytes,
            flops=3 * x.size)
