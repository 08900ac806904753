"""kernels.dispatch: every supported (isa, mode, format) gives a kernel that runs and matches
the kernel module it names; unsupported combinations raise InvalidArgument naming them."""
from __future__ import annotations

import numpy as np
import pytest

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import ggml_packed, packed_f32, packed_i8, packed_i8_gemm, packed_zp
from olv_runtime.kernels.dispatch import (
    ISAS,
    LinearKernel,
    LinearMode,
    WeightFormat,
    dispatch,
    supported,
)

# (mode, format) -> (kernel function, workspace factory): what each entry must be
EXPECTED = {
    (LinearMode.INT8, WeightFormat.INT4): (packed_i8_gemm.linear_packed_i8,
                                           packed_i8.make_workspace_i8),
    (LinearMode.EXACT, WeightFormat.INT4): (packed_f32.linear_packed_i8_exact,
                                            packed_f32.make_workspace_f32),
    (LinearMode.INT8, WeightFormat.INT4_ZP): (packed_zp.linear_packed_i8_zp,
                                              packed_i8.make_workspace_i8),
    (LinearMode.EXACT, WeightFormat.INT4_ZP): (packed_zp.linear_packed_i8_exact_zp,
                                               packed_f32.make_workspace_f32),
    (LinearMode.GGML_INT8, WeightFormat.GGML): (ggml_packed.linear_ggml_i8,
                                                ggml_packed.make_workspace_ggml),
    (LinearMode.GGML_EXACT, WeightFormat.GGML): (ggml_packed.linear_ggml_exact,
                                                 ggml_packed.make_workspace_ggml),
}


def test_supported_is_every_isa_times_every_entry():
    assert sorted(supported(), key=repr) == sorted(
        [(isa, m, f) for isa in ("avx2", "avx512vnni") for (m, f) in EXPECTED], key=repr)
    assert ISAS == ("avx2", "avx512vnni")
    assert packed_i8.isa() in ISAS


def _weight(fmt, rng, n, k):
    if fmt is WeightFormat.GGML:
        blocks = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
        blocks[..., :2] = np.frombuffer(np.full(n * k // 32, 0.01, np.float16).tobytes(),
                                        np.uint8).reshape(n, k // 32, 2)
        return ggml_packed.prepack_ggml("Q8_0", blocks, n, k)
    payload = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
    if fmt is WeightFormat.INT4:
        return packed_i8.prepack_int4_i8(payload, scale, None, n, k, 32)
    zp = rng.integers(-8, 8, (n, k // 32), dtype=np.int8)
    return packed_zp.prepack_int4_i8_zp(payload, scale, zp, n, k, 32)


@pytest.mark.parametrize("isa, mode, fmt", supported(), ids=lambda v: getattr(v, "name", v))
def test_every_supported_combination_returns_its_kernel(isa, mode, fmt):
    entry = dispatch(isa, mode, fmt)
    assert isinstance(entry, LinearKernel)
    fn, make_ws = EXPECTED[(mode, fmt)]
    assert entry.fn is fn and entry.make_workspace is make_ws
    # the kernel runs on a weight of its format with a workspace of its factory
    rng = np.random.default_rng(3)
    n, k, m = 16, 64, 2
    w = _weight(fmt, rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    assert entry.fn(x, w, out, workspace=entry.make_workspace(m, k)) is out
    np.testing.assert_array_equal(out, fn(x, w))
    assert np.isfinite(out).all()
    name = entry.name.format(kind=getattr(w, "type_name", ""))
    assert name == {
        (LinearMode.INT8, WeightFormat.INT4): "packed_i8",
        (LinearMode.EXACT, WeightFormat.INT4): "packed_i8_exact",
        (LinearMode.INT8, WeightFormat.INT4_ZP): "packed_i8_zp",
        (LinearMode.EXACT, WeightFormat.INT4_ZP): "packed_i8_exact_zp",
        (LinearMode.GGML_INT8, WeightFormat.GGML): "ggml_Q8_0_i8",
        (LinearMode.GGML_EXACT, WeightFormat.GGML): "ggml_Q8_0_exact",
    }[(mode, fmt)]


UNSUPPORTED = [(m, f) for m in LinearMode for f in WeightFormat if (m, f) not in EXPECTED]


@pytest.mark.parametrize("mode, fmt", UNSUPPORTED, ids=lambda v: v.name)
def test_unsupported_combination_raises(mode, fmt):
    with pytest.raises(InvalidArgument, match=f"no linear kernel for mode {mode.name} on "
                                              f"{fmt.name} weights.*supported"):
        dispatch("avx2", mode, fmt)


def test_bad_arguments_raise():
    with pytest.raises(InvalidArgument, match="isa: expected one of"):
        dispatch("sse2", LinearMode.INT8, WeightFormat.INT4)
    with pytest.raises(InvalidArgument, match="mode: expected a LinearMode, got 'int8'"):
        dispatch("avx2", "int8", WeightFormat.INT4)
    with pytest.raises(InvalidArgument, match="fmt: expected a WeightFormat"):
        dispatch("avx2", LinearMode.INT8, "int4")


def test_modes():
    assert [m.packed for m in LinearMode] == [False, True, True, True, True]
    assert {m for m in LinearMode if m.quantized} == {LinearMode.INT8, LinearMode.GGML_INT8}
