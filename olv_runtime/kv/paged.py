"""Paged KV cache with per-block encodings (seed 000 "Quantized and paged caches use the same
feedback", PR06; DESIGN §3 "KV caches").

The cache of one layer is an ordinary struct value retained by ``persistent_bindings``::

    KVBlock (type_id 3002) = struct {key: FLOAT[KVH, BS, D], value: FLOAT[KVH, BS, D],
                                     start: INT64, length: INT64}
    PagedKVCache (type_id 3001) = struct {blocks: sequence<KVBlock>, length: INT64}

At runtime (:class:`~olv_runtime.structs.runtime.RuntimeStruct`) each block's ``key`` and
``value`` is one of: a dense float32 or float16 array, an :class:`~olv_runtime.structs.initializers.AffineValue`
(INT8 or INT4, symmetric, scales per token and head — blocked along axis 2 with block_size D,
scale ``[KVH, BS, 1]`` — or per block and head — per-axis along axis 0, scale ``[KVH]``), or a
:class:`~olv_runtime.structs.value.StructValue` of the codebook type 1102 of seed 000
(``SCALED_CODEBOOK2_BLOCK_32``: 32 two-bit indices into the constant codebook of type 1101 and a
FLOAT scale per record; records run over ``[KVH, BS, D]`` row-major). Their logical type is always
``FLOAT[KVH, BS, D]``; ``start`` is the block's first token position, ``length`` its valid tokens.

Bookkeeping here is plain Python (vLLM's block-pool idea); the kernels see arrays only:

* **Chunks.** Block slots are carved from *chunks*: one numpy allocation of ``chunk_blocks`` slots
  of one side (K or V) in one format. A block's field values are read-only views of its slot, so
  the value object owns nothing new and retaining it copies nothing. Slots are never reused: a
  chunk is released by the garbage collector when no block view refers to it any more, so every
  view handed out stays valid (seed 000 "Returned views stay valid").
* **Append.** New tokens go into the newest block while it is dense and not full. Like the
  contiguous cache (:mod:`olv_runtime.kv.contiguous`), a slot remembers its *committed fill*; a cache
  whose newest block ends at the committed fill appends in place (writing only the new tokens),
  any other (a second state branched from the same cache) copies the block's valid tokens into a
  new slot first (``bytes_copied_kv_prefix``).
* **Sealing.** A block is sealed when full. After the call's attention has read it dense, the
  :class:`~olv_runtime.kv.seal.SealPolicy` decides each sealed block's format by its age (0 = newest sealed block),
  e.g. ``float32:2,int8:6,int4``: the 2 newest sealed blocks stay float32, the next 6 INT8, the
  rest INT4. Conversion writes a new slot (``bytes_kv_converted``); the older cache value keeps
  its own block.
* **Attention** (:func:`olv_runtime.kernels.paged_attention.paged_attention`) streams over the
  value's block table (raw slot addresses per block), decoding one block and kv head at a
  time into an L1 scratch inside the kernel. The compiled decode step
  (:class:`olv_runtime.executor.paged_decoder_step.PagedDecoderStack`) uses :meth:`PagedKV.decode_begin` /
  :meth:`PagedKV.decode_end` around its driver instead of :meth:`PagedKV.run`; its block
  table is updated in place while the cache value it belongs to is the newest of its lineage.

Blocks that were not made here (a cache built by the caller) are *adopted*: their fields are
viewed as single-slot chunks (no copy); they are read, never written.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import paged_attention as pk
from olv_runtime.kv.seal import _DENSE, PRESETS, SealPolicy
from olv_runtime.pool import owner
from olv_runtime.proto import StructTypeProto, TensorProto, TypeProto
from olv_runtime.structs.catalogue import Catalogue
from olv_runtime.structs.examples import codebook2_1101, scaled_codebook2_1102
from olv_runtime.structs.initializers import AffineValue
from olv_runtime.structs.runtime import RuntimeStruct, SharedPrefix
from olv_runtime.structs.value import StructValue

__all__ = ["KV_CACHE_TYPE_ID", "KV_BLOCK_TYPE_ID", "PRESETS", "SealPolicy", "Geometry",
           "kv_block_type", "kv_cache_type", "empty_paged_cache", "PagedKV", "block_counts",
           "block_format", "DEFAULT_BLOCK_SIZE"]

KV_CACHE_TYPE_ID = 3001
KV_BLOCK_TYPE_ID = 3002
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHUNK_BLOCKS = 64

_QUANT = ("int8", "int4", "codebook2")


# -- declarations --------------------------------------------------------------------------------
def _tensor_type(elem, dims) -> TypeProto:
    tp = TypeProto()
    tp.tensor_type.elem_type = elem
    shape = tp.tensor_type.shape
    shape.SetInParent()
    for d in dims:
        shape.dim.add(dim_value=int(d))
    return tp


def kv_block_type(kv_heads: int, block_size: int, head_dim: int,
                  type_id: int = KV_BLOCK_TYPE_ID) -> StructTypeProto:
    """``KVBlock {key, value: FLOAT[KVH, BS, D]; start, length: INT64}`` (catalogue declaration)."""
    st = StructTypeProto(type_id=type_id, name="KVBlock")
    st.doc_string = ("One paged KV block: block_size tokens of all KV heads of one layer; key and "
                     "value may each be dense or encoded (logical type FLOAT[KVH, BS, D]); start = "
                     "position of the first token, length = valid tokens.")
    for name in ("key", "value"):
        st.structure.field.add(name=name).type.CopyFrom(
            _tensor_type(TensorProto.FLOAT, [kv_heads, block_size, head_dim]))
    for name in ("start", "length"):
        st.structure.field.add(name=name).type.CopyFrom(_tensor_type(TensorProto.INT64, []))
    return st


def kv_cache_type(type_id: int = KV_CACHE_TYPE_ID,
                  block_type_id: int = KV_BLOCK_TYPE_ID) -> StructTypeProto:
    """``PagedKVCache {blocks: sequence<KVBlock>, length: INT64}`` (catalogue declaration)."""
    st = StructTypeProto(type_id=type_id, name="PagedKVCache")
    st.doc_string = "A paged KV cache of one layer (seed 000 'Quantized and paged caches')."
    f = st.structure.field.add(name="blocks")
    f.type.sequence_type.elem_type.struct_type.type_ref = block_type_id
    st.structure.field.add(name="length").type.CopyFrom(_tensor_type(TensorProto.INT64, []))
    return st


def _scalar(v: int) -> np.ndarray:
    a = np.array(int(v), np.int64)
    a.flags.writeable = False
    return a


def empty_paged_cache() -> RuntimeStruct:
    """An empty cache value: no blocks, length 0."""
    return RuntimeStruct({"blocks": (), "length": _scalar(0)})


def block_counts(cache: RuntimeStruct) -> tuple[int, int]:
    """(number of blocks, valid tokens of the last block) of a cache value."""
    blocks = cache["blocks"]
    return len(blocks), (int(blocks[-1]["length"]) if blocks else 0)


def block_format(field) -> str:
    """Format name of a block's key or value field (float32, float16, int8, int4, codebook2)."""
    if isinstance(field, np.ndarray):
        return "float16" if field.dtype == np.float16 else "float32"
    if isinstance(field, AffineValue):
        return {TensorProto.INT8: "int8", TensorProto.INT4: "int4"}.get(field.storage_type, "?")
    if getattr(field, "type_id", None) == 1102:
        return "codebook2"
    return "?"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """``KVH`` kv heads, ``block_size`` tokens per block, ``head_dim`` D."""

    kv_heads: int
    block_size: int
    head_dim: int


# -- chunks --------------------------------------------------------------------------------------
_CODEBOOK_ROOT = None


def _codebook_root():
    global _CODEBOOK_ROOT
    if _CODEBOOK_ROOT is None:
        st = StructTypeProto()
        st.type_ref = 1102
        _CODEBOOK_ROOT = Catalogue([codebook2_1101(), scaled_codebook2_1102()]).root(
            st, "KV codebook block")
    return _CODEBOOK_ROOT


def _codebook_table() -> np.ndarray:
    return np.array(_codebook_root().layout.constant("quantized.codebook").value, np.float32)


class _CodebookDecoder:
    """Decoder of a type-1102 KV block to FLOAT[KVH, BS, D] (reference path; attention never
    calls it)."""

    def decode(self, value) -> np.ndarray:
        idx = value.field("quantized.codes.index").astype(np.int64)  # [records, 32]
        table = value.field("quantized.codebook")
        scale = value.field("scale")  # [records]
        return (table[idx] * scale[:, None]).astype(np.float32).reshape(value.logical[1])


_CB_DECODER = _CodebookDecoder()


class Chunk:
    """``capacity`` block slots of one side (K or V) in one format.

    Attributes
    ----------
    fmt : str
    side : ChunkSide
        The kernel arrays.
    fill : list of int
        Committed fill (tokens) per slot: a slot may be appended in place only by a cache whose
        newest block ends exactly there.
    foreign : bool
        A single-slot view of a caller-made block (read only).
    slot_bytes : int
        Payload bytes of one slot (codes + scales).
    """

    def __init__(self, fmt: str, geom: Geometry, capacity: int, scales: str = "token",
                 foreign: bool = False):
        self.fmt = fmt
        self.geom = geom
        self.capacity = capacity
        self.used = 0
        self.fill = [0] * capacity
        self.foreign = foreign
        self.scales = scales
        self._storage = None

    @classmethod
    def allocate(cls, fmt: str, geom: Geometry, capacity: int, scales: str) -> "Chunk":
        c = cls(fmt, geom, capacity, scales)
        kvh, bs, d = geom.kv_heads, geom.block_size, geom.head_dim
        code = pk.FORMAT_CODES[fmt]
        if fmt == "float32":
            c.data = np.zeros((capacity, kvh, bs, d), np.float32)
            c.side = pk.ChunkSide(code, f32=c.data, row_bytes=4 * d)
        elif fmt == "float16":
            c.data = np.zeros((capacity, kvh, bs, d), np.float16)
            c.side = pk.ChunkSide(code, u16=c.data.view(np.uint16), table=pk.F16_TABLE,
                                  row_bytes=2 * d)
        elif fmt in ("int8", "int4"):
            w = d if fmt == "int8" else d // 2
            c.codes = np.zeros((capacity, kvh * bs * w), np.uint8)
            if scales == "token":
                c.scale = np.zeros((capacity, kvh, bs, 1), np.float32)
                sview = c.scale
            else:
                c.scale = np.zeros((capacity, kvh), np.float32)
                sview = c.scale.reshape(capacity, kvh, 1, 1)
            c.side = pk.ChunkSide(code, codes=c.codes.reshape(capacity, kvh, bs, 1, w),
                                  scale=sview, row_bytes=w + (4 if scales == "token" else 0))
        else:  # codebook2: records of 8 code bytes + FLOAT scale over [KVH, BS, D]
            ng = d // 32
            c.payload = np.zeros((capacity, kvh * bs * ng * 12), np.uint8)
            rec = c.payload.reshape(capacity, kvh, bs, ng, 12)
            c.side = pk.ChunkSide(code, codes=rec[..., :8],
                                  scale=rec[..., 8:12].view(np.float32)[..., 0],
                                  table=_codebook_table(), row_bytes=12 * ng)
        c.slot_bytes = c.field_nbytes()
        return c

    def storage(self) -> tuple:
        """The arrays owning this chunk's buffers (the ones its block field views point into)."""
        st = self._storage
        if st is None:
            arrs = {"float32": ("data",), "float16": ("data",), "int8": ("codes", "scale"),
                    "int4": ("codes", "scale"), "codebook2": ("payload",)}[self.fmt]
            st = self._storage = tuple(owner(getattr(self, a)) for a in arrs)
        return st

    def field_nbytes(self) -> int:
        g = self.geom
        n = g.kv_heads * g.block_size * g.head_dim
        return {"float32": 4 * n, "float16": 2 * n, "int8": n, "int4": n // 2,
                "codebook2": n // 32 * 12}[self.fmt] + (
            4 * g.kv_heads * (g.block_size if self.scales == "token" else 1)
            if self.fmt in ("int8", "int4") else 0)

    def field(self, slot: int):
        """The block field value of ``slot`` (a read-only view or an encoded value over it)."""
        g = self.geom
        shape = (g.kv_heads, g.block_size, g.head_dim)
        if self.fmt in _DENSE:
            v = self.data[slot]
            v.flags.writeable = False
            return v
        if self.fmt in ("int8", "int4"):
            codes = self.codes[slot]
            codes.flags.writeable = False
            scale = self.scale[slot]
            scale.flags.writeable = False
            st = TensorProto.INT8 if self.fmt == "int8" else TensorProto.INT4
            if self.scales == "token":
                return AffineValue("kv_block", st, 8 if self.fmt == "int8" else 4, True, shape,
                                   TensorProto.FLOAT, 2, g.head_dim, scale, None, codes)
            return AffineValue("kv_block", st, 8 if self.fmt == "int8" else 4, True, shape,
                               TensorProto.FLOAT, 0, None, scale, None, codes)
        payload = self.payload[slot]
        payload.flags.writeable = False
        sv = StructValue("kv_block", _codebook_root(), payload, payload.size // 12,
                         (TensorProto.FLOAT, shape))
        sv.decoder = _CB_DECODER
        return sv

    @classmethod
    def adopt(cls, value, geom: Geometry, what: str) -> "Chunk":
        """A read-only single-slot chunk viewing a caller-made block field (no copy)."""
        kvh, bs, d = geom.kv_heads, geom.block_size, geom.head_dim
        if isinstance(value, np.ndarray):
            if value.shape != (kvh, bs, d):
                raise InvalidArgument(f"{what}: expected shape {[kvh, bs, d]}, got {list(value.shape)}")
            if value.dtype == np.float32:
                c = cls("float32", geom, 1, foreign=True)
                c.side = pk.ChunkSide(0, f32=value[None], row_bytes=4 * d)
            elif value.dtype == np.float16:
                c = cls("float16", geom, 1, foreign=True)
                c.side = pk.ChunkSide(1, u16=value.view(np.uint16)[None], table=pk.F16_TABLE,
                                      row_bytes=2 * d)
            else:
                raise InvalidArgument(f"{what}: dense blocks are float32 or float16, got {value.dtype}")
            c.data = value[None]
            return c
        if isinstance(value, AffineValue):
            fmt = {TensorProto.INT8: "int8", TensorProto.INT4: "int4"}.get(value.storage_type)
            per_token = value.axis == 2 and value.block_size == d
            per_block = value.axis == 0 and value.block_size is None
            if (fmt is None or value.zero_point is not None or value.scale.dtype != np.float32
                    or tuple(value.shape) != (kvh, bs, d) or not (per_token or per_block)
                    or (fmt == "int4" and d % 2)):
                raise InvalidArgument(
                    f"{what}: unsupported affine KV block (INT8/INT4 symmetric float32 scales, "
                    "per token and head — axis 2, block_size D — or per block and head — axis 0)")
            c = cls(fmt, geom, 1, "token" if per_token else "block", foreign=True)
            w = d if fmt == "int8" else d // 2
            c.side = pk.ChunkSide(pk.FORMAT_CODES[fmt], codes=value.codes.reshape(1, kvh, bs, 1, w),
                                  scale=np.ascontiguousarray(value.scale).reshape(
                                      1, kvh, bs if per_token else 1, 1),
                                  row_bytes=w + (4 if per_token else 0))
            return c
        if getattr(value, "type_id", None) == 1102 and value.record_bytes == 12 and d % 32 == 0:
            if value.records * 32 != kvh * bs * d:
                raise InvalidArgument(f"{what}: {value.records} codebook records do not cover "
                                      f"[{kvh}, {bs}, {d}]")
            c = cls("codebook2", geom, 1, foreign=True)
            rec = value.payload.reshape(1, kvh, bs, d // 32, 12)
            table = np.array(value.field("quantized.codebook"), np.float32)
            c.side = pk.ChunkSide(4, codes=rec[..., :8], scale=rec[..., 8:12].view(np.float32)[..., 0],
                                  table=table, row_bytes=12 * (d // 32))
            return c
        raise InvalidArgument(f"{what}: no paged-attention reader for a {type(value).__name__} "
                              "block field (dense float32/float16, affine INT8/INT4, codebook 1102)")



class _BlockTable:
    """Per-block arrays of a cache value, for grouping the blocks by (K chunk, V chunk) with
    numpy instead of a Python loop per block: chunk ids ``kc``/``vc`` (indices into ``chunks``),
    slots ``ks``/``vs``, ``start``, ``length`` (int64 [n_blocks]). Immutable once built."""

    __slots__ = ("chunks", "ids", "kc", "vc", "ks", "vs", "start", "length", "_rows")

    @classmethod
    def extend(cls, prev, keep, blocks, refs):
        """A table whose first ``keep`` entries are ``prev``'s and the rest rebuilt from
        ``blocks``/``refs`` (``prev`` None: everything rebuilt)."""
        t = cls()
        n = len(blocks)
        if prev is None:
            keep = 0
            t.chunks, t.ids = [], {}
        else:
            keep = min(keep, len(prev.kc))
            t.chunks, t.ids = list(prev.chunks), dict(prev.ids)
        arrs = [np.empty(n, np.int64) for _ in range(6)]
        if keep:
            for a, pa in zip(arrs, (prev.kc, prev.vc, prev.ks, prev.vs, prev.start,
                                    prev.length)):
                a[:keep] = pa[:keep]
        ids, chunks = t.ids, t.chunks
        for i in range(keep, n):
            r, b = refs[i], blocks[i]
            for side, ch in ((0, r.kc), (1, r.vc)):
                k = ids.get(id(ch))
                if k is None or chunks[k] is not ch:
                    k = ids[id(ch)] = len(chunks)
                    chunks.append(ch)
                arrs[side][i] = k
            arrs[2][i] = r.ks
            arrs[3][i] = r.vs
            arrs[4][i] = int(b["start"])
            arrs[5][i] = int(b["length"])
        t.kc, t.vc, t.ks, t.vs, t.start, t.length = arrs
        return t

    def rows(self, kvh: int):
        """(block-table rows int64 [n, TABLE_COLS] for :func:`~..kernels.paged_attention.paged_attention`,
        KV bytes they make the kernel read); memoised (the table is immutable)."""
        r = getattr(self, "_rows", None)
        if r is not None:
            return r
        n = len(self.kc)
        attrs = np.array([(c.side.fmt, c.side.addr, c.side.stride, c.side.saddr, c.side.sstride,
                           c.side.per_token, c.side.row_bytes) for c in self.chunks],
                         np.int64).reshape(-1, 7)
        rows = np.empty((n, pk.TABLE_COLS), np.int64)
        for col, cid, slot in ((0, self.kc, self.ks), (4, self.vc, self.vs)):
            a = attrs[cid]
            rows[:, col] = a[:, 0]
            rows[:, col + 1] = a[:, 1] + slot * a[:, 2]
            rows[:, col + 2] = a[:, 3] + slot * a[:, 4]
            rows[:, col + 3] = a[:, 5]
        rows[:, pk.T_START] = self.start
        rows[:, pk.T_LEN] = self.length
        read = int((self.length * (attrs[self.kc, 6] + attrs[self.vc, 6])).sum()) * kvh if n else 0
        self._rows = (rows, read)
        return self._rows

    def groups(self):
        """[(K chunk, V chunk, ks, vs, starts, lengths)] with blocks in table order per group."""
        n = len(self.kc)
        if n == 0:
            return []
        key = self.kc * (len(self.chunks) + 1) + self.vc
        first = key[0]
        if (key == first).all():  # the common case: one (K chunk, V chunk) pair
            return [(self.chunks[int(self.kc[0])], self.chunks[int(self.vc[0])],
                     self.ks, self.vs, self.start, self.length)]
        order = np.argsort(key, kind="stable")
        sk = key[order]
        cuts = np.flatnonzero(np.diff(sk)) + 1
        out = []
        for sel in np.split(order, cuts):
            i0 = int(sel[0])
            out.append((self.chunks[int(self.kc[i0])], self.chunks[int(self.vc[i0])],
                        self.ks[sel], self.vs[sel], self.start[sel], self.length[sel]))
        return out


class _BlockIndex:
    """``meta`` of a cache value made by :meth:`PagedKV.run` or :meth:`PagedKV.decode_end`: its
    blocks' references and block table(s), so the next call on that value does no per-block
    Python work (a value from elsewhere is validated block by block). ``table`` (a
    :class:`_BlockTable`) or ``ptab``/``pver`` (the :class:`_PtrTable` of the compiled decode
    path and the version at which its rows were this value's) may be None."""

    __slots__ = ("owner", "blocks", "refs", "length", "table", "ptab", "pver")

    def __init__(self, owner, blocks, refs, length, table, ptab=None, pver=-1):
        self.owner, self.blocks, self.refs, self.length, self.table = (owner, blocks, refs,
                                                                       length, table)
        self.ptab, self.pver = ptab, pver


class _PtrTable:
    """Block-table rows of the newest cache value of one lineage, updated in place by the
    compiled decode path (:meth:`PagedKV.decode_begin`): ``rows`` int64 [capacity,
    TABLE_COLS] (first ``n`` valid), ``read`` KV bytes the kernel reads over them,
    ``committed`` slot bytes of the blocks. ``version`` grows at every in-place update; a
    cache value records the version its rows had (an older or branched value rebuilds)."""

    __slots__ = ("rows", "n", "version", "read", "committed", "owners", "foreign")

    def __init__(self, rows, n, read, committed, refs=()):
        self.rows, self.n, self.read, self.committed = rows, n, read, committed
        self.version = 0
        # buffers the blocks' fields live in: {id(storage): [storage nbytes, block sides]}
        self.owners: dict = {}
        self.foreign = 0  # block sides viewing caller-made arrays (no memoised accounting)
        for r in refs:
            self.hold(r.kc, 1)
            self.hold(r.vc, 1)

    def hold(self, chunk, k: int) -> None:
        """Count ``k`` more (or fewer) block sides stored in ``chunk``."""
        if chunk.foreign:
            self.foreign += k
            return
        for own in chunk.storage():
            e = self.owners.get(id(own))
            if e is None:
                e = self.owners[id(own)] = [own.nbytes, 0]
            e[1] += k
            if e[1] == 0:
                del self.owners[id(own)]

    def accounting(self, key, nblocks: int):
        """(payload bytes, {id: buffer bytes}) of the cache value with these blocks, as
        :func:`~olv_runtime.structs.runtime.payload_nbytes` and the state's buffer count would
        find them: the blocks' slots, their start/length scalars and the cache length (8 bytes
        each, under the synthetic key ``key``); None when a block is caller-made."""
        if self.foreign:
            return None
        own = {k: e[0] for k, e in self.owners.items()}
        own[key] = 8 * (2 * nblocks + 1)
        return self.committed + 8 * (2 * nblocks + 1), own

    @classmethod
    def build(cls, blocks, refs, table, kvh: int, spare: int = 64) -> "_PtrTable":
        n = len(blocks)
        rows = np.empty((max(2 * n, n + spare), pk.TABLE_COLS), np.int64)
        if table is not None and len(table.kc) == n:
            r, read = table.rows(kvh)
            rows[:n] = r
        else:
            read = 0
            for i, (b, ref) in enumerate(zip(blocks, refs)):
                ln = int(b["length"])
                rows[i] = pk.table_row(ref.kc.side, ref.ks, ref.vc.side, ref.vs, int(b["start"]),
                                       ln)
                read += ln * kvh * (ref.kc.side.row_bytes + ref.vc.side.row_bytes)
        committed = sum(r.kc.slot_bytes + r.vc.slot_bytes for r in refs)
        return cls(rows, n, read, committed, refs)

    def append(self, row) -> None:
        if self.n == self.rows.shape[0]:
            grown = np.empty((2 * self.n + 16, pk.TABLE_COLS), np.int64)
            grown[:self.n] = self.rows[:self.n]
            self.rows = grown
        self.rows[self.n] = row
        self.n += 1


class DecodeCall:
    """What :meth:`PagedKV.decode_begin` prepared for one compiled decode token: the block
    list with the new token's slot claimed, the block table (``ptab.rows[:ptab.n]``, the last
    row's length already counting the new token, which the kernel writes at ``t_in``)."""

    __slots__ = ("blocks", "refs", "ptab", "past", "t_in", "checked")

    def __init__(self, blocks, refs, ptab, past, t_in, checked=None):
        self.blocks, self.refs, self.ptab, self.past, self.t_in = blocks, refs, ptab, past, t_in
        # the declaration the past value was validated against, when the next value differs
        # from it only by a derived last block and the length (so it is valid against it too)
        self.checked = checked


class BlockRef:
    """``block.meta``: where a block's key and value live."""

    __slots__ = ("kc", "ks", "vc", "vs")

    def __init__(self, kc: Chunk, ks: int, vc: Chunk, vs: int):
        self.kc, self.ks, self.vc, self.vs = kc, ks, vc, vs


# -- the cache manager of one Attention node ----------------------------------------------------
class PagedKV:
    """Block allocation, append, sealing and attention for the caches of one layer's op.

    Shared by every state running the session (allocation and in-place claims take a lock);
    holds strong references only to the chunks currently being filled.

    Parameters
    ----------
    geom : Geometry
    policy : SealPolicy
    chunk_blocks : int
        Slots per chunk allocation.
    counters : Counters, optional
    """

    def __init__(self, geom: Geometry, policy: SealPolicy, chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
                 counters=None):
        if policy.key.find("int4") >= 0 or policy.value.find("int4") >= 0:
            if geom.head_dim % 2:
                raise InvalidArgument(f"int4 KV blocks need an even head_dim, got {geom.head_dim}")
        if "codebook2" in policy.key + policy.value and geom.head_dim % 32:
            raise InvalidArgument(f"codebook2 KV blocks need head_dim % 32 == 0, got {geom.head_dim}")
        self.geom = geom
        self.policy = policy
        self.chunk_blocks = int(chunk_blocks)
        self.counters = counters
        self._lock = threading.Lock()
        self._current: dict[str, Chunk] = {}
        self._local = threading.local()

    # -- allocation ------------------------------------------------------------------------------
    def _alloc(self, fmt: str) -> tuple[Chunk, int]:
        with self._lock:
            c = self._current.get(fmt)
            if c is None or c.used >= c.capacity:
                c = Chunk.allocate(fmt, self.geom, self.chunk_blocks, self.policy.scales)
                self._current[fmt] = c
                if self.counters is not None:
                    nbytes = c.slot_bytes * c.capacity
                    self.counters.add("arrays_allocated", 1)
                    self.counters.add("bytes_allocated", nbytes)
            slot = c.used
            c.used += 1
        if self.counters is not None:
            self.counters.add("kv_blocks_allocated", 1)
        return c, slot

    def _ref(self, block: RuntimeStruct, i: int) -> BlockRef:
        ref = block.meta
        if isinstance(ref, BlockRef) and ref.kc.geom == self.geom:
            return ref
        what = f"cache block {i}"
        ref = BlockRef(Chunk.adopt(block["key"], self.geom, what + ".key"), 0,
                       Chunk.adopt(block["value"], self.geom, what + ".value"), 0)
        ref.kc.fill[0] = ref.vc.fill[0] = -1  # never appended in place
        block.meta = ref
        return ref

    @staticmethod
    def _block(ref: BlockRef, start: int, length: int, like: RuntimeStruct | None = None):
        derived = like is not None and like.meta is ref
        if derived:
            fields = {"key": like["key"], "value": like["value"]}
        else:
            fields = {"key": ref.kc.field(ref.ks), "value": ref.vc.field(ref.vs)}
        fields["start"] = _scalar(start)
        fields["length"] = _scalar(length)
        b = RuntimeStruct(fields, ref)
        b._readonly = True
        if derived:  # the same key/value objects and valid INT64 scalars: still valid
            b._checked = like._checked
        return b

    # -- one call --------------------------------------------------------------------------------
    def run(self, cache: RuntimeStruct, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray,
            scale: float, is_causal: bool) -> tuple[np.ndarray, RuntimeStruct]:
        """Append ``S`` tokens, attend, seal; returns (output [S, H, D], the next cache value).

        Parameters
        ----------
        cache : RuntimeStruct
            The past cache (validated against the PagedKVCache type).
        q : float32 [S, H, D]; k_new, v_new : float32 [S, KVH, D]
            Queries and new keys/values (RoPE applied), C-contiguous.

        Raises
        ------
        InvalidArgument
            Inconsistent cache (lengths, block positions), unsupported block representations.
        """
        g = self.geom
        bs = g.block_size
        c = self.counters
        src_blocks = cache["blocks"]
        blocks = list(src_blocks)
        past = int(cache["length"])
        s = q.shape[0]
        idx = cache.meta
        if not (isinstance(idx, _BlockIndex) and idx.owner is self and idx.blocks is src_blocks
                and idx.length == past):
            idx = None  # a cache value this manager did not make: validate every block
        if idx is not None:
            refs = list(idx.refs)
        else:
            refs = [self._ref(b, i) for i, b in enumerate(blocks)]
            self._check_positions(blocks, past)
        n_past_blocks = len(blocks)
        # 1. append the new tokens (dense), in place when this cache owns the open slot's fill
        pos, j = past, 0
        if blocks and int(blocks[-1]["length"]) < bs and s:
            last, ref = blocks[-1], refs[-1]
            n = int(last["length"])
            take = min(bs - n, s)
            inplace = False
            if not ref.kc.foreign and ref.kc.fmt in _DENSE and ref.vc.fmt in _DENSE:
                with self._lock:
                    if ref.kc.fill[ref.ks] == n:
                        ref.kc.fill[ref.ks] = n + take  # claim before writing
                        inplace = True
            if not inplace:  # branched (or foreign/quantized) open block: copy its valid tokens
                ref = self._copy_open(ref, n)
                with self._lock:
                    ref.kc.fill[ref.ks] = n + take
            self._write(ref, n, k_new[:take], v_new[:take])
            blocks[-1] = self._block(ref, int(last["start"]), n + take, last if inplace else None)
            refs[-1] = ref
            pos, j = past + take, take
        while j < s:
            take = min(bs, s - j)
            kc, ks = self._alloc(self.policy.open_format)
            vc, vs = self._alloc(self.policy.open_format)
            ref = BlockRef(kc, ks, vc, vs)
            with self._lock:
                kc.fill[ks] = take
            self._write(ref, 0, k_new[j:j + take], v_new[j:j + take])
            blocks.append(self._block(ref, pos, take))
            refs.append(ref)
            pos += take
            j += take
        if c is not None and s:
            c.add("bytes_copied_kv_append", k_new.nbytes + v_new.nbytes)
        # 2. attention over every block (the new tokens still dense)
        out = np.empty(q.shape, np.float32)
        ws = self._workspace(s, q.shape[1])
        # blocks before `tail` are those of the past value, unchanged by the append (only its
        # last block may have grown or been copied) and by the sealing below (only the newest
        # horizon changes): their table entries are reused, the tail is rebuilt
        tail = max(0, min(n_past_blocks - 1,
                          len(blocks) - (self.policy.horizon + s // bs + 3)))
        table = _BlockTable.extend(idx.table if idx is not None else None, tail, blocks, refs)
        read = self._attend(q, table, past, scale, is_causal, out, ws)
        # 3. seal: full blocks take the policy's format for their age (only the newest
        #    horizon can change: older blocks already hold the oldest stage's format)
        total = past + s
        nfull = len(blocks) if blocks and int(blocks[-1]["length"]) == bs else max(len(blocks) - 1, 0)
        lo = max(0, nfull - (self.policy.horizon + s // bs + 2))
        for i in range(lo, nfull):
            if int(blocks[i]["length"]) != bs:
                continue
            want_k, want_v = self.policy.format_for(nfull - 1 - i)
            ref = refs[i]
            nk = self._convert(ref.kc, ref.ks, want_k)
            nv = self._convert(ref.vc, ref.vs, want_v)
            if nk is not None or nv is not None:
                kc, ks = nk or (ref.kc, ref.ks)
                vc, vs = nv or (ref.vc, ref.vs)
                refs[i] = BlockRef(kc, ks, vc, vs)
                blocks[i] = self._block(refs[i], int(blocks[i]["start"]), bs)
        new_blocks = tuple(blocks)
        table = _BlockTable.extend(table, min(tail, lo), blocks, refs)  # after sealing
        new = RuntimeStruct({"blocks": new_blocks, "length": _scalar(total)},
                            _BlockIndex(self, new_blocks, tuple(refs), total, table))
        new._readonly = True
        if c is not None:
            c.add("bytes_read_kv_attention", read)
            c.add("kv_committed_bytes", sum(r.kc.slot_bytes + r.vc.slot_bytes for r in refs))
        return out, new

    # -- the compiled decode path (one token; the kernel runs between begin and end) -----------
    def decode_begin(self, cache: RuntimeStruct) -> DecodeCall:
        """Append bookkeeping of one decode token, before the compiled step writes its key/value
        and attends (:class:`olv_runtime.executor.paged_decoder_step.PagedDecoderStack`).

        Claims the new token's slot (in place when this cache owns the open block's fill, a
        copy of the open block when branched, a new block when the last one is full), makes the
        block table: the past value's own rows updated in place when it is the newest of its
        lineage, else rebuilt. The caller must call :meth:`decode_end` after the kernel.

        Raises
        ------
        InvalidArgument
            Inconsistent cache (lengths, block positions), unsupported block representations.
        """
        g = self.geom
        bs = g.block_size
        src_blocks = cache["blocks"]
        past = int(cache["length"])
        idx = cache.meta
        if not (isinstance(idx, _BlockIndex) and idx.owner is self and idx.blocks is src_blocks
                and idx.length == past):
            idx = None
        if idx is not None:
            refs = idx.refs
        else:
            refs = tuple(self._ref(b, i) for i, b in enumerate(src_blocks))
            self._check_positions(src_blocks, past)
        pt = None
        if idx is not None and idx.ptab is not None:
            with self._lock:
                if idx.ptab.version == idx.pver:
                    pt = idx.ptab
                    pt.version += 1
        if pt is None:
            pt = _PtrTable.build(src_blocks, refs, idx.table if idx is not None else None,
                                 g.kv_heads)
        n = len(src_blocks)
        kvh = g.kv_heads
        checked = None
        if n and int(src_blocks[-1]["length"]) < bs:
            last, ref = src_blocks[-1], refs[-1]
            ln = int(last["length"])
            inplace = False
            if not ref.kc.foreign and ref.kc.fmt in _DENSE and ref.vc.fmt in _DENSE:
                with self._lock:
                    if ref.kc.fill[ref.ks] == ln:
                        ref.kc.fill[ref.ks] = ln + 1  # claim before writing
                        inplace = True
            if inplace:
                pt.rows[n - 1, pk.T_LEN] = ln + 1
                blk = self._block(ref, int(last["start"]), ln + 1, last)
                if blk._checked is not None:
                    checked = cache._checked
            else:  # branched (or foreign/quantized) open block: copy its valid tokens
                old = ref
                ref = self._copy_open(ref, ln)
                with self._lock:
                    ref.kc.fill[ref.ks] = ln + 1
                pt.rows[n - 1] = pk.table_row(ref.kc.side, ref.ks, ref.vc.side, ref.vs,
                                              int(last["start"]), ln + 1)
                pt.read += ln * kvh * (ref.kc.side.row_bytes + ref.vc.side.row_bytes
                                       - old.kc.side.row_bytes - old.vc.side.row_bytes)
                pt.committed += (ref.kc.slot_bytes + ref.vc.slot_bytes - old.kc.slot_bytes
                                 - old.vc.slot_bytes)
                for ch, k in ((ref.kc, 1), (ref.vc, 1), (old.kc, -1), (old.vc, -1)):
                    pt.hold(ch, k)
                blk = self._block(ref, int(last["start"]), ln + 1)
            blocks = SharedPrefix(src_blocks[:-1] + (blk,), (src_blocks, n - 1))
            refs = refs[:-1] + (ref,)
            t_in = ln
        else:
            kc, ks = self._alloc(self.policy.open_format)
            vc, vs = self._alloc(self.policy.open_format)
            ref = BlockRef(kc, ks, vc, vs)
            with self._lock:
                kc.fill[ks] = 1
            pt.append(pk.table_row(kc.side, ks, vc.side, vs, past, 1))
            pt.committed += kc.slot_bytes + vc.slot_bytes
            pt.hold(kc, 1)
            pt.hold(vc, 1)
            blocks = SharedPrefix(src_blocks + (self._block(ref, past, 1),), (src_blocks, n))
            refs = refs + (ref,)
            t_in = 0
        pt.read += kvh * (ref.kc.side.row_bytes + ref.vc.side.row_bytes)
        return DecodeCall(blocks, refs, pt, past, t_in, checked)

    def decode_end(self, call: DecodeCall, tally: list | None = None) -> RuntimeStruct:
        """Sealing after the compiled step (as :meth:`run`: a block that just filled and the
        blocks whose age moved them to the next stage of the policy are converted); returns
        the next cache value. The call's ``bytes_read_kv_attention`` and
        ``kv_committed_bytes`` go to the counters, or, with ``tally`` (a two-element list),
        are added to ``tally[0]`` / ``tally[1]`` for the caller to count once for all its
        layers (the same totals)."""
        bs = self.geom.block_size
        kvh = self.geom.kv_heads
        blocks, refs, pt = call.blocks, call.refs, call.ptab
        c = self.counters
        read = pt.read  # what the kernel read (before this call's sealing)
        if call.t_in == bs - 1:  # the last block is now full: ages moved by one
            nfull = len(blocks)
            lo = max(0, nfull - (self.policy.horizon + 2))
            bl, rl = None, None
            base = blocks.base
            for i in range(lo, nfull):
                if int(blocks[i]["length"]) != bs:
                    continue
                want_k, want_v = self.policy.format_for(nfull - 1 - i)
                ref = refs[i]
                nk = self._convert(ref.kc, ref.ks, want_k)
                nv = self._convert(ref.vc, ref.vs, want_v)
                if nk is not None or nv is not None:
                    if bl is None:
                        bl, rl = list(blocks), list(refs)
                    kc, ks = nk or (ref.kc, ref.ks)
                    vc, vs = nv or (ref.vc, ref.vs)
                    new = BlockRef(kc, ks, vc, vs)
                    rl[i] = new
                    bl[i] = self._block(new, int(blocks[i]["start"]), bs)
                    pt.rows[i] = pk.table_row(kc.side, ks, vc.side, vs, int(blocks[i]["start"]),
                                              bs)
                    pt.read += bs * kvh * (kc.side.row_bytes + vc.side.row_bytes
                                           - ref.kc.side.row_bytes - ref.vc.side.row_bytes)
                    pt.committed += (kc.slot_bytes + vc.slot_bytes - ref.kc.slot_bytes
                                     - ref.vc.slot_bytes)
                    for ch, k in ((kc, 1), (vc, 1), (ref.kc, -1), (ref.vc, -1)):
                        pt.hold(ch, k)
            if bl is not None:
                first = min(i for i in range(lo, nfull) if bl[i] is not blocks[i])
                blocks = SharedPrefix(bl, (base[0], min(base[1], first)))
                refs = tuple(rl)
        total = call.past + 1
        new = RuntimeStruct({"blocks": blocks, "length": _scalar(total)},
                            _BlockIndex(self, blocks, refs, total, None, pt, pt.version))
        new._readonly = True
        new._acct = pt.accounting(id(new), len(blocks))
        if call.checked is not None and blocks is call.blocks:  # nothing sealed
            new._checked = call.checked
        if tally is not None:
            tally[0] += read
            tally[1] += pt.committed
        elif c is not None:
            c.add("bytes_read_kv_attention", read)
            c.add("kv_committed_bytes", pt.committed)
        return new

    def _check_positions(self, blocks, past: int) -> None:
        n = 0
        bs = self.geom.block_size
        for i, b in enumerate(blocks):
            st, ln = int(b["start"]), int(b["length"])
            if st != n or not 0 < ln <= bs or (ln < bs and i != len(blocks) - 1):
                raise InvalidArgument(
                    f"cache block {i}: start {st}, length {ln}; expected start {n} and 1..{bs} "
                    "tokens (only the last block may be partly filled)")
            n += ln
        if n != past:
            raise InvalidArgument(f"cache: length field {past} differs from the blocks' {n} tokens")

    def _write(self, ref: BlockRef, t0: int, k: np.ndarray, v: np.ndarray) -> None:
        n = k.shape[0]
        ref.kc.data[ref.ks, :, t0:t0 + n, :] = k.transpose(1, 0, 2)
        ref.vc.data[ref.vs, :, t0:t0 + n, :] = v.transpose(1, 0, 2)

    def _copy_open(self, ref: BlockRef, n: int) -> BlockRef:
        fmt = self.policy.open_format
        kc, ks = self._alloc(fmt)
        vc, vs = self._alloc(fmt)
        new = BlockRef(kc, ks, vc, vs)
        for src, sslot, dst, dslot in ((ref.kc, ref.ks, kc, ks), (ref.vc, ref.vs, vc, vs)):
            if src.fmt not in _DENSE:
                raise InvalidArgument("cache: the newest, partly filled block must be dense "
                                      f"(float32/float16) to append to, got {src.fmt}")
            dst.data[dslot, :, :n] = src.data[sslot, :, :n]
        if self.counters is not None:
            self.counters.add("bytes_copied_kv_prefix",
                              kc.data[ks, :, :n].nbytes + vc.data[vs, :, :n].nbytes)
        return new

    def _convert(self, src: Chunk, slot: int, want: str):
        """Convert one side of a sealed block to ``want``; None when nothing changes."""
        if src.fmt == want or (want in _DENSE and src.fmt not in _DENSE) or (
                want == "float32" and src.fmt == "float16"):
            return None  # never widen: a block only moves to smaller formats
        dst, dslot = self._alloc(want)
        if want == "float16":
            dst.data[dslot] = src.data[slot]
        else:
            pk.convert_block(src.side, slot, self.geom.block_size, dst.side, dslot,
                             self.geom.head_dim)
        if self.counters is not None:
            self.counters.add("bytes_kv_converted", src.slot_bytes)
            self.counters.add("kv_blocks_converted", 1)
        return dst, dslot

    def _workspace(self, s: int, h: int):
        """Records the attention workspace of a call (the kernel's per-task scratch, allocated
        inside the kernel: bounded by the query count, independent of the context)."""
        if self.counters is not None:
            g = self.geom
            self.counters.set_max("attention_workspace_peak",
                                  pk.workspace_bytes(s, h, g.kv_heads, g.head_dim, g.block_size))
        return None

    def _attend(self, q, table, past, scale, causal, out, ws) -> int:
        """Run the kernel over the value's block table; returns KV bytes read."""
        rows, read = table.rows(self.geom.kv_heads)
        pk.paged_attention(q, rows, rows.shape[0], past, scale, causal, self.geom.kv_heads,
                           self.geom.block_size, out)
        return read
