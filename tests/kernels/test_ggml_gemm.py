"""Multi-row ggml kernels (kernels/ggml_gemm.py) used by kernels/ggml_packed.py for M >= ROWS
(int8 mode) / ROWS_F32 (exact mode).

Oracles: the one-row kernel (each activation row in its own call, M = 1: ``_row_i8`` /
``_row_f32`` only) and, int8 mode, the plain numpy model of its arithmetic (tests/reference.py
``linear_ggml_int8``); all bitwise, int8 mode on the AVX2 path (forced) and, on a VNNI host, the
VNNI path. Exact mode is also checked against a float64 product within the stated bound.
"""
import numpy as np
import pytest
import reference as naive_ref  # tests/reference.py
from test_ggml_packed import MINS, random_blocks  # the same random valid blocks

from olv_runtime.kernels import ggml_gemm, ggml_zpanel, packed_i8
from olv_runtime.kernels import ggml_packed as gp

KIND_NAMES = ("Q8_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 13, 64)
N_ODD = 21  # three groups, the last one partial


def _k(name):
    return 3 * 256 if gp.BLOCKS[gp.KINDS[name]][0] == 256 else 5 * 32


def _isas():
    return ["avx2"] + (["avx512vnni"] if packed_i8.HOST_VNNI else [])


@pytest.fixture(params=_isas())
def isa(request):
    packed_i8.set_isa(request.param)
    yield request.param
    packed_i8.set_isa(None)


@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("m", ROW_COUNTS)
def test_rows_bitwise_equal_one_row_kernel_and_reference(name, m, isa):
    kind = gp.KINDS[name]
    k = _k(name)
    blocks = random_blocks(name, N_ODD, k, seed=kind + m)
    packed = gp.prepack_ggml(name, blocks, N_ODD, k)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    x[m // 2, :32] = 0.0  # a block of zeros (d_x = 0)
    y = gp.linear_ggml_i8(x, packed)  # rows in chunks of ROWS, the rest one at a time
    one = np.concatenate([gp.linear_ggml_i8(x[i:i + 1], packed) for i in range(m)])
    ref = naive_ref.linear_ggml_int8(kind, blocks, x)
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32))
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", KIND_NAMES)
def test_parallel_driver_rows_bitwise(name, isa):
    """Above SERIAL_MAX_WORK (the parallel driver, tasks over groups), M not a multiple of
    ROWS."""
    kind = gp.KINDS[name]
    n, m, k = 45, 2 * ggml_gemm.ROWS * 8 + 3, _k(name) * 2
    assert m * n * k >= gp.SERIAL_MAX_WORK
    blocks = random_blocks(name, n, k, seed=kind)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    ws = gp.make_workspace_ggml(m, k, n_tasks=4)
    y = gp.linear_ggml_i8(x, packed, workspace=ws)
    ref = naive_ref.linear_ggml_int8(kind, blocks, x)
    assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("m", ROW_COUNTS)
def test_exact_rows_bitwise_equal_one_row_kernel(name, m, isa):
    """Exact mode (float32 activations, FMA chains): rows in chunks of ROWS_F32 (or float panel
    tiles: 16-lane ones on the ``avx512vnni`` path) give the bits of the one-row kernel, and stay
    within the module's tolerance of a float64 product."""
    kind = gp.KINDS[name]
    k = _k(name)
    blocks = random_blocks(name, N_ODD, k, seed=kind + m)
    packed = gp.prepack_ggml(name, blocks, N_ODD, k)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = gp.linear_ggml_exact(x, packed)
    one = np.concatenate([gp.linear_ggml_exact(x[i:i + 1], packed) for i in range(m)])
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32))
    w = gp.dequantize_rows(name, blocks)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    if name in MINS:  # the bound also counts the mins (d sc q - dmin m, d q + m)
        mag = mag + np.abs(x).astype(np.float64).sum(1, keepdims=True) * MINS[name]
    assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-6), np.abs(y - ref).max()


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0", "Q6_K"])  # avx2: rows_f32, float panel x 2
def test_exact_parallel_driver_rows_bitwise(name, isa):
    n, m, k = 45, 2 * ggml_gemm.ROWS_F32 * 8 + 1, 512
    assert m * n * k >= gp.SERIAL_MAX_WORK
    blocks = random_blocks(name, n, k, seed=5)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(4).standard_normal((m, k)).astype(np.float32)
    y = gp.linear_ggml_exact(x, packed, workspace=gp.make_workspace_ggml(m, k, n_tasks=4))
    one = np.concatenate([gp.linear_ggml_exact(x[i:i + 1], packed) for i in range(m)])
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32))


@pytest.mark.parametrize("exact", [False, True])
def test_row_blocks_bitwise(exact):
    """K long enough that a task's rows run in several L2 blocks (``block_rows``: 32 rows of
    int8 codes, 8 of float32 here), the last one with rows left over."""
    name, n, m, k = "Q8_0", 21, 70, 8192
    rows = ggml_gemm.block_rows.py_func(4 * k if exact else k)
    assert m > rows and m % rows % ggml_gemm.ROWS
    blocks = random_blocks(name, n, k, seed=9)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(9).standard_normal((m, k)).astype(np.float32)
    linear = gp.linear_ggml_exact if exact else gp.linear_ggml_i8
    y = linear(x, packed)
    one = np.concatenate([linear(x[i:i + 1], packed) for i in range(m)])
    assert np.array_equal(y.view(np.uint32), one.view(np.uint32))
    if not exact:
        ref = naive_ref.linear_ggml_int8(gp.KINDS[name], blocks, x)
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


def _panel_case(name, n, m, seed, xseed):
    """Inputs of a float panel call: a prepacked weight [n, K] of ``name`` with K past one panel
    of records, activations [m, K] with their per-32 sums, NaN-filled output, panel and
    accumulator buffers (so a slot written by mistake or read unwritten shows)."""
    kind = gp.KINDS[name]
    k = 3 * 256 if gp.BLOCKS[kind][0] == 256 else 12 * 32  # > 1 panel of records
    assert k * 8 * 4 > ggml_gemm.panel_floats.py_func(kind) * 4
    packed = gp.prepack_ggml(name, random_blocks(name, n, k, seed=seed), n, k)
    x = np.random.default_rng(xseed).standard_normal((m, k)).astype(np.float32)
    xsum = np.zeros((m, k // 32), np.float32)
    gp._act_sums(kind, m, k, np.zeros((1, 1), np.int8), np.zeros((1, 1), np.int32), x, xsum,
                 False)
    out = np.full((m, n), np.nan, np.float32)
    panel = np.full(2 * ggml_gemm.panel_floats(kind), np.nan, np.float32)
    accb = np.full(16 * m, np.nan, np.float32)
    return packed, x, xsum, out, panel, accb, np.zeros((1, 8), np.float32)


@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("ng", [1, 2])
def test_exact_float_panel_bitwise_every_kind(name, ng):
    """The float panel (``panel_f32``: records decoded once into float32, tiles of ROWS_P rows of
    one group or ROWS_P2 rows of two groups, several panels along K) gives the bits of the
    one-row kernel for every kind, also those whose prefill does not take it
    (``use_fpanel``); rows past the last full tile are left to the caller."""
    kind = gp.KINDS[name]
    n, m, ib = 16, 15, 2
    packed, x, xsum, out, panel, accb, facc = _panel_case(name, n, m, kind + ng, ng)
    g = 2 - ng  # groups 1 (alone) or 0 and 1
    end = ggml_gemm.panel_f32(kind, packed.data, g, ng, x, xsum, ib, m, n, out, facc, panel,
                              accb)
    rt = ggml_gemm.ROWS_P2 if ng == 2 else ggml_gemm.ROWS_P
    assert end == ib + (m - ib) // rt * rt
    one = np.concatenate([gp.linear_ggml_exact(x[i:i + 1], packed) for i in range(m)])
    cols = slice(8 * g, 8 * (g + ng))
    assert np.array_equal(out[ib:end, cols].view(np.uint32), one[ib:end, cols].view(np.uint32))
    assert np.isnan(out[:ib]).all() and np.isnan(out[end:]).all()


@pytest.mark.skipif(not packed_i8.HOST_VNNI, reason="the 16-lane tile runs on AVX-512 VNNI hosts")
@pytest.mark.parametrize("name", KIND_NAMES)
def test_exact_zmm_panel_bitwise_every_kind(name):
    """The 16-lane float panel (``panel_f32z``: two groups' records interleaved in one panel,
    tiles of ROWS_Z rows in float32 x 16 vectors, several panels along K; taken on AVX-512 hosts)
    gives the bits of the one-row kernel for every kind, with a partial last group; rows past the
    last full tile are left to the caller (AVX-512 VNNI hosts: elsewhere the tile is never
    called and compiles to nothing)."""
    kind = gp.KINDS[name]
    rt = ggml_zpanel.ROWS_Z
    n, m, ib = 13, 2 * rt + 5, 2
    packed, x, xsum, out, panel, accb, facc = _panel_case(name, n, m, kind + 7, kind)
    end = ggml_zpanel.panel_f32z(kind, packed.data, 0, x, xsum, ib, m, n, out, facc, panel, accb)
    assert end == ib + (m - ib) // rt * rt
    one = np.concatenate([gp.linear_ggml_exact(x[i:i + 1], packed) for i in range(m)])
    assert np.array_equal(out[ib:end].view(np.uint32), one[ib:end].view(np.uint32))
    assert np.isnan(out[:ib]).all() and np.isnan(out[end:]).all()


@pytest.mark.skipif(not packed_i8.HOST_VNNI, reason="the 16-lane path runs on AVX-512 hosts")
@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("m", (1, 7, 13, 20))
def test_exact_zmm_paths_bitwise_equal_avx2_paths(name, m):
    """Exact mode on the ``avx512vnni`` path (every kind on the float panel, pairs of groups in
    ``panel_f32z``'s 16-lane tiles, the rows they leave on the 8-lane tiles and the one-row
    kernel) gives the bits of the ``avx2`` path (``rows_f32`` or the 8-lane float panel by
    kind), with an odd group count and a partial last group."""
    kind = gp.KINDS[name]
    k = _k(name)
    n = 8 * 4 + 5
    blocks = random_blocks(name, n, k, seed=kind + 3 * m)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(m + 1).standard_normal((m, k)).astype(np.float32)
    ys = {}
    for isa in ("avx2", "avx512vnni"):
        packed_i8.set_isa(isa)
        try:
            ys[isa] = gp.linear_ggml_exact(x, packed)
        finally:
            packed_i8.set_isa(None)
    assert np.array_equal(ys["avx2"].view(np.uint32), ys["avx512vnni"].view(np.uint32))
