"""Block bookkeeping of the engine's KV pool: allocation, reference counts and the prefix cache.

The pool (:class:`olv_runtime.kv.block_pool.KVBlockPool`) has ``n_blocks`` blocks of
``block_size`` tokens. A sequence holds a block table: one block id per ``block_size`` positions.
A block's reference count is the number of tables holding it.

Prefix cache (vLLM's automatic prefix caching): once a block is full, it is registered under the
key ``(key id of the previous block, the block's token ids)`` -- the key is compared exactly (no
hash collisions can map two contents to one block), and the chain of ids makes a block's key stand
for every token before it. A new sequence whose leading full blocks match registered keys takes
those blocks (reference count + 1) and computes only the rest. A registered block whose count
drops to zero stays cached, *evictable*, in least-recently-used order: allocation takes free
blocks first, then evicts the least recently used cached one.
"""
from __future__ import annotations

import collections

__all__ = ["BlockManager"]


class BlockManager:
    """Free list, reference counts and the prefix cache of a pool of ``n_blocks`` blocks.

    Not thread-safe: the engine's step (one thread) is its only user. Its memory grows with the
    blocks handed out, never with ``n_blocks`` (a pool size is not allocated here).
    """

    def __init__(self, n_blocks: int, block_size: int, prefix_caching: bool = True):
        self.n_blocks = int(n_blocks)
        self.block_size = int(block_size)
        self.prefix_caching = bool(prefix_caching)
        self.ref: dict[int, int] = {}            # block id -> tables holding it (absent: 0)
        self._fresh = 0                          # blocks never handed out: ids _fresh..n_blocks-1
        self.free: collections.deque[int] = collections.deque()  # blocks released, free again
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.cached: dict[tuple, int] = {}       # key -> block id
        self.key_of: dict[int, tuple] = {}       # block id -> its key
        self.key_id: dict[int, int] = {}         # block id -> the id its children's keys use
        self._next_id = 1
        self.hits = 0          # blocks taken from the prefix cache
        self.evictions = 0

    # -- counts ---------------------------------------------------------------------------------
    def available(self) -> int:
        """Blocks an allocation can get now (free plus evictable)."""
        return (self.n_blocks - self._fresh) + len(self.free) + len(self.evictable)

    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.n_blocks - self.available()

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int | None:
        """A block for one table (reference count 1), or None when none is left."""
        if self._fresh < self.n_blocks:  # as a free list 0..n_blocks-1, then released blocks
            b = self._fresh
            self._fresh += 1
        elif self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._forget(b)
            self.evictions += 1
        else:
            return None
        self.ref[b] = 1
        return b

    def release(self, blocks) -> None:
        """Drop one reference to each block (a table ends or is preempted); a block nobody holds
        becomes free, or evictable if it is in the prefix cache."""
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                del self.ref[b]
                if b in self.key_of:
                    self.evictable[b] = None
                    self.evictable.move_to_end(b)
                else:
                    self.key_id.pop(b, None)
                    self.free.append(b)

    def _forget(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None and self.cached.get(key) == b:
            del self.cached[key]
        self.key_id.pop(b, None)

    # -- prefix cache ---------------------------------------------------------------------------
    def parent_id(self, table: list, index: int) -> int:
        """The key id the block at ``table[index]`` chains from (0 for the first block; -1 when
        the previous block is not registered, so nothing after it can be)."""
        if index == 0:
            return 0
        return self.key_id.get(table[index - 1], -1)

    def match(self, tokens, limit: int) -> list[int]:
        """The cached blocks of the leading full blocks of ``tokens[:limit]``, each taken
        (reference count + 1), in order; stops at the first miss."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        out: list[int] = []
        parent = 0
        for i in range(limit // bs):
            b = self.cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if b is None:
                break
            if b not in self.ref:
                self.evictable.pop(b, None)
            self.ref[b] = self.ref.get(b, 0) + 1
            out.append(b)
            parent = self.key_id[b]
        self.hits += len(out)
        return out

    def register(self, table: list, index: int, tokens) -> None:
        """Block ``table[index]``, now full with ``tokens`` (``block_size`` ids), enters the prefix
        cache (unless its parent is not registered or an equal block already is)."""
        if not self.prefix_caching:
            return
        b = table[index]
        if b in self.key_of:
            return
        parent = self.parent_id(table, index)
        if parent < 0:
            return
        key = (parent, tuple(tokens))
        other = self.cached.get(key)
        if other is not None:  # the same content computed twice: chain on from the cached one
            self.key_id[b] = self.key_id[other]
            return
        self.cached[key] = b
        self.key_of[b] = key
        self.key_id[b] = self._next_id
        self._next_id += 1
