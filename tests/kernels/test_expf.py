"""The compiled kernels' float32 exp (kernels/activations.py ``expf``): bitwise libm's ``expf``
(what ``np.exp`` on a float32 scalar calls inside numba code, and what the compiled steps
called before), and the SiLU chunk built on it bitwise the scalar loop it replaced.
bench/expf_check.py compares all 2^32 inputs; here a sample and every edge. ``expf`` follows
glibc's FMA build, the one x86-64 CPUs with FMA run; on a CPU without FMA glibc runs another
build (last-bit differences possible), so the libm comparisons are skipped there."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from olv_runtime.kernels.activations import expf, silu_mul, silu_mul_chunk
from olv_runtime.kernels.config import JIT


def _host_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(ln.startswith("flags") and " fma" in ln for ln in f)
    except OSError:
        return False


needs_fma = pytest.mark.skipif(not _host_has_fma(), reason="libm runs its non-FMA expf here")


@njit(**JIT)
def _both(x, ours, ref):
    for i in range(x.shape[0]):
        ours[i] = expf(x[i])
        ref[i] = np.exp(x[i])


@njit(**JIT)
def _silu_libm(g, u, out):
    one = np.float32(1.0)
    for j in range(g.shape[0]):
        gv = g[j]
        out[j] = (gv * (one / (np.exp(-gv) + one))) * u[j]


def _edges():
    f = np.float32
    pts = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 88.0, -88.0, 104.0, -104.0,
           float.fromhex("0x1.62e42ep6"), -float.fromhex("0x1.9fe368p6"), -87.33654, 1e-30,
           -1e-30, 3.4e38, -3.4e38, 1e-45, -1e-45]
    x = np.array(pts, f)
    near = np.concatenate([np.nextafter(x, f(np.inf)), np.nextafter(x, f(-np.inf))])
    # the results that are subnormal, and the overflow / underflow boundaries, densely
    bits = np.concatenate([
        np.arange(0xC2AE0000, 0xC2D00000, 97, dtype=np.uint32),   # -87 .. -104
        np.arange(0x42B00000, 0x42B20000, 13, dtype=np.uint32),   # 88 .. 89
        np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFF800001, 0x7FFFFFFF],
                 np.uint32),  # quiet and signalling NaNs
    ])
    return np.concatenate([x, near, bits.view(np.float32)]).astype(f)


@needs_fma
@pytest.mark.parametrize("case", ["random bits", "edges", "activations"])
def test_expf_bitwise_libm(case):
    rng = np.random.default_rng(7)
    if case == "random bits":
        x = rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    elif case == "edges":
        x = _edges()
    else:
        x = (rng.standard_normal(2_000_000) * 8).astype(np.float32)
    ours, ref = np.empty_like(x), np.empty_like(x)
    _both(x, ours, ref)
    # bits, NaNs included (a signalling NaN comes back quiet with its payload)
    bad = np.nonzero(ours.view(np.uint32) != ref.view(np.uint32))[0]
    assert bad.size == 0, f"{bad.size} differ, first x bits = {x.view(np.uint32)[bad[:5]]!r}"


@needs_fma
@pytest.mark.parametrize("n", [1, 7, 64, 4864, 100_003])
def test_silu_mul_chunk_bitwise_scalar_loop(n):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    g[:4] = [-100.0, 100.0, 0.0, -0.0][:min(4, n)]  # exp overflow to inf, signed zeros
    ref = np.empty_like(g)
    _silu_libm(g, u, ref)
    out = np.empty_like(g)
    silu_mul_chunk(g, u, out)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(silu_mul(g, u).view(np.uint32), ref.view(np.uint32))
    silu_mul_chunk(g, u, g)  # out may be g
    assert np.array_equal(g.view(np.uint32), ref.view(np.uint32))
