"""The block table of the paged attention kernel and the chunk sides its rows point into.

Block storage (see :mod:`olv_runtime.kv.paged` and the format table of
:mod:`.paged_attention`): block slots live in *chunks*, one chunk holding ``capacity`` slots of
one side (K or V) in one format. :class:`ChunkSide` is one such side as the kernels see it; a
block-table row (:func:`table_row`, int64 [:data:`TABLE_COLS`]) holds per side the format code,
the slot's raw address, its scale address and per-token-scale flag, then the block's first
position and its valid tokens.
"""
from __future__ import annotations

import numpy as np
from numba import types

from olv_runtime.errors import InvalidArgument

__all__ = ["FORMAT_CODES", "F16_TABLE", "TABLE_COLS", "ChunkSide", "dummy_side", "table_row"]

#: Block format name -> kernel code.
FORMAT_CODES = {"float32": 0, "float16": 1, "int8": 2, "int4": 3, "codebook2": 4}

#: float16 bits -> float32, exact (numba has no float16 arithmetic).
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_F32 = types.Array(types.float32, 4, "A")
_U16 = types.Array(types.uint16, 4, "A")
_COD = types.Array(types.uint8, 5, "A")
_SCL = types.Array(types.float32, 4, "A")
_TAB = types.Array(types.float32, 1, "A")
_SIDE = (types.int64, _F32, _U16, _COD, _SCL, _TAB)

#: Columns of a block-table row (int64): format and slot addresses of the key and value sides,
#: position of the block's first token, valid tokens.
T_KFMT, T_KADDR, T_KSADDR, T_KPT, T_VFMT, T_VADDR, T_VSADDR, T_VPT, T_START, T_LEN = range(10)
TABLE_COLS = 10


class ChunkSide:
    """The kernel arrays of one side (K or V) of one chunk (see the module table).

    Attributes
    ----------
    fmt : int
        Format code (:data:`FORMAT_CODES`).
    f32, u16, codes, scale, table : numpy.ndarray
        The format's arrays (dummies for the others).
    row_bytes : int
        Payload bytes the kernel reads per token and kv head (codes + its share of scales).
    """

    __slots__ = ("fmt", "f32", "u16", "codes", "scale", "table", "row_bytes", "addr", "stride",
                 "saddr", "sstride", "per_token")

    def __init__(self, fmt, f32=None, u16=None, codes=None, scale=None, table=None, row_bytes=0):
        self.fmt = int(fmt)
        self.f32 = _DUMMY_F32 if f32 is None else f32
        self.u16 = _DUMMY_U16 if u16 is None else u16
        self.codes = _DUMMY_COD if codes is None else codes
        self.scale = _DUMMY_SCL if scale is None else scale
        self.table = _DUMMY_TAB if table is None else table
        self.row_bytes = int(row_bytes)
        self._addresses()

    def _addresses(self):
        """Slot addresses for the block table (:func:`table_row`): ``addr + slot * stride`` is
        the slot's first byte (``[KVH, BS, ...]`` C-order inside a slot, checked), likewise
        ``saddr``/``sstride`` for INT8/INT4 scales (codebook2: ``saddr`` is the codebook)."""
        fmt = self.fmt
        main = (self.f32, self.u16, self.codes, self.codes, self.codes)[fmt]
        if fmt != 4 and not _slot_contiguous(main):
            raise InvalidArgument(f"block storage: expected C-ordered slots, got strides "
                                  f"{main.strides} for shape {list(main.shape)}")
        self.addr = int(main.__array_interface__["data"][0])
        self.stride = int(main.strides[0])
        self.saddr, self.sstride, self.per_token = 0, 0, 0
        if fmt in (2, 3):
            if not _slot_contiguous(self.scale):
                raise InvalidArgument("block scales: expected C-ordered slots")
            self.saddr = int(self.scale.__array_interface__["data"][0])
            self.sstride = int(self.scale.strides[0])
            self.per_token = int(self.scale.shape[2] > 1)
        elif fmt == 4:
            if self.codes.strides[1:] != (self.codes.shape[2] * self.codes.shape[3] * 12,
                                          self.codes.shape[3] * 12, 12, 1):
                raise InvalidArgument("codebook blocks: expected contiguous 12-byte records")
            self.table = np.ascontiguousarray(self.table, np.float32)
            self.saddr = int(self.table.__array_interface__["data"][0])

    def slot_row(self, slot: int):
        """(format, slot address, scale address, per-token flag) of one slot."""
        return (self.fmt, self.addr + slot * self.stride, self.saddr + slot * self.sstride,
                self.per_token)

    def args(self):
        return (self.fmt, self.f32, self.u16, self.codes, self.scale, self.table)


_DUMMY_F32 = np.zeros((1, 1, 1, 1), np.float32)
_DUMMY_U16 = np.zeros((1, 1, 1, 1), np.uint16)
_DUMMY_COD = np.zeros((1, 1, 1, 1, 1), np.uint8)
_DUMMY_SCL = np.zeros((1, 1, 1, 1), np.float32)
_DUMMY_TAB = np.zeros(1, np.float32)


def _slot_contiguous(a: np.ndarray) -> bool:
    """True when every ``a[i]`` is C-contiguous (the leading stride may be anything)."""
    st = a.itemsize
    for n, s in zip(reversed(a.shape[1:]), reversed(a.strides[1:])):
        if n > 1 and s != st:
            return False
        st *= n
    return True


def dummy_side() -> ChunkSide:
    return ChunkSide(0)

def table_row(kside: ChunkSide, kslot: int, vside: ChunkSide, vslot: int, start: int,
              length: int) -> tuple:
    """One block-table row (see :data:`TABLE_COLS`)."""
    return (*kside.slot_row(kslot), *vside.slot_row(vslot), int(start), int(length))
