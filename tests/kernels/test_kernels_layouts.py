"""kernels.layouts: one description of the 8-row group layout, zero points an optional field."""
from __future__ import annotations

import numpy as np
import pytest

import reference
from olv_runtime.kernels.layouts import LAYOUTS, layout_named, layout_of
from olv_runtime.kernels.packed_i8 import PackedInt4I8, prepack_int4_i8
from olv_runtime.kernels.packed_zp import PackedInt4I8Zp, prepack_int4_i8_zp


def test_zero_point_form_is_the_same_description_plus_zp():
    base, zp = LAYOUTS["olv.PackedInt4I8"], LAYOUTS["olv.PackedInt4I8Zp"]
    assert (base.cls, zp.cls) == (PackedInt4I8, PackedInt4I8Zp)
    assert base.zero_point == zp.zero_point == "zp"
    assert not base.has_zero_point and zp.has_zero_point
    assert zp.arrays == base.arrays + ("zp",) == ("codes", "scale", "zp")
    assert (zp.ints, zp.rows_per_group, zp.array_shapes) == (base.ints, base.rows_per_group,
                                                             base.array_shapes)
    for sdt, want in ((np.float32, np.float32), (np.float16, np.uint16)):
        s = base.shapes(13, 100, False, sdt)
        assert s == {"codes": (np.uint8, (2, 4, 128)), "scale": (want, (2, 4, 8))}
        assert zp.shapes(13, 100, True, sdt) == {**s, "zp": (np.uint8, (2, 4, 8))}
    with pytest.raises(ValueError, match="no zero-point form"):
        zp.with_zero_point("olv.Again", PackedInt4I8Zp)
    assert layout_named("olv.PackedInt4") is None  # the removed tiled layout
    assert list(LAYOUTS) == ["olv.PackedInt4I8", "olv.PackedInt4I8Zp"]


@pytest.mark.parametrize("with_zp", [False, True])
def test_parts_build_and_concat_round_trip(with_zp):
    rng = np.random.default_rng(4)
    n, k = 16, 64
    q = rng.integers(-8, 8, size=(n, k))
    payload, scale, z = reference.int4_weight(q, rng, zero_point=with_zp)
    p = (prepack_int4_i8_zp(payload, scale, z, n, k, 32) if with_zp
         else prepack_int4_i8(payload, scale, None, n, k, 32))
    lay = layout_of(p)
    assert lay is LAYOUTS["olv.PackedInt4I8Zp" if with_zp else "olv.PackedInt4I8"]
    arrays, ints = lay.parts(p)
    assert list(arrays) == list(lay.arrays) and ints == {"n": n, "k": k}
    for name, (dt, shape) in lay.shapes(n, k, with_zp, scale.dtype).items():
        assert arrays[name].dtype == dt and arrays[name].shape == shape
    back = lay.build(arrays, ints)
    assert type(back) is type(p)
    both = lay.concat_rows([p, back])
    assert (both.n, both.k) == (2 * n, k)
    for name in lay.arrays:
        np.testing.assert_array_equal(getattr(both, name),
                                      np.concatenate([arrays[name], arrays[name]]))
