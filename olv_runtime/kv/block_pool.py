"""One pool of KV blocks for many sequences (the batching engine's KV cache).

The pool is allocated once, at its full size, when the engine is made: per layer, keys and values
``[NB, KVH, BS, D]`` in the storage format ``kv_dtype`` (float32, float16 or int8 with a float32
scale per token and kv head; :mod:`olv_runtime.kernels.row_attention`). Nothing here knows which
sequence owns a block: the engine's block manager (:mod:`olv_runtime.engine.blocks`) hands out block
ids and keeps the tables; this class stores rows and runs attention over tables. Writing a token
never moves another (0 bytes copied per decode token for KV).
"""
from __future__ import annotations

import os

import numpy as np

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import row_attention as ra

__all__ = ["KV_DTYPES", "KVBlockPool", "physical_memory"]

#: The largest pool made on any machine (bytes).
MAX_POOL_BYTES = 1 << 40


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (None when the system does not say)."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return n if n > 0 else None

#: ``kv_dtype`` values the pool stores.
KV_DTYPES = tuple(ra.FORMATS)


class KVBlockPool:
    """Keys and values of ``n_blocks`` blocks of ``block_size`` tokens, for every layer.

    Parameters
    ----------
    n_layers, n_blocks, kv_heads, block_size, head_dim : int
        Geometry (all >= 1).
    kv_dtype : str
        "float32", "float16", "int8" or "int4" (int8/int4: symmetric, a float32 scale per token
        and kv head; int4 needs an even head_dim).

    Attributes
    ----------
    k, v : ndarray [L, NB, KVH, BS, D] (int4: [..., D/2])
        float32, uint16 (float16 bits), int8, or uint8 (two int4 per byte).
    k_scale, v_scale : float32 [L, NB, KVH, BS] or None
        Per token and kv head scales (int8 and int4).

    Raises
    ------
    InvalidArgument
        A size < 1, an unknown ``kv_dtype``, or a pool over 2**40 bytes or over the machine's
        physical memory, or one that cannot be allocated (checked before anything is allocated;
        a failed allocation is released and reported the same way).
    """

    def __init__(self, n_layers: int, n_blocks: int, kv_heads: int, block_size: int,
                 head_dim: int, kv_dtype: str = "float32"):
        for name, v in (("n_layers", n_layers), ("n_blocks", n_blocks), ("kv_heads", kv_heads),
                        ("block_size", block_size), ("head_dim", head_dim)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise InvalidArgument(f"KVBlockPool: {name} must be an integer >= 1, got {v!r}")
        if kv_dtype not in ra.FORMATS:
            raise InvalidArgument(f"kv_dtype must be one of {list(ra.FORMATS)}, got {kv_dtype!r}")
        self.kv_dtype = kv_dtype
        self.n_layers, self.n_blocks = int(n_layers), int(n_blocks)
        self.kv_heads, self.block_size, self.head_dim = int(kv_heads), int(block_size), int(head_dim)
        if kv_dtype == "int4" and self.head_dim % 2:
            raise InvalidArgument(f"KVBlockPool: an int4 pool needs an even head_dim, got "
                                  f"{head_dim}")
        width = self.head_dim // 2 if kv_dtype == "int4" else self.head_dim
        shape = (self.n_layers, self.n_blocks, self.kv_heads, self.block_size, width)
        dt = np.dtype(ra.FORMATS[kv_dtype])
        per_token = self._token_bytes = self._bytes_per_token()
        total = per_token * self.n_blocks * self.block_size
        what = f"{total} bytes asked for ({n_blocks} blocks of {block_size} tokens x " \
               f"{per_token} bytes)"
        if total > MAX_POOL_BYTES:
            raise InvalidArgument(f"KVBlockPool: {what}, over 1 TiB")
        phys = physical_memory()
        if phys is not None and total > phys:
            raise InvalidArgument(f"KVBlockPool: {what}, more than the {phys} bytes of physical "
                                  f"memory; lower kv_cache_tokens")
        try:
            self.k = np.zeros(shape, dt)
            self.v = np.zeros(shape, dt)
            if kv_dtype in ("int8", "int4"):
                self.k_scale = np.ones(shape[:4], np.float32)
                self.v_scale = np.ones(shape[:4], np.float32)
            else:
                self.k_scale = self.v_scale = None
        except MemoryError:
            self.k = self.v = self.k_scale = self.v_scale = None
            raise InvalidArgument(f"KVBlockPool: {what}, cannot be allocated (out of memory); "
                                  f"lower kv_cache_tokens") from None
        #: bytes stored by :meth:`write` (keys, values and scales of the rows written): the
        #: engine writes each token once, where it stays (nothing is moved between blocks)
        self.bytes_written = 0

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (keys, values and int8 scales)."""
        return self._token_bytes  # (fixed by the geometry; read once per engine step)

    def _bytes_per_token(self) -> int:
        el = np.dtype(ra.FORMATS[self.kv_dtype]).itemsize
        width = self.head_dim // 2 if self.kv_dtype == "int4" else self.head_dim
        b = 2 * self.n_layers * self.kv_heads * width * el
        if self.kv_dtype in ("int8", "int4"):
            b += 2 * self.n_layers * self.kv_heads * 4
        return b

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds."""
        n = self.k.nbytes + self.v.nbytes
        if self.k_scale is not None:
            n += self.k_scale.nbytes + self.v_scale.nbytes
        return n

    def _scales(self, layer: int):
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def write(self, layer: int, blocks: np.ndarray, offsets: np.ndarray, k: np.ndarray,
              v: np.ndarray) -> None:
        """Store ``k``, ``v`` float32 [R, KVH, D] of ``layer`` at (``blocks[r]``, ``offsets[r]``)."""
        ks, vs = self._scales(layer)
        ra.write_rows(self.k[layer], self.v[layer], ks, vs, blocks, offsets, k, v)
        self.bytes_written += len(blocks) * (self.bytes_per_token() // self.n_layers)

    def attend(self, layer: int, q: np.ndarray, tables: np.ndarray, row_seq: np.ndarray,
               pos: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
        """:func:`olv_runtime.kernels.row_attention.attend_rows` over ``layer``."""
        ks, vs = self._scales(layer)
        return ra.attend_rows(q, self.k[layer], self.v[layer], ks, vs, tables, row_seq, pos,
                              scale, out)
