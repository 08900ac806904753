"""Panel GEMM for ggml prefill (kernels/ggml_panel.py), int8 mode, on each instruction path of
the host: AVX2 (forced, ``set_isa("avx2")``: the ``vpmaddubsw`` tiles) and, on a VNNI host, the
``vpdpbusd`` tiles (``set_isa("avx512vnni")``: the selection the host makes).

Oracles, all bitwise: the one-row kernel (each activation row in its own call: M = 1 runs only
``ggml_packed._row_i8``) and tests/reference.py ``linear_ggml_int8`` (a plain numpy model of the
arithmetic). The panel is called directly (over 1 and 2 task ranges of groups, odd group counts,
a partial last group) and through ``linear_ggml_i8`` (the dispatch from ``MIN_ROWS`` rows, serial
and parallel drivers).
"""
import numpy as np
import pytest
import reference as naive_ref  # tests/reference.py
from test_ggml_packed import random_blocks  # the same random valid blocks

from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels import ggml_panel, packed_i8
from olv_runtime.kernels.packed_i8 import quantize_rows_i8

KIND_NAMES = ("Q8_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
ROW_COUNTS = (1, 4, 5, 8, 13, 64, 130)
N_ROWS = (21, 40)  # 3 groups (the last one partial), 5 groups (odd, full)


def _k(name):
    return 3 * 256 if gp.BLOCKS[gp.KINDS[name]][0] == 256 else 5 * 32


def _isas():
    return ["avx2"] + (["avx512vnni"] if packed_i8.HOST_VNNI else [])


@pytest.fixture(autouse=True, params=_isas())
def isa(request):
    packed_i8.set_isa(request.param)
    yield request.param
    packed_i8.set_isa(None)


def _panel_linear(x, packed, ntasks):
    """``x @ W.T`` by ``panel_groups`` over ``ntasks`` contiguous group ranges (activations
    quantized and Q6_K's per-16 sums made as ``ggml_packed``'s drivers do)."""
    m, k = x.shape
    ws = gp.make_workspace_ggml(m, k, ntasks)
    out = np.full((m, packed.n), np.nan, np.float32)
    quantize_rows_i8(x, m, k, k // 32, ws.xq, ws.xd, ws.xs8)
    gp._act_sums(packed.kind, m, k, ws.xq, ws.xs16, x, ws.xsum, True)
    ng = packed.n_groups
    for t in range(ntasks):
        g0, g1 = t * ng // ntasks, (t + 1) * ng // ntasks
        ggml_panel.panel_groups(packed.kind, packed.data, g0, g1, ws.xq, ws.xd, ws.xs8,
                                ws.xs16, m, packed.n, out, ws.facc[t], packed_i8.use_vnni())
    return out


def _case(name, n, m, seed, k=None):
    kind = gp.KINDS[name]
    k = k or _k(name)
    blocks = random_blocks(name, n, k, seed=seed)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
    x[m // 2, :32] = 0.0  # a block of zeros (d_x = 0)
    return kind, blocks, packed, x


def _bits(a):
    return a.view(np.uint32)


@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("m", ROW_COUNTS)
@pytest.mark.parametrize("n", N_ROWS)
def test_panel_bitwise_equal_one_row_kernel_and_reference(name, m, n):
    kind, blocks, packed, x = _case(name, n, m, seed=gp.KINDS[name] + m + n)
    one = np.concatenate([gp.linear_ggml_i8(x[i:i + 1], packed) for i in range(m)])
    ref = naive_ref.linear_ggml_int8(kind, blocks, x)
    assert np.array_equal(_bits(one), _bits(ref))
    for ntasks in (1, 2):
        y = _panel_linear(x, packed, ntasks)
        assert np.array_equal(_bits(y), _bits(one)), ntasks


@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("ntasks", (1, 2))
def test_dispatch_from_min_rows(name, ntasks):
    """``linear_ggml_i8`` at ``MIN_ROWS`` rows and more (serial driver with 1 task, parallel
    above SERIAL_MAX_WORK with 2): bitwise the reference."""
    for m in sorted({ggml_panel.MIN_ROWS, ggml_panel.MIN_ROWS + 3, ggml_panel.MIN_ROWS_Q4_1,
                     ggml_panel.MIN_ROWS_VNNI, ggml_panel.MIN_ROWS_VNNI_Q8_0 + 1}):
        n = 45
        kind, blocks, packed, x = _case(name, n, m, seed=7 * gp.KINDS[name] + m, k=1024)
        k = x.shape[1]
        assert ntasks == 1 or m * n * k >= gp.SERIAL_MAX_WORK
        ws = gp.make_workspace_ggml(m, k, n_tasks=ntasks)
        y = gp.linear_ggml_i8(x, packed, workspace=ws)
        ref = naive_ref.linear_ggml_int8(kind, blocks, x)
        assert np.array_equal(_bits(y), _bits(ref)), m


def test_long_k_panel_beyond_l1():
    """K = 4864 (Qwen2.5-0.5B's down projection): a panel pair of 78 KB."""
    name, n, m, k = "Q5_0", 24, 7, 4864
    blocks = random_blocks(name, n, k, seed=3)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    ref = naive_ref.linear_ggml_int8(gp.KINDS[name], blocks, x)
    assert np.array_equal(_bits(_panel_linear(x, packed, 2)), _bits(ref))


@pytest.mark.parametrize("name", ("Q5_0", "Q5_1", "Q5_K", "Q6_K"))
def test_row_blocks_bitwise(name):
    """K = 8192: rows in blocks of ``block_rows`` (64 here), the last one with rows left over
    (not a multiple of ROWS); the panel decoded once per (row block, group pair)."""
    n, m, k = 21, 64 + 5, 8192
    assert ggml_panel.block_rows.py_func(k) == 64
    blocks = random_blocks(name, n, k, seed=11)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(11).standard_normal((m, k)).astype(np.float32)
    ref = naive_ref.linear_ggml_int8(gp.KINDS[name], blocks, x)
    assert np.array_equal(_bits(_panel_linear(x, packed, 1)), _bits(ref))
    assert np.array_equal(_bits(gp.linear_ggml_i8(x, packed)), _bits(ref))


def test_use_panel_only_for_kinds_it_decodes(isa):
    """Every ggml_packed kind the panel is chosen for has a SPECS entry. AVX2: Q8_0 stays on
    ggml_gemm, Q4_1 from MIN_ROWS_Q4_1 rows; VNNI: every kind, the k-quants from MIN_ROWS, the
    32-weight kinds from MIN_ROWS_VNNI (Q8_0 MIN_ROWS_VNNI_Q8_0)."""
    vnni = isa == "avx512vnni"
    assert packed_i8.use_vnni() == vnni

    def chosen(m):
        return {k for k in gp.KINDS.values() if ggml_panel.use_panel(k, m, vnni)}
    assert chosen(64) <= set(ggml_panel.SPECS)
    assert not chosen(ggml_panel.MIN_ROWS - 1)
    if vnni:
        assert chosen(ggml_panel.MIN_ROWS_VNNI_Q8_0) == set(gp.KINDS.values())
        assert chosen(ggml_panel.MIN_ROWS_VNNI_Q8_0 - 1) == {3, 6, 7, 12, 13, 14}
        assert chosen(ggml_panel.MIN_ROWS_VNNI - 1) == {12, 13, 14}
        assert chosen(ggml_panel.MIN_ROWS) == {12, 13, 14}
        return
    assert chosen(64) == {3, 6, 7, 12, 13, 14}
    assert chosen(ggml_panel.MIN_ROWS) == {6, 7, 12, 13, 14}
    assert ggml_panel.use_panel(3, ggml_panel.MIN_ROWS_Q4_1, False)
    assert not ggml_panel.use_panel(3, ggml_panel.MIN_ROWS_Q4_1 - 1, False)
