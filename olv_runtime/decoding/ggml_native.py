"""Native consumers of ggml row types: GGUF blocks for the fast kernels.

At session creation a linear layer (``olv.Decode -> Transpose -> MatMul``) or an embedding gather
whose weight is a ggml struct value asks :func:`linear_weight` for a form the fast kernels read.
Following seed 000 ("Native bindings are keyed by type_id and verify the resolved declaration
before creating a typed view"), the consumer registered for a ggml type first checks that the
value's resolved root declaration *is* the canonical row declaration of
:mod:`olv_runtime.structs.ggml` (same fields, bit packing, metadata and decoder) and that its
record layout has the canonical signature; any other declaration under such a type_id is left
to its FunctionProto decoder. Never a float copy of a weight:

* Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (:data:`BLOCK_KERNEL_TYPES`): a :class:`GGMLWeight`
  -- the payload's blocks in place. :class:`~olv_runtime.executor.steps.LinearStep` repacks them
  into the group records of :mod:`olv_runtime.kernels.ggml_packed` (the file's bits per weight,
  int8-activation VNNI / AVX2 and exact kernels); :class:`GGMLGather` dequantizes only
  looked-up rows.
* Q4_0: exactly the symmetric INT4 block-32 affine form of the converter (float16 scales kept,
  4.5 bits per weight as in the file), so it takes every INT4 fast path.

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


__all__ = ["linear_weight", "GGMLWeight", "GGMLGather", "FAST_TYPES", "BLOCK_KERNEL_TYPES"]

FAST_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K")
#: types read by their own block kernels (kernels/ggml_packed.py); Q4_0 is the INT4 form
BLOCK_KERNEL_TYPES = ("Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K")
_CANON: dict[tuple, tuple] = {}


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
    AffineValue, GGMLWeight or None
        Q4_0: an :class:`AffineValue` (symmetric INT4, block 32, float16 scales); the
        :data:`BLOCK_KERNEL_TYPES`: a :class:`GGMLWeight` (the payload's blocks, no copy); None
        when the declaration is not the
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
    try:
        value._ggml_repack = out
    except AttributeError:  # pragma: no cover - StructValue has a __dict__
        pass
    return out
