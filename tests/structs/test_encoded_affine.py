"""Built-in affine layout: decoding equals onnx.reference DequantizeLinear exactly, and every
affine rule of seed 000 has a negative test (AffineLayoutError)."""
from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
from onnx import helper as oh
from onnx.reference import ReferenceEvaluator

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.errors import AffineLayoutError, EncodingError, PayloadError
from olv_runtime.proto.helper import make_affine_encoded, make_tensor, make_tensor_type
from olv_runtime.io import Model
from olv_runtime.structs.quantize import pack_codes
from olv_runtime.decoding import resolve

T = pb.TensorProto
STORAGE = {  # type -> (bits, lo, hi)
    T.INT8: (8, -128, 127), T.UINT8: (8, 0, 255), T.INT4: (4, -8, 7), T.UINT4: (4, 0, 15),
    T.INT2: (2, -2, 1), T.UINT2: (2, 0, 3),
}
SHAPES = [(3, 5), (5, 3, 7)]  # odd element counts: 15 and 105
MODES = [("tensor", None, None), ("axis", 0, None), ("axis", 1, None), ("axis", -1, None),
         ("block", 1, "divides"), ("block", 1, "partial"), ("block", -1, "partial")]
ZERO_POINTS = ["none", "random", "extreme"]


def _block(shape, axis, kind):
    d = shape[axis]
    return d if kind == "divides" else 2  # 2 divides neither 3, 5 nor 7


def _params(rng, shape, mode, axis, kind, lo, hi, zp_kind):
    if mode == "tensor":
        pshape, block = (), None
    elif mode == "axis":
        pshape, block = (shape[axis],), None
    else:
        block = _block(shape, axis, kind)
        p = list(shape)
        p[axis] = -(-shape[axis] // block)
        pshape = tuple(p)
    scale = (rng.standard_normal(pshape) * 0.1).astype(np.float32)
    if zp_kind == "none":
        zp = None
    elif zp_kind == "random":
        zp = rng.integers(lo, hi + 1, size=pshape)
    else:  # extreme zero points, negative where the type allows
        zp = np.where(rng.integers(0, 2, size=pshape) == 1, lo, hi)
    return scale, zp, block


def _reference(codes, st, scale, zp, axis, block):
    x = oh.make_tensor("x", st, codes.shape, codes.reshape(-1).tolist())
    inits = [x, oh.make_tensor("s", onnx.helper.np_dtype_to_tensor_dtype(scale.dtype),
                               scale.shape, scale.reshape(-1).tolist())]
    inputs = ["x", "s"]
    if zp is not None:
        inits.append(oh.make_tensor("z", st, zp.shape, np.asarray(zp).reshape(-1).tolist()))
        inputs.append("z")
    attrs = {}
    if axis is not None:
        attrs["axis"] = axis
    if block is not None:
        attrs["block_size"] = block
    node = oh.make_node("DequantizeLinear", inputs, ["y"], **attrs)
    g = oh.make_graph([node], "g", [], [oh.make_tensor_value_info("y", 0, None)], inits)
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 25)])
    return ReferenceEvaluator(m).run(None, {})[0]


def _model(ev, with_decode=False):
    m = pb.ModelProto(ir_version=10)
    m.opset_import.add(domain="", version=23)
    m.opset_import.add(domain="olv", version=1)
    m.graph.encoded_initializer.append(ev)
    if with_decode:
        from olv_runtime.proto.helper import make_node, make_tensor_value_info

        m.graph.node.append(make_node("Decode", [ev.name], ["y"], domain="olv"))
        m.graph.output.append(make_tensor_value_info("y", T.FLOAT, None))
    return Model(m)


@pytest.mark.parametrize("zp_kind", ZERO_POINTS)
@pytest.mark.parametrize("mode,axis,kind", MODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("st", list(STORAGE), ids=lambda t: T.DataType.Name(t))
def test_affine_equals_onnx_reference(st, shape, mode, axis, kind, zp_kind):
    bits, lo, hi = STORAGE[st]
    rng = np.random.default_rng(zlib.crc32(repr((st, shape, mode, axis, kind, zp_kind)).encode()))
    codes = rng.integers(lo, hi + 1, size=shape)
    codes.reshape(-1)[:2] = [lo, hi]
    scale, zp, block = _params(rng, shape, mode, axis, kind, lo, hi, zp_kind)
    ev = make_affine_encoded("w", pack_codes(codes, bits).tobytes(), st, shape, scale, zp,
                             axis=None if mode == "tensor" else axis, block_size=block)
    want = _reference(codes, st, scale, zp, None if mode == "tensor" else axis, block)
    got = olv_runtime.decode_value(_model(ev), "w")
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_affine_float16_and_double_scales_give_exactly_their_type(dtype):
    rng = np.random.default_rng(7)
    codes = rng.integers(-8, 8, size=(3, 7))
    scale = (rng.standard_normal((3, 4)) * 0.1).astype(dtype)
    zp = rng.integers(-8, 8, size=(3, 4))
    ev = make_affine_encoded("w", pack_codes(codes, 4).tobytes(), T.INT4, (3, 7), scale, zp,
                             axis=1, block_size=2)
    et = T.FLOAT16 if dtype == np.float16 else T.DOUBLE
    ev.logical_type.tensor_type.elem_type = et
    got = olv_runtime.decode_value(_model(ev), "w")
    want = _reference(codes, T.INT4, scale, zp, 1, 2)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)


def test_affine_decode_in_a_graph_counts_bytes():
    codes = np.arange(-8, 7).reshape(3, 5)
    ev = make_affine_encoded("w", pack_codes(codes, 4).tobytes(), T.INT4, (3, 5),
                             np.float32(0.5), None)
    sess = olv_runtime.InferenceSession(_model(ev, with_decode=True))
    (y,) = sess.run(None, {})
    np.testing.assert_array_equal(y, codes * np.float32(0.5))
    assert sess.counters["bytes_dequantized"] == 60


# -- negative cases: one per rule --------------------------------------------------------------
def _good(**kw):
    args = dict(name="w", codes_payload=pack_codes(np.zeros(15, int), 4).tobytes(),
                storage_type=T.INT4, logical_shape=(3, 5), scale=np.ones(5, np.float32),
                zero_point=np.zeros(5, np.int8), axis=1)
    args.update(kw)
    return make_affine_encoded(**args)


def _fails(ev, pattern, exc=AffineLayoutError):
    with pytest.raises(exc, match=pattern):
        resolve(_model(ev))


def test_good_baseline_is_accepted():
    assert resolve(_model(_good())).values["w"].shape == (3, 5)


def test_storage_type_outside_the_closed_set():
    ev = _good()
    ev.affine.storage_type = T.FLOAT
    _fails(ev, "'w'.*storage_type must be one of INT8.*got FLOAT")


def test_scale_must_be_floating_point():
    ev = _good()
    ev.affine.scale.CopyFrom(make_tensor("", np.ones(5, np.int32)))
    _fails(ev, "'w': scale must be FLOAT, FLOAT16 or DOUBLE, got INT32")


def test_logical_type_must_match_the_scale_type():
    # FLOAT16 logical type with a FLOAT scale: DequantizeLinear would output FLOAT
    ev = _good()
    ev.logical_type.tensor_type.elem_type = T.FLOAT16
    _fails(ev, "logical element type FLOAT16 differs from the scale's FLOAT")
    ev = _good()
    ev.affine.scale.CopyFrom(make_tensor("", np.ones(5, np.float64)))
    _fails(ev, "logical element type FLOAT differs from the scale's DOUBLE")


def test_float16_scale_with_float_logical_type_is_output_dtype_float():
    """A FLOAT16 scale with a FLOAT logical type is DequantizeLinear with output_dtype=FLOAT
    (opset 23): the scale is widened and the product computed in float32, exactly as the
    onnx reference evaluates it."""
    rng = np.random.default_rng(7)
    shape, block = (4, 64), 32
    codes = rng.integers(-8, 8, size=shape)
    scale = (rng.standard_normal((4, 2)) * 0.1).astype(np.float16)
    ev = make_affine_encoded("w", pack_codes(codes, 4).tobytes(), T.INT4, shape, scale,
                             axis=1, block_size=block)
    got = resolve(_model(ev)).values["w"].decode()
    assert got.dtype == np.float32
    want = codes.astype(np.float32) * np.repeat(scale.astype(np.float32), block, axis=1)
    np.testing.assert_array_equal(got, want)
    x = oh.make_tensor("x", T.INT4, shape, codes.reshape(-1).tolist())
    s = oh.make_tensor("s", T.FLOAT16, scale.shape, scale.reshape(-1).tolist())
    node = oh.make_node("DequantizeLinear", ["x", "s"], ["y"], axis=1, block_size=block,
                        output_dtype=T.FLOAT)
    g = oh.make_graph([node], "g", [], [oh.make_tensor_value_info("y", T.FLOAT, shape)], [x, s])
    ref = ReferenceEvaluator(oh.make_model(g, opset_imports=[oh.make_opsetid("", 23)]))
    np.testing.assert_array_equal(got, ref.run(None, {})[0])


def test_zero_point_must_have_the_storage_type():
    ev = _good()
    ev.affine.zero_point.CopyFrom(make_tensor("", np.zeros(5, np.int8)))
    _fails(ev, "zero_point must have storage_type INT4, got INT8")


def test_block_size_only_with_axis():
    ev = _good(scale=np.float32(1), zero_point=None, axis=None)
    ev.affine.block_size = 2
    _fails(ev, "block_size 2 is only valid with an axis")


def test_block_size_positive():
    ev = _good()
    ev.affine.block_size = 0
    _fails(ev, "block_size must be positive, got 0")


@pytest.mark.parametrize("axis", [2, -3])
def test_axis_in_range(axis):
    _fails(_good(axis=axis), f"axis {axis} out of range for rank 2")


def test_parameter_shapes_follow_dequantize_linear():
    _fails(_good(scale=np.ones(2, np.float32), zero_point=None, axis=None),
           r"per-tensor scale must be a scalar, got shape \[2\]")
    _fails(_good(scale=np.ones(3, np.float32), zero_point=None),
           r"per-axis scale must have shape \[5\] \(dim 1\), got \[3\]")
    _fails(_good(scale=np.ones((3, 2), np.float32), zero_point=None, block_size=2),
           r"blocked scale must have shape \[3, 3\] \(block_size 2 along axis 1\), got \[3, 2\]")
    _fails(_good(zero_point=np.zeros(4, np.int8)),
           r"zero_point shape \[4\] differs from scale shape \[5\]")


def test_logical_type_concrete_tensor():
    ev = _good()
    ev.ClearField("logical_type")
    _fails(ev, "needs a logical_type with concrete dims")
    ev = _good()
    ev.logical_type.CopyFrom(make_tensor_type("FLOAT", [3, "n"]))
    _fails(ev, "logical_type dimension 1 must be a concrete")
    ev = _good()
    ev.logical_type.Clear()
    ev.logical_type.sequence_type.elem_type.CopyFrom(make_tensor_type("FLOAT", [1]))
    _fails(ev, "logical_type must be a tensor type")


def test_payload_exactly_ceil_n_bits_over_8():
    _fails(_good(codes_payload=bytes(9)), r"exactly ceil\(15 \* 4 / 8\) = 8 bytes, got 9")
    _fails(_good(codes_payload=bytes(7)), "= 8 bytes, got 7")


def test_unused_final_high_bits_zero():
    _fails(_good(codes_payload=bytes(7) + b"\x10"),
           r"unused final high bits.*0x10, 4 unused bits")


def test_external_quantization_parameters_need_a_valid_location():
    # external scales are supported (olv_runtime.save writes large ones to the data file, issue
    # 14); an EXTERNAL scale without a location is a payload error naming the value
    ev = _good()
    ev.affine.scale.ClearField("raw_data")
    ev.affine.scale.data_location = T.EXTERNAL
    _fails(ev, "EXTERNAL payload without 'location'", exc=PayloadError)


def test_bad_parameter_data():
    ev = _good()
    ev.affine.scale.raw_data = bytes(3)
    _fails(ev, r"'w': bad scale/zero_point tensor:.*3 bytes")


def test_affine_errors_are_encoding_errors():
    assert issubclass(AffineLayoutError, EncodingError)
