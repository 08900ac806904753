"""Native consumers of ggml row types: GGUF blocks for the fast kernels.

At session creation a linear layer (``olv.Decode -> Transpose -> MatMul``) or an embedding gather
whose weight is a ggml struct value asks :func:`linear_weight` for a form the fast kernels read.
Following seed 000 ("Native bindings are keyed by type_id and verify the resolved declaration
before creating a typed view"), the consumer registered for a ggml type first checks that the
value's resolved root declaration *is* the canonical row declaration of
:mod:`olv_runtime.structs.ggml` (same fields, bit packing, metadata and decoder) and that its
record layout has the canonical signature; any other declaration under such a type_id is left
to its FunctionProto decoder. Never a float copy of a weight:

* Q8_0, Q5_0, Q4_K, Q6_K (:data:`BLOCK_KERNEL_TYPES`): a :class:`GGMLWeight` -- the payload's
  blocks in place. :class:`~olv_runtime.executor.steps.LinearStep` repacks them into the group records
  of :mod:`olv_runtime.kernels.ggml_packed` (the file's bits per weight, int8-activation VNNI /
  AVX2 and exact kernels); :class:`GGMLGather` dequantizes only looked-up rows.
* Q4_0: exactly the symmetric INT4 block-32 affine form of the converter (float16 scales kept,
  4.5 bits per weight as in the file), so it takes every INT4 fast path.
* Q4_1, Q5_1, Q5_K: signed INT4 *planes* plus a per-block float offset (one pass over the
  blocks), every 32-element sub-block ``b`` of row ``n``::

      w[n, k] = sum_p scale_p[n, b] * code_p[n, k] + offset[n, b]      code_p in [-8, 7]

  ======  ================================================  ==========
  type    planes (scale x code)                             offset
  ======  ================================================  ==========
  Q4_1    d x (q - 8)                                       8 d + m
  Q5_1    d x (lo - 8),  16 d x h                           8 d + m
  Q5_K    D x (lo - 8),  16 D x h   (D = d sc_b, M = dmin m_b)  8 D - M
  ======  ================================================  ==========

  run as one packed INT4 kernel per plane plus ``offset @ blocksum(x)``
  (:class:`~olv_runtime.executor.steps.PlanesLinear`).

F16 and BF16 have no native consumer: they decode through their FunctionProto decoder.
"""
from __future__ import annotations

import ctypes
import mmap as _mmap
import sys

import numpy as np

from olv_runtime.errors import InvalidArgument
from olv_runtime.lazy import lazy_module
from olv_runtime.pool import empty
from olv_runtime.proto import StructTypeProto, TensorProto
from olv_runtime.structs import Catalogue
from olv_runtime.structs.initializers import AffineValue

ggml = lazy_module("olv_runtime.structs.ggml")  # the block declarations: GGUF models only
ggml_packed = lazy_module("olv_runtime.kernels.ggml_packed")  # the block kernels: GGUF only

# olv_runtime.structs.ggml (the block declarations, with the graph helper) is imported by the
# functions that verify a ggml value: a session on a model with no ggml value never needs it


__all__ = ["linear_weight", "PlanesWeight", "GGMLWeight", "GGMLGather", "FAST_TYPES",
           "BLOCK_KERNEL_TYPES"]

FAST_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K")
#: types read by their own block kernels (kernels/ggml_packed.py) instead of INT4 planes
BLOCK_KERNEL_TYPES = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")
_CANON: dict[tuple, tuple] = {}
_ROWS = 256  # rows repacked per chunk (bounds the temporaries)


class PlanesWeight:
    """A ggml weight as INT4 planes (each an :class:`AffineValue`, block 32) plus an optional
    per-block float offset ``[N, K/32]``; ``shape = (N, K)``."""

    def __init__(self, name, planes, offset):
        self.name = name
        self.planes = planes
        self.offset = offset
        self.shape = planes[0].shape

    @property
    def nbytes(self) -> int:
        return sum(p.codes.nbytes + p.scale.nbytes for p in self.planes) + (
            self.offset.nbytes if self.offset is not None else 0)


class GGMLWeight:
    """A verified ggml weight read in place: ``blocks`` uint8 ``[N, K / block_size,
    type_size]`` is a view of the value's payload (the .gguf's mapped pages, no copy).
    :class:`~olv_runtime.executor.steps.LinearStep` repacks it into the group records of
    :mod:`olv_runtime.kernels.ggml_packed` at session creation (same bits per weight);
    :class:`GGMLGather` dequantizes only the looked-up rows from it."""

    def __init__(self, name, type_name, blocks, n, k):
        self.name = name
        self.type_name = type_name
        self.ggml_kind = self.kind = ggml_packed.KINDS[type_name]
        self.blocks = blocks
        self.shape = (int(n), int(k))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)


def release_pages(blocks: np.ndarray) -> int:
    """Tell the kernel this process no longer needs the resident pages of a file-mapped weight
    (``madvise(MADV_DONTNEED)`` on the whole pages inside ``blocks``) once its records exist: the
    .gguf's bytes are unchanged (read-only mapping; the pages stay in the page cache and a later
    read, e.g. an embedding row, faults them back in), only the process's RSS no longer counts
    them. Returns the bytes advised (0 where unsupported or when ``blocks`` owns its memory)."""
    if not sys.platform.startswith("linux") or blocks.base is None or blocks.flags.writeable:
        return 0
    page = _mmap.PAGESIZE
    start = blocks.ctypes.data
    a = -(-start // page) * page
    b = ((start + blocks.nbytes) // page) * page
    if b <= a:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), ctypes.c_int(4))  # DONTNEED
    except (OSError, AttributeError):
        return 0
    return b - a if rc == 0 else 0


class GGMLGather:
    """``Gather(Decode(W), ids, axis=0)`` for a :class:`GGMLWeight`: dequantizes only the rows
    ``ids`` (negative ids count from the end, as ONNX Gather), with gguf-py's float32 operations
    (equal to the FunctionProto decoder bit for bit). Output float32 ``[*ids.shape, K]``."""

    def __init__(self, name: str, weight: GGMLWeight):
        self.name = name
        self.w = weight

    def __call__(self, ids):
        if ids.dtype not in (np.int64, np.int32):
            raise InvalidArgument(
                f"node {self.name!r} (Gather): indices must be int64 or int32, got {ids.dtype}")
        n, k = self.w.shape
        flat = np.asarray(ids, np.int64).reshape(-1)
        if flat.size and (flat.min() < -n or flat.max() >= n):
            bad = flat[(flat < -n) | (flat >= n)][0]
            raise InvalidArgument(f"node {self.name!r} (Gather): index {int(bad)} out of range "
                                  f"[-{n}, {n - 1}] for {self.w.name!r} ({n} rows)")
        out = empty(ids.shape + (k,), np.float32)  # the session's pooled output buffer
        out.reshape(-1, k)[...] = ggml_packed.dequantize_rows(self.w.kind, self.w.blocks[flat % n])
        return (out,)


def _verified(value) -> ggml.GGMLBlock | None:
    """The ggml block of a StructValue whose declaration is the canonical ggml row type."""
    decl = value.root.declaration
    meta = {p.key: p.value for p in decl.metadata_props}
    name = meta.get("ggml.type")
    if name not in FAST_TYPES or value.logical is None:
        return None
    try:
        k = int(meta["ggml.row_length"])
        flat = bool(int(meta.get("ggml.flat", "0")))
    except (KeyError, ValueError):
        return None
    key = (name, k, flat)
    if key not in _CANON:
        decls = ggml.declarations([key])
        b = ggml.BLOCKS[name]
        root = Catalogue(decls).root(_type_ref(ggml.row_type_id(b, k, flat)), "canonical")
        _CANON[key] = (decls[-1], root.layout.signature())
    canon, signature = _CANON[key]
    if decl != canon or value.root.layout.signature() != signature or flat:
        return None
    et, shape = value.logical
    if len(shape) != 2 or shape[1] != k or shape[0] != value.records:
        return None
    return ggml.BLOCKS[name]


def _type_ref(type_id):
    st = StructTypeProto()
    st.type_ref = type_id
    return st


def _f16(blocks, start) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(
        np.float32)


def _pack(codes: np.ndarray) -> np.ndarray:
    """Signed codes ``[R, K]`` (-8..7, int8/uint8 two's complement) -> row-major INT4 bytes."""
    c = codes.astype(np.uint8) & np.uint8(15)
    return (c[:, 0::2] | (c[:, 1::2] << np.uint8(4))).reshape(-1)


def _nibbles32(qs):
    """Q4_0-order nibbles [R, nb, 16] -> values [R, nb, 32] in element order."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _kscales(sc12):
    d_, m_, md = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    sc = np.concatenate([d_ & 63, (md & 15) | ((d_ >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m_ & 63, (md >> 4) | ((m_ >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs):
    """Q4_K/Q5_K qs [R, nb, 128] -> [R, nb, 8, 32] sub-block values."""
    r, nb = qs.shape[:2]
    q = qs.reshape(r, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(r, nb, 8, 32)


def _k_high(qh):
    r, nb = qh.shape[:2]
    h = qh.reshape(r, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    return (h & np.uint8(1)).reshape(r, nb, 8, 32)


def _repack_rows(b: ggml.GGMLBlock, blocks: np.ndarray):
    """blocks uint8 [R, nb, type_size] -> (codes per plane [R, K] int8, scales per plane
    [R, K/32] float32, offset [R, K/32] float32 or None)."""
    r, nb = blocks.shape[:2]
    name = b.name
    if name in ("Q4_1", "Q5_1"):
        d = _f16(blocks, 0)                                   # [R, nb]
        m = _f16(blocks, 2)
        pos = 4
        qh = None
        if name == "Q5_1":
            qh = np.ascontiguousarray(blocks[..., pos:pos + 4]).view("<u4")[..., 0]  # [R, nb]
            pos += 4
        lo = _nibbles32(blocks[..., pos:pos + 16]).astype(np.int16) - 8
        codes, scales = [lo.reshape(r, -1)], [d]
        if qh is not None:  # Q5_1: w = d (lo + 16 h) + m
            h = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
            codes.append(h.astype(np.int16).reshape(r, -1))
            scales.append(16 * d)
        return codes, scales, 8 * d + m  # d (lo - 8) [+ 16 d h] + (8 d + m)
    # Q5_K: 8 sub-blocks of 32 per super-block
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _kscales(blocks[..., 4:16])
    big_d = (d[..., None] * sc).reshape(r, nb * 8)
    big_m = (dmin[..., None] * mn).reshape(r, nb * 8)
    h = _k_high(blocks[..., 16:48])
    lo = _k_nibbles(blocks[..., 48:176]).astype(np.int16) - 8
    return ([lo.reshape(r, -1), h.astype(np.int16).reshape(r, -1)], [big_d, 16 * big_d],
            8 * big_d - big_m)


def _affine(name, codes_bytes, scale, n, k) -> AffineValue:
    return AffineValue(name=name, storage_type=TensorProto.INT4, bits=4, signed=True,
                       shape=(n, k), elem_type=TensorProto.FLOAT, axis=1, block_size=32,
                       scale=scale, zero_point=None, codes=codes_bytes)


def linear_weight(value, counters=None):
    """The repacked form of a ggml struct value for the linear / gather kernels, or None.

    Parameters
    ----------
    value : StructValue
        A validated value (``olv_runtime.decoding.resolve``) of a ggml row type, ``[N, K]``.
    counters : Counters, optional
        Receives ``bytes_repacked`` (bytes of the repacked codes, scales and offsets).

    Returns
    -------
    AffineValue, PlanesWeight or None
        Q4_0: an :class:`AffineValue` (symmetric INT4, block 32, float16 scales); other
        :data:`FAST_TYPES`: a :class:`PlanesWeight`; None when the declaration is not the
        canonical ggml row type (it then decodes through its FunctionProto) or the type has no
        native consumer. Cached on the value (a tied embedding is repacked once).
    """
    cached = getattr(value, "_ggml_repack", False)
    if cached is not False:
        return cached
    b = _verified(value)
    out = None
    if b is not None and b.name in BLOCK_KERNEL_TYPES:
        n, k = value.logical[1]
        blocks = value.payload.reshape(n, k // b.block_size, b.type_size)
        out = GGMLWeight(value.name, b.name, blocks, n, k)
    elif b is not None and b.name == "Q4_0":  # one compiled pass: codes u ^ 8, d bits as is
        n, k = value.logical[1]
        blocks = value.payload.reshape(n, k // 32, 18)
        codes, scales = ggml_packed.q4_0_to_int4(blocks)
        release_pages(blocks)  # the INT4 form is what the kernels read from now on
        out = _affine(value.name, codes, scales, n, k)
        object.__setattr__(out, "_ggml_q4_0", True)  # release_repacks may drop its codes
        if counters is not None:
            counters.add("bytes_repacked", codes.nbytes + scales.nbytes)
    elif b is not None:
        n, k = value.logical[1]
        nb = k // b.block_size
        blocks = value.payload.reshape(n, nb, b.type_size)
        codes, scales, offset = None, None, None
        for r0 in range(0, n, _ROWS):
            c, s, o = _repack_rows(b, blocks[r0:r0 + _ROWS])
            if codes is None:
                codes = [np.empty(n * k // 2, np.uint8) for _ in c]
                # the planes hold products of the block's scales: float32
                scales = [np.empty((n, k // 32), np.float32) for _ in s]
                offset = np.empty((n, k // 32), np.float32) if o is not None else None
            for p in range(len(c)):
                codes[p][r0 * k // 2:(r0 + c[p].shape[0]) * k // 2] = _pack(c[p])
                scales[p][r0:r0 + s[p].shape[0]] = s[p].reshape(s[p].shape[0], -1)
            if o is not None:
                offset[r0:r0 + o.shape[0]] = o.reshape(o.shape[0], -1)
        planes = [_affine(value.name if i == 0 else f"{value.name}::plane{i}", codes[i],
                          scales[i], n, k) for i in range(len(codes))]
        out = planes[0] if len(planes) == 1 and offset is None else \
            PlanesWeight(value.name, planes, offset)
        if counters is not None:
            counters.add("bytes_repacked", sum(c.nbytes for c in codes)
                         + sum(s.nbytes for s in scales)
                         + (offset.nbytes if offset is not None else 0))
    try:
        value._ggml_repack = out
    except AttributeError:  # pragma: no cover - StructValue has a __dict__
        pass
    return out
