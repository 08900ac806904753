"""Quantized weights other tools write, recognised as affine encoded values (issue 12).

Seed 000 says common quantization (INT8 per-tensor/per-axis, INT4 blockwise affine) selects the
built-in affine layout. Exporters store exactly that form under other names:

* a standard ``DequantizeLinear(x, x_scale[, x_zero_point], axis, block_size)`` whose inputs are
  initializers (QDQ models, ``olv export-standard`` output): :func:`from_dequantize_linear`;
* a ``com.microsoft::MatMulNBits`` ``B`` input with its ``scales`` and ``zero_points``
  (onnxruntime-genai builder, ``MatMulNBitsQuantizer``): :func:`from_matmul_nbits`;
* a ``com.microsoft::GatherBlockQuantized`` table: :func:`from_gather_block_quantized`.

Each becomes an :class:`~olv_runtime.structs.initializers.AffineValue` whose ``codes`` are a zero-copy view of
the initializer's payload (0 bytes dequantized, 0 payload bytes copied) — the value's logical
tensor is exactly what the foreign operator dequantizes to. :func:`linear_weight` then gives the
form the linear kernels take (``[N, K]`` signed INT4, blocked along K, float32 or float16
scales, float32 logical values): the same
value when it already is that form, else a repacked copy made once at session creation and
counted in ``bytes_repacked`` (UINT4 codes become INT4 by flipping the top bit of each nibble and
moving the zero point by 8, which is exact; ``[K, N]`` MatMul weights are transposed; a block of
64 or 128 becomes 2 or 4 blocks of 32 with the same scale). Any kernel that supports the form
(the packed layouts with or without zero points, or the row-major kernel for blocks that are not
multiples of 32) then serves it; nothing here picks a kernel.

Sources: ONNX DequantizeLinear-21/25; onnxruntime contrib ops ``MatMulNBits``,
``GatherBlockQuantized`` (docs/ContribOperators.md).
"""
from __future__ import annotations

import math

import numpy as np

from olv_runtime.errors import ValidationError
from olv_runtime.kernels.affine import unpack_codes
from olv_runtime.proto import TensorProto
from olv_runtime.structs.initializers import SUBBYTE, AffineValue, dtype_name

__all__ = ["from_dequantize_linear", "from_matmul_nbits", "from_gather_block_quantized",
           "linear_weight", "gather_table"]

_INT_STORAGE = {TensorProto.INT8: (8, True), TensorProto.UINT8: (8, False), **SUBBYTE}


#: Attributes a recognized weight carries for seed 004 compiled entries
#: (olv_runtime.structs.compiled.source_name_of / canonical_parts): the codes initializer it was built
#: from (the ``x`` of DequantizeLinear, the ``B`` of MatMulNBits), the names of every input the
#: recognition read (codes, scale, zero point; "" when absent) and the operator form (op and
#: attributes) as bytes.
SOURCE_ATTR = "_olv_source"
INPUTS_ATTR = "_olv_source_inputs"
FORM_ATTR = "_olv_source_form"


def mark_source(av: AffineValue, inputs: tuple, form: str) -> AffineValue:
    """Record on ``av`` the graph inputs it was recognized from (``inputs[0]``: the codes
    initializer) and the operator form ``form`` (e.g. ``"DequantizeLinear axis=1 ..."``)."""
    object.__setattr__(av, SOURCE_ATTR, inputs[0])
    object.__setattr__(av, INPUTS_ATTR, tuple(inputs))
    object.__setattr__(av, FORM_ATTR, form.encode())
    return av


def _carry_source(src: AffineValue, out: AffineValue) -> AffineValue:
    for a in (SOURCE_ATTR, INPUTS_ATTR, FORM_ATTR):
        if hasattr(src, a):
            object.__setattr__(out, a, getattr(src, a))
    return out


def _float32(name: str, scale: np.ndarray) -> np.ndarray:
    if scale.dtype == np.float32:
        return scale
    if scale.dtype in (np.float16, np.float64):
        return scale.astype(np.float32)
    raise ValidationError(f"{name}: scale must be floating point, got {scale.dtype}")


def from_dequantize_linear(name: str, codes_proto: TensorProto, codes: np.ndarray,
                           scale: np.ndarray, zero_point: np.ndarray | None, axis: int,
                           block_size: int, output_dtype: int = 0) -> AffineValue | None:
    """The affine value a ``DequantizeLinear`` over an initializer denotes (zero-copy).

    Parameters
    ----------
    name : str
        The DequantizeLinear output (used in messages).
    codes_proto : TensorProto
        The ``x`` initializer (INT8/UINT8/INT4/UINT4/INT2/UINT2).
    codes : ndarray of uint8
        Its payload bytes (raw, LSB-first packing as ONNX stores sub-byte tensors).
    scale, zero_point : ndarray
        ``x_scale`` and ``x_zero_point`` as arrays (sub-byte zero points unpacked to int8/uint8).
    axis, block_size, output_dtype : int
        The node's attributes (block_size 0: per-axis, or per-tensor when the scale is a scalar;
        output_dtype 0: the scale's type).

    Returns
    -------
    AffineValue or None
        None when the form is not one of the affine branch (e.g. a float8 input); the op then
        runs as a plain DequantizeLinear.

    Raises
    ------
    ValidationError
        Parameter shapes that DequantizeLinear itself rejects (named).
    """
    st = codes_proto.data_type
    if st not in _INT_STORAGE or scale.dtype.kind != "f":
        return None
    bits, signed = _INT_STORAGE[st]
    shape = tuple(int(d) for d in codes_proto.dims)
    rank = len(shape)
    if scale.size == 1 and block_size == 0:
        ax, bs = None, None
        scale = scale.reshape(())
        zero_point = None if zero_point is None else zero_point.reshape(())
    else:
        if not -rank <= axis < rank:
            raise ValidationError(f"{name}: DequantizeLinear axis {axis} out of range for rank {rank}")
        ax = axis % rank
        bs = int(block_size) or None
        want = (shape[ax],) if bs is None else tuple(
            -(-d // bs) if i == ax else d for i, d in enumerate(shape))
        if scale.shape != want:
            raise ValidationError(
                f"{name}: DequantizeLinear scale shape {list(scale.shape)} does not match "
                f"{list(want)} (x {list(shape)}, axis {ax}, block_size {block_size})")
    if zero_point is not None:
        if zero_point.shape != scale.shape:
            raise ValidationError(
                f"{name}: zero_point shape {list(zero_point.shape)} differs from scale shape "
                f"{list(scale.shape)}")
        zero_point = np.ascontiguousarray(zero_point, np.int8 if signed else np.uint8)
    need = -(-math.prod(shape) * bits // 8)
    if codes.size != need:
        raise ValidationError(f"{name}: {dtype_name(st)} {list(shape)} needs {need} bytes, got "
                              f"{codes.size}")
    et = output_dtype or {np.dtype(np.float32): TensorProto.FLOAT,
                          np.dtype(np.float16): TensorProto.FLOAT16,
                          np.dtype(np.float64): TensorProto.DOUBLE}[scale.dtype]
    if et not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
        return None
    return AffineValue(name, st, bits, signed, shape, et, ax, bs, scale, zero_point, codes)


def _unpack_nibbles_u4(packed: np.ndarray, count: int) -> np.ndarray:
    out = np.empty(packed.size * 2, np.uint8)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:count]


def from_matmul_nbits(name: str, b: np.ndarray, scales: np.ndarray,
                      zero_points: np.ndarray | None, n: int, k: int, bits: int,
                      block_size: int) -> AffineValue:
    """The ``[N, K]`` weight a ``com.microsoft::MatMulNBits`` node multiplies by.

    ``B`` is ``[N, ceil(K / block_size), block_size * bits / 8]`` uint8 (unsigned codes, low
    bits first); ``scales`` ``[N * n_blocks]`` or ``[N, n_blocks]``; ``zero_points`` packed
    ``bits``-bit unsigned ``[N, ceil(n_blocks * bits / 8)]`` (default ``2^(bits-1)``).
    The result is a UINT4/UINT8 affine value blocked along K whose codes view ``B`` itself when
    each row holds exactly K codes (K a multiple of block_size), else a copy without the row
    padding (counted by the caller).

    Raises
    ------
    ValidationError
        bits not 4 or 8, block_size not a power of two >= 16, shapes that do not match N, K,
        floating-point zero points (not an affine form).
    """
    if bits not in (4, 8):
        raise ValidationError(f"{name}: MatMulNBits bits must be 4 or 8, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValidationError(
            f"{name}: MatMulNBits block_size must be a power of two >= 16, got {block_size}")
    if b.dtype != np.uint8:
        raise ValidationError(f"{name}: MatMulNBits B must be uint8, got {b.dtype}")
    nb = -(-k // block_size)
    blob = block_size * bits // 8
    if b.size != n * nb * blob:
        raise ValidationError(
            f"{name}: MatMulNBits B must have {n} x {nb} x {blob} bytes (N={n}, K={k}, "
            f"block_size={block_size}), got shape {list(b.shape)}")
    if scales.size != n * nb:
        raise ValidationError(
            f"{name}: MatMulNBits scales must have {n} x {nb} elements, got {list(scales.shape)}")
    scale = scales.reshape(n, nb)
    if scale.dtype.kind != "f":
        raise ValidationError(f"{name}: MatMulNBits scales must be floating point, got {scale.dtype}")
    flat = b.reshape(-1)
    if k % block_size == 0:
        codes = flat  # zero-copy: rows of K codes back to back
        copied = 0
    else:  # drop the padding codes at the end of each row
        per_row = nb * block_size
        if bits == 4:
            c = _unpack_nibbles_u4(flat, n * per_row).reshape(n, per_row)[:, :k].reshape(-1)
            if c.size % 2:
                c = np.concatenate([c, np.zeros(1, np.uint8)])
            codes = (c[0::2] | (c[1::2] << 4)).astype(np.uint8)
        else:
            codes = np.ascontiguousarray(flat.reshape(n, per_row)[:, :k]).reshape(-1)
        copied = codes.nbytes
    if zero_points is not None:
        if zero_points.dtype.kind == "f":
            raise ValidationError(
                f"{name}: MatMulNBits floating-point zero_points are not supported (not an "
                "integer affine form); requantize with integer zero points")
        zp_flat = zero_points.reshape(-1).astype(np.uint8)
        if bits == 4:
            per = -(-nb // 2)
            if zp_flat.size != n * per:
                raise ValidationError(
                    f"{name}: MatMulNBits 4-bit zero_points must have {n} x {per} bytes, got "
                    f"{zp_flat.size}")
            zp = _unpack_nibbles_u4(zp_flat.reshape(n, per).reshape(-1), n * per * 2)
            zp = np.ascontiguousarray(zp.reshape(n, per * 2)[:, :nb])
        else:
            if zp_flat.size != n * nb:
                raise ValidationError(
                    f"{name}: MatMulNBits 8-bit zero_points must have {n} x {nb} bytes, got "
                    f"{zp_flat.size}")
            zp = zp_flat.reshape(n, nb)
    else:
        zp = np.full((n, nb), 1 << (bits - 1), np.uint8)  # the operator's default zero point
    st = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
    et = TensorProto.FLOAT16 if scale.dtype == np.float16 else TensorProto.FLOAT
    av = AffineValue(name, st, bits, False, (n, k), et, 1, block_size, scale, zp, codes)
    object.__setattr__(av, "_copied", copied)
    return av


def from_gather_block_quantized(name: str, data_proto: TensorProto, data: np.ndarray,
                                scales: np.ndarray, zero_points: np.ndarray | None,
                                block_size: int, quantize_axis: int) -> AffineValue:
    """The ``[V, D]`` table of a ``com.microsoft::GatherBlockQuantized`` (gather_axis 0).

    ``data`` is INT4/UINT4 ``[V, D]`` or uint8 ``[V, D/2]`` (two unsigned 4-bit codes per byte,
    default zero point 8), ``scales`` ``[V, D / block_size]``.

    Raises
    ------
    ValidationError
        A form other than a 2-D table quantized along its last axis.
    """
    dims = tuple(int(d) for d in data_proto.dims)
    st = data_proto.data_type
    if st == TensorProto.UINT8:
        if len(dims) != 2:
            raise ValidationError(f"{name}: GatherBlockQuantized uint8 data must be 2-D, got {list(dims)}")
        shape = (dims[0], dims[1] * 2)
        st, signed = TensorProto.UINT4, False
    elif st in (TensorProto.INT4, TensorProto.UINT4):
        shape = dims
        signed = st == TensorProto.INT4
    else:
        raise ValidationError(
            f"{name}: GatherBlockQuantized data type {dtype_name(st)} is not supported (UINT8 "
            "packed 4-bit, INT4 or UINT4)")
    if len(shape) != 2 or quantize_axis % 2 != 1:
        raise ValidationError(
            f"{name}: GatherBlockQuantized is supported for a 2-D table quantized along its last "
            f"axis, got data {list(shape)} quantize_axis {quantize_axis}")
    v, d = shape
    nb = -(-d // block_size)
    if scales.shape != (v, nb):
        raise ValidationError(
            f"{name}: GatherBlockQuantized scales must be [{v}, {nb}], got {list(scales.shape)}")
    if zero_points is None:
        zp = None if signed else np.full((v, nb), 8, np.uint8)
    else:
        zp = zero_points
        if zp.dtype == np.uint8 and zp.shape == (v, -(-nb // 2)) and st == TensorProto.UINT4:
            zp = np.ascontiguousarray(
                _unpack_nibbles_u4(zp.reshape(-1), v * zp.shape[1] * 2).reshape(v, -1)[:, :nb])
        if zp.shape != (v, nb):
            raise ValidationError(
                f"{name}: GatherBlockQuantized zero_points must be [{v}, {nb}] (or packed), got "
                f"{list(zp.shape)}")
        zp = np.ascontiguousarray(zp, np.int8 if signed else np.uint8)
    et = TensorProto.FLOAT16 if scales.dtype == np.float16 else TensorProto.FLOAT
    return AffineValue(name, st, 4, signed, shape, et, 1, block_size, scales, zp, data.reshape(-1))


def _codes_int8(av: AffineValue) -> np.ndarray:
    """All codes as int8 (signed) / uint8 values, logical shape (a copy)."""
    return unpack_codes(av.codes, av.bits, av.signed, av.size).reshape(av.shape)


def _pack_int4(values: np.ndarray) -> np.ndarray:
    v = (values.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)
    if v.size % 2:
        v = np.concatenate([v, np.zeros(1, np.uint8)])
    return (v[0::2] | (v[1::2] << 4)).astype(np.uint8)


def linear_weight(av: AffineValue, k_first: bool, counters=None) -> AffineValue | None:
    """The ``[N, K]`` signed-INT4 form of a linear weight for the linear kernels.

    Parameters
    ----------
    av : AffineValue
        A 4-bit 2-D weight: ``[N, K]`` (``k_first`` False; MatMulNBits, Transpose->MatMul) or
        ``[K, N]`` (``k_first`` True; the ``B`` of ``MatMul(x, DequantizeLinear(B))``),
        quantized per tensor, per output channel, or in blocks along K.
    counters : Counters, optional
        Receives ``bytes_repacked`` for a converted copy.

    Returns
    -------
    AffineValue or None
        ``av`` itself when already INT4 ``[N, K]`` blocked along K with float32 scales; a
        converted value with the same logical tensor otherwise; None for forms the linear kernels
        do not take (8-bit or 2-bit codes, blocks along N).
    """
    if av.bits != 4 or len(av.shape) != 2 or av.elem_type != TensorProto.FLOAT:
        return None  # the linear kernels take float32 activations and produce float32
    kax = 0 if k_first else 1
    if av.axis is not None and av.block_size is None and av.axis == kax:
        return None  # one scale per input feature: not a row-wise form
    if av.axis is not None and av.block_size is not None and av.axis != kax:
        return None
    if k_first:
        k, n = av.shape
    else:
        n, k = av.shape
    # scales / zero points as [N, blocks along K]
    if av.axis is None:
        bs = k
        scale = np.full((n, 1), av.scale.reshape(()), av.scale.dtype)
        zp = None if av.zero_point is None else np.full((n, 1), av.zero_point.reshape(()),
                                                          av.zero_point.dtype)
    elif av.block_size is None:
        bs = k
        scale = av.scale.reshape(n, 1)
        zp = None if av.zero_point is None else av.zero_point.reshape(n, 1)
    else:
        bs = av.block_size
        scale = av.scale.T if k_first else av.scale
        zp = None if av.zero_point is None else (av.zero_point.T if k_first else av.zero_point)
    # float16 scales stay float16 (the kernels read them exactly); others become float32
    scale = np.ascontiguousarray(scale if scale.dtype == np.float16 else _float32(av.name, scale))
    already = (av.storage_type == TensorProto.INT4 and not k_first and av.axis == 1
               and av.block_size == 32 and av.scale.dtype in (np.float32, np.float16))
    if already:
        return av
    # block sizes that are multiples of 32 are re-expressed as blocks of 32 (exact)
    if bs % 32 == 0 and bs > 32 or (bs == k and k > 32):
        rep = -(-bs // 32)
        nb32 = -(-k // 32)
        scale = np.ascontiguousarray(np.repeat(scale, rep, axis=1)[:, :nb32])
        if zp is not None:
            zp = np.repeat(zp, rep, axis=1)[:, :nb32]
        bs = 32
    if zp is not None:
        zp = zp.astype(np.int16)
    if av.storage_type == TensorProto.UINT4:
        zp = (np.full(scale.shape, 0, np.int16) if zp is None else zp) - 8
    zp = None if zp is None or not zp.any() else np.ascontiguousarray(zp.astype(np.int8))
    if av.storage_type == TensorProto.UINT4 and not k_first:
        # flip the top bit of every nibble: u - 8 in two's complement (exact, no unpacking)
        codes = np.bitwise_xor(av.codes, np.uint8(0x88))
        used = (n * k * 4) % 8
        if used:
            codes[-1] &= 0x0F
    elif not k_first:
        codes = av.codes
    else:
        q = _codes_int8(av).astype(np.int16)
        if not av.signed:
            q = q - 8
        codes = _pack_int4(np.ascontiguousarray(q.T))
    if counters is not None and codes is not av.codes:
        counters.add("bytes_repacked", codes.nbytes)
    out = AffineValue(av.name, TensorProto.INT4, 4, True, (n, k), TensorProto.FLOAT, 1, bs,
                      scale, zp, codes)
    return _carry_source(av, out)


def gather_table(av: AffineValue, counters=None) -> AffineValue | None:
    """The signed-INT4 ``[V, D]`` form (blocked along D, float32 scales) the embedding gather
    kernel takes, or None for other forms."""
    return linear_weight(av, False, counters) if av.bits == 4 and len(av.shape) == 2 else None

