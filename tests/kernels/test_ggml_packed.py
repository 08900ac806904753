"""ggml block kernels (kernels/ggml_packed.py): Q8_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K group
records.

Oracle: gguf-py's ``gguf.quants.dequantize`` (the weights) and a float64 product. Exact mode is
within the module's stated bound; int8 mode equals a plain numpy model of its integer math (the
same activation quantization, exact integer block sums) to float32 rounding, and the VNNI and
AVX2 paths are bitwise equal.
"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import reference as naive_ref  # noqa: E402  (tests/reference.py; `reference` is a function here)
from olv_runtime.errors import InvalidArgument  # noqa: E402
from olv_runtime.kernels import ggml_packed as gp  # noqa: E402
from olv_runtime.kernels import packed_i8  # noqa: E402

QT = gguf.GGMLQuantizationType
TYPES = {"Q8_0": QT.Q8_0, "Q5_0": QT.Q5_0, "Q4_1": QT.Q4_1, "Q5_1": QT.Q5_1, "Q4_K": QT.Q4_K,
         "Q5_K": QT.Q5_K, "Q6_K": QT.Q6_K}
#: types with a minimum (``w = d q + m`` / ``(d sc) q - dmin m``): the bound also counts it
MINS = {"Q4_1": 0.02, "Q5_1": 0.02, "Q4_K": 0.02 * 63, "Q5_K": 0.02 * 63}


def random_blocks(name, n, k, seed):
    """Random valid blocks: random code bytes, finite small float16 scales."""
    rng = np.random.default_rng(seed)
    bs, ts = gp.BLOCKS[gp.KINDS[name]]
    b = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)

    def put_f16(off, lo, hi):
        v = rng.uniform(lo, hi, size=b.shape[:2]).astype(np.float16)
        b[..., off:off + 2] = v.view(np.uint8).reshape(*b.shape[:2], 2)
    if name == "Q6_K":
        put_f16(208, 0.001, 0.01)
    else:
        put_f16(0, 0.001, 0.02)
        if name in ("Q4_K", "Q5_K"):
            put_f16(2, 0.0, 0.02)
        elif name in ("Q4_1", "Q5_1"):
            put_f16(2, -0.02, 0.02)
    return b


def reference(name, blocks, n, k):
    w = gguf.quants.dequantize(blocks.reshape(n, -1), TYPES[name])
    return np.asarray(w, np.float32).reshape(n, k)


def int8_model(name, blocks, x, n, k):
    """numpy model of linear_ggml_i8: xq per 32-block, exact integer sums, float32 per block
    (tests/reference.py ``linear_int8_float64``: the integer math is exact; the float
    combination differs from this float64 sum only by float32 rounding of a few products per
    block)."""
    return naive_ref.linear_int8_float64(x, reference(name, blocks, n, k))


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("n", [8, 21])
def test_repack_equals_the_numpy_layout_definition(name, n):
    """The compiled one-pass repack writes exactly the records of the numpy formulation (random
    bytes in every field, rows padded to a group of 8 with zero blocks)."""
    kind = gp.KINDS[name]
    bs, ts = gp.BLOCKS[kind]
    nb = 3
    rng = np.random.default_rng(n + kind)
    blocks = rng.integers(0, 256, (n, nb, ts), dtype=np.uint8)
    packed = gp.prepack_ggml(name, blocks.reshape(-1), n, nb * bs)
    ng = -(-n // 8)
    full = np.zeros((ng * 8, nb, ts), np.uint8)
    full[:n] = blocks
    want = naive_ref.ggml_records(kind, full.reshape(ng, 8, nb, ts))
    assert packed.data.shape == want.shape
    assert np.array_equal(packed.data, want)


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("n,m", [(24, 1), (13, 3)])
def test_exact_and_int8(name, n, m):
    bs = gp.BLOCKS[gp.KINDS[name]][0]
    k = 2 * bs if bs == 256 else 96
    blocks = random_blocks(name, n, k, seed=n + m)
    w = reference(name, blocks, n, k)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = gp.prepack_ggml(name, blocks.reshape(-1), n, k)
    assert packed.nbytes == -(-n // 8) * 8 * blocks.shape[1] * blocks.shape[2]
    # exact mode within the stated bound
    y = gp.linear_ggml_exact(x, packed)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    if name in MINS:  # the bound also counts the mins (d sc q - dmin m, d q + m)
        mag = mag + np.abs(x).astype(np.float64).sum(1, keepdims=True) * MINS[name]
    assert np.all(np.abs(y - ref) <= 1e-5 * mag + 1e-6), np.abs(y - ref).max()
    # int8 mode: model of its integer math, and VNNI == AVX2 bitwise
    ws = gp.make_workspace_ggml(m, k)
    packed_i8.set_isa("avx2")
    try:
        y2 = gp.linear_ggml_i8(x, packed, workspace=ws)
    finally:
        packed_i8.set_isa(None)
    model = int8_model(name, blocks, x, n, k)
    assert np.allclose(y2, model, rtol=1e-4, atol=1e-4 * np.abs(model).max()), \
        np.abs(y2 - model).max()
    if packed_i8.HOST_VNNI:
        packed_i8.set_isa("avx512vnni")
        try:
            y1 = gp.linear_ggml_i8(x, packed, workspace=ws)
        finally:
            packed_i8.set_isa(None)
        assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))
    # int8 quantization error against the exact product stays small
    assert np.abs(y2 - ref).max() <= 0.02 * np.abs(ref).max() + 1e-3


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequantize_rows_bitwise(name):
    bs = gp.BLOCKS[gp.KINDS[name]][0]
    k = 512 if bs == 256 else 64
    blocks = random_blocks(name, 5, k, seed=3)
    got = gp.dequantize_rows(name, blocks)
    assert np.array_equal(got.view(np.uint32), reference(name, blocks, 5, k).view(np.uint32))


def test_parallel_driver_matches_serial():
    name, n, k = "Q5_0", 512, 1024  # above SERIAL_MAX_WORK: the parallel driver
    blocks = random_blocks(name, n, k, seed=11)
    packed = gp.prepack_ggml(name, blocks, n, k)
    x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
    y = gp.linear_ggml_i8(x, packed)
    ys = np.concatenate([gp.linear_ggml_i8(x, gp.prepack_ggml(name, blocks[r:r + 64], 64, k))
                         for r in range(0, n, 64)], axis=1)  # small calls: serial driver
    assert np.array_equal(y, ys)


def test_bad_arguments():
    with pytest.raises(InvalidArgument, match="kind"):
        gp.prepack_ggml("Q3_K", np.zeros(10, np.uint8), 1, 256)
    with pytest.raises(InvalidArgument, match="multiple of the block size 256"):
        gp.prepack_ggml("Q4_K", np.zeros(144, np.uint8), 1, 100)
    with pytest.raises(InvalidArgument, match="expected 144 bytes"):
        gp.prepack_ggml("Q4_K", np.zeros(143, np.uint8), 1, 256)


def test_q4_0_to_int4_is_the_same_weight():
    """Q4_0 -> signed INT4 block-32 codes + float16 d: d * q equals gguf's dequantize bitwise."""
    rng = np.random.default_rng(5)
    n, nb = 5, 3
    blocks = rng.integers(0, 256, (n, nb, 18), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, nb, 2)
    codes, scales = gp.q4_0_to_int4(blocks)
    assert codes.shape == (n * nb * 16,) and scales.dtype == np.float16
    assert np.array_equal(scales.view(np.uint16), d.view(np.uint16))
    q = naive_ref.unpack_codes(codes, 4, True, n * nb * 32).reshape(n, nb, 32)
    w = (scales.astype(np.float32)[..., None] * q.astype(np.float32)).reshape(n, -1)
    ref = np.asarray(gguf.quants.dequantize(blocks.reshape(n, -1), QT.Q4_0), np.float32)
    assert np.array_equal(w.view(np.uint32), ref.view(np.uint32))
    with pytest.raises(InvalidArgument, match="18 bytes"):
        gp.q4_0_to_int4(np.zeros((1, 1, 20), np.uint8))
