"""The ggml block types of GGUF files as seed 000 struct declarations, with FunctionProto decoders.

One table (:data:`BLOCKS`), gguf-py's ``(block size, type size)`` table read as records. Each
quantized ggml type is a **block declaration** (the physical record, fields in storage order,
nibble and bit streams as ``BitPacking``, LSB first) and, per row length ``K``, a **row
declaration** ``{blocks: Array(type_ref block, K / block_size)}`` carrying the decoder: one record
of the encoded value is one row of the matrix, so the decoder's output ``[records, K]`` is exactly
the logical ``FLOAT[rows, K]`` (a 1-D tensor uses the *flat* row declaration, output ``[K]``).

=====  ====  =====  =======================================================================
type   bs    bytes  block record (storage order)                    weight
=====  ====  =====  =======================================================================
F16    1     2      row: values FLOAT16[K]                          Cast
BF16   1     2      row: values BFLOAT16[K]                         Cast
Q4_0   32    18     d FLOAT16, qs BitPacking(q:4)x32                d * (q - 8)
Q4_1   32    20     d, m FLOAT16, qs BitPacking(q:4)x32             d * q + m
Q5_0   32    22     d FLOAT16, qh BitPacking(h:1)x32, qs (q:4)x32   d * ((q | h << 4) - 16)
Q5_1   32    24     d, m FLOAT16, qh (h:1)x32, qs (q:4)x32          d * (q | h << 4) + m
Q8_0   32    34     d FLOAT16, qs INT8[32]                          q * d
Q4_K   256   144    d, dmin FLOAT16, scales UINT8[12], qs (q:4)x256 d*sc[s] * q - dmin*m[s]
Q5_K   256   176    d, dmin, scales UINT8[12], qh (h:1)x256, qs     d*sc[s] * (q | h << 4) - dmin*m[s]
Q6_K   256   210    ql (q:4)x256, qh (h:2)x256, scales INT8[16], d  d * scales[s16] * ((ql | qh << 4) - 32)
=====  ====  =====  =======================================================================

Element order inside a block (ggml ``dequantize_row_*``; gguf-py ``quants.py``): for the 32-blocks,
byte ``j`` of ``qs`` holds element ``j`` (low nibble) and ``j + 16`` (high nibble) and bit ``j`` of
``qh`` is bit 4 of element ``j``; for Q4_K / Q5_K, the 128 ``qs`` bytes are four chunks of 32, chunk
``c``'s low nibbles are sub-block ``2c`` and its high nibbles sub-block ``2c + 1``, bit ``s`` of
``qh[e]`` is bit 4 of element ``e`` of sub-block ``s``, and the 12 ``scales`` bytes pack eight 6-bit
scales and eight 6-bit mins (``get_scale_min_k4``); for Q6_K, ``ql`` is two halves of 64 bytes
(low nibbles then high nibbles give four runs of 64 elements... see the decoder), ``qh`` two halves
of 32 bytes with four 2-bit fields each, and one signed 8-bit scale per 16 elements.

The decoders use only standard ONNX ops (opset 21: ``BitShift``, ``BitwiseAnd``, ``BitwiseOr``,
``Cast``, ``Concat``, ``Slice``, ``Reshape``, ``Transpose``, ``Unsqueeze``, ``Mul``, ``Sub``,
``Add``, ``Constant``) in the order of gguf-py's ``dequantize_blocks``, so ``decode_value`` equals
``gguf.quants.dequantize`` bit for bit and onnxruntime can run the exported decoders.

type_ids (model-scoped, deterministic): block ``0x67670000 + ggml_type`` (``"gg"``); row
``1 << 40 | ggml_type << 32 | flat << 31 | K``. Declarations carry ``metadata_props``
``ggml.type`` / ``ggml.block_size`` / ``ggml.type_size`` (and ``ggml.row_length`` on rows), which
the native consumers verify together with the resolved record layout.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from olv_runtime.errors import ConversionError
from olv_runtime.proto import EncodedValueProto, StructTypeProto, TensorProto
from olv_runtime.proto.helper import make_node, make_tensor
from olv_runtime.structs.build import (
    array,
    bit_packing,
    declare,
    field,
    make_function,
    ref,
    scalar,
    structure,
    tensor,
)

__all__ = ["GGMLBlock", "BLOCKS", "block_type_id", "row_type_id", "block_declaration",
           "row_declaration", "declarations", "make_ggml_encoded", "ggml_type_of"]

F16, BF16, U8, I8 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.UINT8, TensorProto.INT8
OPSET = 21


@dataclasses.dataclass(frozen=True)
class GGMLBlock:
    """One ggml tensor type.

    Attributes
    ----------
    name : str
        ggml type name (``"Q4_0"``).
    ggml_type : int
        ggml type id (``enum ggml_type``).
    block_size : int
        Elements per block.
    type_size : int
        Bytes per block.
    fields : callable or None
        ``() -> StructTypeProto`` structure of one block (None for F16/BF16: the row holds the
        values directly).
    decode : callable
        ``(F) -> output name``: appends the decoder's nodes over the leaf inputs
        ``blocks.<field>`` (``[rows, blocks, ...]``) and returns a ``[rows, blocks, block_size]``
        float tensor (``[rows, K]`` for F16/BF16).
    """

    name: str
    ggml_type: int
    block_size: int
    type_size: int
    fields: Callable | None
    decode: Callable


class _F:
    """Nodes of one decoder FunctionProto, with generated value names and constants."""

    def __init__(self):
        self.nodes = []
        self.inputs: list[str] = []
        self._n = 0

    def inp(self, path: str) -> str:
        if path not in self.inputs:
            self.inputs.append(path)
        return path

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value, dtype) -> str:
        t = make_tensor("", np.asarray(value, dtype))
        t.ClearField("name")
        out = self._name("c")
        self.nodes.append(make_node("Constant", [], [out], value=t))
        return out

    def op(self, op_type: str, *inputs: str, hint: str = "", **attrs) -> str:
        out = self._name(hint or op_type.lower())
        self.nodes.append(make_node(op_type, list(inputs), [out], **attrs))
        return out

    # shorthands
    def f32(self, x):
        return self.op("Cast", x, to=TensorProto.FLOAT)

    def band(self, x, mask):
        return self.op("BitwiseAnd", x, self.const(mask, np.uint8))

    def shr(self, x, n):
        return self.op("BitShift", x, self.const(n, np.uint8), direction="RIGHT")

    def shl(self, x, n):
        return self.op("BitShift", x, self.const(n, np.uint8), direction="LEFT")

    def reshape(self, x, shape):
        return self.op("Reshape", x, self.const(shape, np.int64))

    def unsq(self, x):
        return self.op("Unsqueeze", x, self.const([-1], np.int64))

    def slice_last(self, x, start, end):
        return self.op("Slice", x, self.const([start], np.int64), self.const([end], np.int64),
                       self.const([-1], np.int64))

    def reorder(self, x, split, out_shape=None):
        """``x [R, nb, prod(split)]`` viewed as ``[R, nb, *split]``, last two axes swapped."""
        r = self.reshape(x, [0, 0, *split])
        nd = 2 + len(split)
        perm = list(range(nd - 2)) + [nd - 1, nd - 2]
        t = self.op("Transpose", r, perm=perm)
        return self.reshape(t, out_shape or [0, 0, int(np.prod(split))])


# -- the decoders (each mirrors gguf-py's dequantize_blocks, op for op) ----------------------------
def _nib32(f: _F) -> str:
    """Q4_0-style nibbles: stream element 2j = low nibble of byte j = weight j, 2j+1 = weight j+16."""
    return f.reorder(f.inp("blocks.qs.q"), [16, 2])


def _bits32(f: _F) -> str:
    return f.shl(f.inp("blocks.qh.h"), 4)  # bit j of qh is bit 4 of weight j (stream order)


def _d(f: _F, path="blocks.d") -> str:
    return f.unsq(f.f32(f.inp(path)))  # [R, nb, 1]


def _dec_q4_0(f):
    q = f.op("Sub", f.f32(_nib32(f)), f.const(8.0, np.float32))
    return f.op("Mul", _d(f), q)


def _dec_q4_1(f):
    return f.op("Add", f.op("Mul", _d(f), f.f32(_nib32(f))), _d(f, "blocks.m"))


def _dec_q5_0(f):
    q = f.op("BitwiseOr", _nib32(f), _bits32(f))
    return f.op("Mul", _d(f), f.op("Sub", f.f32(q), f.const(16.0, np.float32)))


def _dec_q5_1(f):
    q = f.op("BitwiseOr", _nib32(f), _bits32(f))
    return f.op("Add", f.op("Mul", _d(f), f.f32(q)), _d(f, "blocks.m"))


def _dec_q8_0(f):
    return f.op("Mul", f.f32(f.inp("blocks.qs")), _d(f))


def _scale_min_k4(f: _F) -> tuple[str, str]:
    """Eight 6-bit scales and mins from the 12 ``scales`` bytes (ggml get_scale_min_k4)."""
    s = f.inp("blocks.scales")
    d_, m_, md = f.slice_last(s, 0, 4), f.slice_last(s, 4, 8), f.slice_last(s, 8, 12)
    sc = f.op("Concat", f.band(d_, 0x3F),
              f.op("BitwiseOr", f.band(md, 0x0F), f.band(f.shr(d_, 2), 0x30)), axis=-1)
    mn = f.op("Concat", f.band(m_, 0x3F),
              f.op("BitwiseOr", f.shr(md, 4), f.band(f.shr(m_, 2), 0x30)), axis=-1)
    return sc, mn


def _dec_k(f, five: bool):
    sc, mn = _scale_min_k4(f)
    d = f.unsq(f.op("Mul", _d(f), f.f32(sc)))                 # [R, nb, 8, 1]
    dm = f.unsq(f.op("Mul", _d(f, "blocks.dmin"), f.f32(mn)))
    # qs: 4 chunks of 32 bytes; low nibbles -> sub-block 2c, high -> 2c+1
    q = f.reorder(f.inp("blocks.qs.q"), [4, 32, 2], out_shape=[0, 0, 8, 32])
    if five:  # bit s of qh[e] is bit 4 of element e of sub-block s
        h = f.reorder(f.inp("blocks.qh.h"), [32, 8], out_shape=[0, 0, 8, 32])
        q = f.op("BitwiseOr", q, f.shl(h, 4))
    y = f.op("Sub", f.op("Mul", d, f.f32(q)), dm)
    return f.reshape(y, [0, 0, 256])


def _dec_q6_k(f):
    # ql: halves of 64 bytes; in half c, low nibbles are elements 128c + [0, 64), high nibbles
    # 128c + [64, 128). qh: halves of 32 bytes; bits 2s..2s+1 of byte e are bits 4..5 of
    # element 128c + 32s + e.
    ql = f.reshape(f.op("Transpose", f.reshape(f.inp("blocks.ql.q"), [0, 0, 2, 64, 2]),
                        perm=[0, 1, 2, 4, 3]), [0, 0, 256])
    qh = f.reshape(f.op("Transpose", f.reshape(f.inp("blocks.qh.h"), [0, 0, 2, 32, 4]),
                        perm=[0, 1, 2, 4, 3]), [0, 0, 256])
    q = f.op("Sub", f.f32(f.op("BitwiseOr", ql, f.shl(qh, 4))), f.const(32.0, np.float32))
    q = f.reshape(q, [0, 0, 16, 16])
    d = f.unsq(f.op("Mul", _d(f), f.f32(f.inp("blocks.scales"))))  # [R, nb, 16, 1]
    return f.reshape(f.op("Mul", d, q), [0, 0, 256])


def _dec_cast(f):
    return f.f32(f.inp("values"))


def _q_fields(*extra):
    def build():
        return structure(*[field(n, t) for n, t in extra])
    return build


def _bp(name, width, n):
    return bit_packing([(name, width)], n)


BLOCKS: dict[str, GGMLBlock] = {b.name: b for b in [
    GGMLBlock("F16", 1, 1, 2, None, _dec_cast),
    GGMLBlock("BF16", 30, 1, 2, None, _dec_cast),
    GGMLBlock("Q4_0", 2, 32, 18, _q_fields(("d", scalar(F16)), ("qs", _bp("q", 4, 32))),
              _dec_q4_0),
    GGMLBlock("Q4_1", 3, 32, 20, _q_fields(("d", scalar(F16)), ("m", scalar(F16)),
                                           ("qs", _bp("q", 4, 32))), _dec_q4_1),
    GGMLBlock("Q5_0", 6, 32, 22, _q_fields(("d", scalar(F16)), ("qh", _bp("h", 1, 32)),
                                           ("qs", _bp("q", 4, 32))), _dec_q5_0),
    GGMLBlock("Q5_1", 7, 32, 24, _q_fields(("d", scalar(F16)), ("m", scalar(F16)),
                                           ("qh", _bp("h", 1, 32)), ("qs", _bp("q", 4, 32))),
              _dec_q5_1),
    GGMLBlock("Q8_0", 8, 32, 34, _q_fields(("d", scalar(F16)), ("qs", tensor(I8, [32]))),
              _dec_q8_0),
    GGMLBlock("Q4_K", 12, 256, 144, _q_fields(("d", scalar(F16)), ("dmin", scalar(F16)),
                                              ("scales", tensor(U8, [12])),
                                              ("qs", _bp("q", 4, 256))),
              lambda f: _dec_k(f, five=False)),
    GGMLBlock("Q5_K", 13, 256, 176, _q_fields(("d", scalar(F16)), ("dmin", scalar(F16)),
                                              ("scales", tensor(U8, [12])),
                                              ("qh", _bp("h", 1, 256)),
                                              ("qs", _bp("q", 4, 256))),
              lambda f: _dec_k(f, five=True)),
    GGMLBlock("Q6_K", 14, 256, 210, _q_fields(("ql", _bp("q", 4, 256)), ("qh", _bp("h", 2, 256)),
                                              ("scales", tensor(I8, [16])),
                                              ("d", scalar(F16))), _dec_q6_k),
]}
_BY_ID = {b.ggml_type: b for b in BLOCKS.values()}


def ggml_type_of(name_or_id) -> GGMLBlock:
    """The :class:`GGMLBlock` of a ggml type name or id; ConversionError if unsupported."""
    b = BLOCKS.get(name_or_id) if isinstance(name_or_id, str) else _BY_ID.get(int(name_or_id))
    if b is None:
        raise ConversionError(
            f"ggml tensor type {name_or_id!r} is not supported; supported: F32, "
            + ", ".join(BLOCKS)
        )
    return b


def block_type_id(b: GGMLBlock) -> int:
    return 0x67670000 + b.ggml_type


def row_type_id(b: GGMLBlock, k: int, flat: bool = False) -> int:
    if not 0 < k < (1 << 31):
        raise ConversionError(f"row length {k} out of range for a ggml row type")
    return (1 << 40) | (b.ggml_type << 32) | (int(flat) << 31) | k


def _meta(st: StructTypeProto, b: GGMLBlock, **extra) -> StructTypeProto:
    for key, value in [("ggml.type", b.name), ("ggml.block_size", b.block_size),
                       ("ggml.type_size", b.type_size), *extra.items()]:
        st.metadata_props.add(key=key, value=str(value))
    return st


def block_declaration(b: GGMLBlock | str) -> StructTypeProto:
    """The catalogue declaration of one ggml block (no decoder: a subtype of the row types)."""
    b = ggml_type_of(b) if isinstance(b, str) else b
    if b.fields is None:
        raise ConversionError(f"{b.name} has no block record (its rows hold the values)")
    st = declare(block_type_id(b), f"ggml.{b.name}", b.fields())
    st.doc_string = f"one ggml {b.name} block: {b.block_size} weights in {b.type_size} bytes"
    return _meta(st, b)


def decoder_function(b: GGMLBlock, flat: bool = False):
    """The decoder FunctionProto of a row type: ``[records, K]`` (``[K]`` when ``flat``)."""
    f = _F()
    y = b.decode(f)
    y = f.reshape(y, [-1] if flat else [0, -1])
    fn = make_function(f"Decode_ggml_{b.name}" + ("_flat" if flat else ""), f.inputs, [y],
                       f.nodes, opsets=(("", OPSET),))
    return fn


def row_declaration(b: GGMLBlock | str, k: int, flat: bool = False) -> StructTypeProto:
    """The root declaration of one row of ``k`` weights of type ``b`` (decoder included).

    Raises
    ------
    ConversionError
        ``k`` is not a positive multiple of the block size.
    """
    b = ggml_type_of(b) if isinstance(b, str) else b
    if k <= 0 or k % b.block_size:
        raise ConversionError(f"{b.name}: row length {k} is not a positive multiple of "
                              f"{b.block_size}")
    if b.fields is None:
        elem = F16 if b.name == "F16" else BF16
        kind = structure(field("values", tensor(elem, [k])))
    else:
        kind = structure(field("blocks", array(ref(block_type_id(b)), k // b.block_size)))
    name = f"ggml.{b.name}.row{k}" + (".flat" if flat else "")
    st = declare(row_type_id(b, k, flat), name, kind, decoder=decoder_function(b, flat))
    st.doc_string = (f"one row of {k} weights as ggml {b.name}; decodes to FLOAT "
                     + ("[K] (one record)" if flat else "[records, K]"))
    return _meta(st, b, **{"ggml.row_length": k, "ggml.flat": int(flat)})


def declarations(used) -> list[StructTypeProto]:
    """Block and row declarations for ``used``: iterable of (type name, K, flat)."""
    out: dict[int, StructTypeProto] = {}
    for name, k, flat in used:
        b = ggml_type_of(name)
        if b.fields is not None and block_type_id(b) not in out:
            out[block_type_id(b)] = block_declaration(b)
        rid = row_type_id(b, k, flat)
        if rid not in out:
            out[rid] = row_declaration(b, k, flat)
    return list(out.values())


def make_ggml_encoded(name: str, type_name: str, shape, *, location: str | None = None,
                      offset: int = 0, length: int | None = None,
                      raw: bytes | None = None) -> EncodedValueProto:
    """An EncodedValueProto of one GGUF tensor: a ``type_ref`` to its row type, logical FLOAT
    ``shape`` (numpy order), payload either external (``location``/``offset``/``length``,
    relative to the model's directory: the bytes stay inside the .gguf) or inline ``raw``.

    Raises
    ------
    ConversionError
        Unsupported type, a tensor of rank 0 or above 2, a row length not a multiple of the block.
    """
    b = ggml_type_of(type_name)
    shape = [int(d) for d in shape]
    if not 1 <= len(shape) <= 2:
        raise ConversionError(f"tensor {name!r}: rank {len(shape)} is not supported (1 or 2)")
    k = shape[-1]
    ev = EncodedValueProto(name=name)
    ev.struct_type.type_ref = row_type_id(b, k, flat=len(shape) == 1)
    ev.logical_type.tensor_type.elem_type = TensorProto.FLOAT
    for d in shape:
        ev.logical_type.tensor_type.shape.dim.add().dim_value = d
    if raw is not None:
        ev.raw_data = bytes(raw)
    else:
        ev.data_location = TensorProto.EXTERNAL
        ev.external_data.add(key="location", value=location)
        ev.external_data.add(key="offset", value=str(int(offset)))
        ev.external_data.add(key="length", value=str(int(length)))
    return ev
