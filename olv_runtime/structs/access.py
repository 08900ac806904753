"""Generic field access: a payload of records -> one array per leaf, shaped [records, *shape].

Byte-aligned fields (8/16/32/64-bit scalars at byte offsets and byte strides) come back as
zero-copy strided views of the payload (read-only; they keep the payload owner, e.g. the memory
map, alive; multi-byte views may be unaligned, which numpy handles). Every other field (sub-byte
integers, bit-packing components, scalars at bit offsets, BOOL) is unpacked by numba kernels:
bit widths 1..64, bits least-to-most significant, multi-byte values little-endian, sign
extension for signed types, every read inside ``[0, records * record_bytes)``.

Three tiers (as :mod:`olv_runtime.kernels`): serial ``_read_bits`` / ``_unpack_record``, the
parallel driver ``_unpack_par`` and the public :func:`unpack_leaf` / :func:`field_array`.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels.config import JIT, PJIT, check_array
from olv_runtime.structs.layout import Leaf

__all__ = ["unpack_leaf", "field_array"]



@njit(**JIT)
def _read_bits(payload, bitpos, bits):
    """``bits`` (1..64) bits of the LSB-first stream starting at bit ``bitpos``, as uint64."""
    byte = bitpos >> 3
    sh = bitpos & 7
    nbytes = (sh + bits + 7) >> 3
    v = np.uint64(payload[byte]) >> np.uint64(sh)
    acc = np.uint64(8 - sh)
    for k in range(1, nbytes):
        v |= np.uint64(payload[byte + k]) << acc
        acc += np.uint64(8)
    if bits < 64:
        v &= (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    return v


@njit(**JIT)
def _unpack_record(payload, base, offsets, bits, signed, out_row):
    """One record: element j of the leaf is at bit ``base + offsets[j]``."""
    sign = np.uint64(1) << np.uint64(bits - 1)
    for j in range(offsets.shape[0]):
        v = _read_bits(payload, base + offsets[j], bits)
        if signed and bits < 64:
            v = (v ^ sign) - sign  # two's complement sign extension in uint64 arithmetic
        out_row[j] = v


@njit(**PJIT)
def _unpack_par(payload, record_bits, offsets, bits, signed, out):
    for r in prange(out.shape[0]):
        _unpack_record(payload, r * record_bits, offsets, bits, signed, out[r])


def unpack_leaf(payload: np.ndarray, records: int, record_bytes: int, leaf: Leaf) -> np.ndarray:
    """Unpack one leaf of every record with the numba kernel (always a fresh, aligned array).

    Parameters
    ----------
    payload : ndarray of uint8, shape [>= records * record_bytes], C-contiguous
        The encoded records, densely in buffer order.
    records : int
        Number of records.
    record_bytes : int
        Size of one record in bytes.
    leaf : Leaf
        The field (bit offset, width, strides, signedness) from the record layout.

    Returns
    -------
    ndarray, shape [records, *leaf.shape], dtype ``leaf.dtype``
        Signed integers sign-extended; floats reinterpreted from their bits; BOOL as ``!= 0``.

    Raises
    ------
    InvalidArgument
        Payload too short, or the leaf does not lie inside the record.
    """
    check_array(payload, "payload", dtype=np.uint8, ndim=1)
    if records < 0 or record_bytes <= 0:
        raise InvalidArgument(f"records {records} / record_bytes {record_bytes} out of range")
    need = records * record_bytes
    if payload.shape[0] < need:
        raise InvalidArgument(
            f"payload: {records} records of {record_bytes} bytes need {need} bytes, got "
            f"{payload.shape[0]}"
        )
    offsets = leaf.element_offsets()
    if offsets.size and int(offsets.max()) + leaf.bits > record_bytes * 8:
        raise InvalidArgument(
            f"leaf {leaf.path!r}: bits up to {int(offsets.max()) + leaf.bits} lie outside the "
            f"{record_bytes * 8}-bit record"
        )
    # The kernel stores the low bits of each (sign-extended) uint64 into a container of the
    # leaf's width: signed ints into their own dtype, floats into uint16/32/64 then viewed.
    if leaf.kind == "float":
        container = np.dtype({16: np.uint16, 32: np.uint32, 64: np.uint64}[leaf.bits])
    elif leaf.kind == "bool":
        container = np.dtype(np.uint8)
    else:
        container = leaf.dtype.newbyteorder("=")
    raw = np.empty((records, offsets.size), dtype=container)
    if records and offsets.size:
        _unpack_par(payload, np.int64(record_bytes * 8), offsets, np.int64(leaf.bits),
                    leaf.signed, raw)
    shape = (records,) + tuple(leaf.shape)
    if leaf.kind == "float":
        return raw.view(leaf.dtype.newbyteorder("=")).reshape(shape)
    if leaf.kind == "bool":
        return (raw != 0).reshape(shape)
    return raw.reshape(shape)


def field_array(payload: np.ndarray, records: int, record_bytes: int, leaf: Leaf,
                copy: bool = False) -> np.ndarray:
    """The array of one leaf: a zero-copy strided view when byte-aligned, else unpacked.

    Parameters
    ----------
    payload, records, record_bytes, leaf
        As :func:`unpack_leaf`.
    copy : bool
        Force the kernel path (a fresh, aligned, C-contiguous array) even for byte-aligned
        fields.

    Returns
    -------
    ndarray, shape [records, *leaf.shape]
        Read-only view of ``payload`` (byte-aligned, ``copy=False``) or a new array.
    """
    if copy or not leaf.byte_aligned():
        return unpack_leaf(payload, records, record_bytes, leaf)
    shape = (records,) + tuple(leaf.shape)
    if records == 0 or 0 in leaf.shape:
        out = np.zeros(shape, leaf.dtype)
        out.flags.writeable = False
        return out
    if payload.shape[0] < records * record_bytes:
        raise InvalidArgument(
            f"payload: {records} records of {record_bytes} bytes need {records * record_bytes} "
            f"bytes, got {payload.shape[0]}"
        )
    strides = (record_bytes,) + tuple(s // 8 for s in leaf.strides)
    last = leaf.offset // 8 + sum((e - 1) * s for e, s in zip(shape, strides)) + leaf.bits // 8
    assert last <= payload.shape[0], (leaf, last)
    view = np.ndarray(shape, dtype=leaf.dtype, buffer=payload, offset=leaf.offset // 8,
                      strides=strides)
    view.flags.writeable = False
    return view
