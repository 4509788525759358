"""Fixed-size KV blocks: reference counts, a free list in eviction order, and a hash index.

A block is *free* when no request holds it (refcount 0). A free block may still hold the KV of a
cached prefix (it has a hash); such blocks stay findable until the pool needs the memory, and are
then reused least-recently-freed first. Free blocks that hold nothing are handed out before any
cached one, so caching never costs capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from sparse_cache.block_hash import BlockHash


class BlockPool:
    """Refcounted allocator of block ids ``0 .. num_blocks - 1`` with an LRU-evicted hash index.

    The pool never touches KV tensors: block ids index the per-layer KV pools the engine owns.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # Eviction order: first = reused first. Uncached blocks go to the front, cached ones to the back.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (including evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def any_shared(self, block_ids: Iterable[int], skip: int | None = None) -> bool:
        """Whether some block of ``block_ids`` other than ``skip`` has more than one holder."""
        refcount = self._refcount
        return any(refcount[b] > 1 for b in block_ids if b != skip)

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (refcount becomes 1); None, changing nothing, if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._drop_hash(block_id, evicted=True)
            self._refcount[block_id] = 1
            blocks.append(block_id)
        return blocks

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (a prefix-cache hit); a free cached block leaves the free list."""
        for block_id in block_ids:
            if self._refcount[block_id] == 0:
                if block_id not in self._hash_of:
                    raise ValueError(f"block {block_id} is free and holds no cached KV; allocate it instead")
                del self._free[block_id]
            self._refcount[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block, in the order given; blocks reaching 0 become free.

        Callers release a sequence's blocks tail first, so its tail is evicted before its head
        (the head is the part other requests are likelier to share).
        """
        for block_id in block_ids:
            if self._refcount[block_id] <= 0:
                raise ValueError(f"block {block_id} released more often than held")
            self._refcount[block_id] -= 1
            if self._refcount[block_id] == 0:
                self._free[block_id] = None
                if block_id not in self._hash_of:
                    self._free.move_to_end(block_id, last=False)

    # -- hash index -----------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        """Block holding the KV for ``block_hash``, or None. Never changes any state."""
        return self._block_of.get(block_hash)

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that a held block now holds the full KV named by ``block_hash``.

        Returns False (and records nothing) when another block already holds that content or this
        block is already registered: the first copy stays canonical.
        """
        if self._refcount[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only held blocks can be registered")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def _drop_hash(self, block_id: int, evicted: bool) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            self.num_evictions += evicted

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for block_id in list(self._free):
            self._drop_hash(block_id, evicted=False)
            self._free.move_to_end(block_id, last=False)
