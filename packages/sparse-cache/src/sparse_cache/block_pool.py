"""Fixed-size KV blocks: reference counts, a free list in eviction order, and a hash index.

A block is *free* when no request holds it (refcount 0). A free block may still hold the KV of a
cached prefix (it has a hash); such blocks stay findable until the pool needs the memory, and are
then reused least-recently-freed first. Free blocks that hold nothing are handed out before any
cached one, so caching never costs capacity.

The free list is two parts in eviction order: the uncached free blocks, a stack (the last one freed
is reused first), then the cached ones, least recently freed first. Refcounts and the stack are numpy
arrays, so that a head-major store's millions of blocks are set up, taken and given back in bulk.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from sparse_cache.block_hash import BlockHash


def as_block_ids(block_ids: Iterable[int]) -> np.ndarray:
    """Block ids as a 1-D integer array (an ``array('i')`` or int32 array shares memory, not copied)."""
    if isinstance(block_ids, np.ndarray):
        return block_ids
    if isinstance(block_ids, array):
        return np.frombuffer(block_ids, dtype=np.int32) if block_ids else np.zeros(0, np.int32)
    if isinstance(block_ids, (list, tuple)):
        return np.array(block_ids, dtype=np.int64)
    return np.fromiter(block_ids, dtype=np.int64)


class BlockPool:
    """Refcounted allocator of block ids ``0 .. num_blocks - 1`` with an LRU-evicted hash index.

    The pool never touches KV tensors: block ids index the per-layer KV pools the engine owns.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = np.zeros(num_blocks, dtype=np.int32)
        # Uncached free blocks: a stack whose top (``_stack[_top - 1]``) is reused first; block 0 first.
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._top = num_blocks
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # after the stack, first = reused first
        self._cached = np.zeros(num_blocks, dtype=bool)  # whether a block has a hash
        self._last = np.zeros(num_blocks, dtype=np.int64)  # scratch of ``release``: a block's last position + 1
        self._num_shared = 0  # blocks with more than one holder
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (including evictable cached ones)."""
        return self._top + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks with more than one holder (0 lets callers skip looking for shared blocks)."""
        return self._num_shared

    def refcount(self, block_id: int) -> int:
        return int(self._refcount[block_id])

    def any_shared(self, block_ids: Iterable[int], skip: int | None = None) -> bool:
        """Whether some block of ``block_ids`` other than ``skip`` has more than one holder."""
        if not self._num_shared:
            return False
        ids = as_block_ids(block_ids)
        if skip is not None:
            ids = ids[ids != skip]
        return bool((self._refcount[ids] > 1).any())

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (refcount becomes 1); None, changing nothing, if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            return None
        take = min(n, self._top)
        fresh = self._stack[self._top - take : self._top][::-1]
        self._top -= take
        self._refcount[fresh] = 1
        blocks = fresh.tolist()
        for _ in range(n - take):  # then cached blocks, evicting their content
            block_id, _ = self._cached_free.popitem(last=False)
            self._drop_hash(block_id, evicted=True)
            self._refcount[block_id] = 1
            blocks.append(block_id)
        return blocks

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block (a prefix-cache hit); a free cached block leaves the free list.
        Raises ValueError, changing nothing, for a free block that holds no cached KV."""
        ids = as_block_ids(block_ids)
        revived = ids[self._refcount[ids] == 0]
        if revived.size:
            uncached = revived[~self._cached[revived]]
            if uncached.size:
                raise ValueError(f"block {int(uncached[0])} is free and holds no cached KV; allocate it instead")
            for block_id in dict.fromkeys(revived.tolist()):
                del self._cached_free[block_id]
        touched = np.unique(ids)
        shared_before = int((self._refcount[touched] > 1).sum())
        np.add.at(self._refcount, ids, 1)
        self._num_shared += int((self._refcount[touched] > 1).sum()) - shared_before

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder of each block, in the order given; blocks reaching 0 become free. Raises
        ValueError, changing nothing, when a block would be released more often than held.

        Callers release a sequence's blocks tail first, so its tail is evicted before its head
        (the head is the part other requests are likelier to share).
        """
        ids = as_block_ids(block_ids)
        if not ids.size:
            return
        refcount = self._refcount
        touched = np.unique(ids[refcount[ids] > 1])  # only these can stop being shared
        shared_before = int((refcount[touched] > 1).sum())
        np.subtract.at(refcount, ids, 1)
        over = refcount[ids] < 0
        if over.any():
            np.add.at(refcount, ids, 1)
            raise ValueError(f"block {int(ids[over][0])} released more often than held")
        self._num_shared += int((refcount[touched] > 1).sum()) - shared_before
        freed = ids[refcount[ids] == 0]
        if freed.size > 1:  # a block listed twice becomes free at its last listing
            order = np.arange(1, freed.size + 1)
            np.maximum.at(self._last, freed, order)
            keep = self._last[freed] == order
            self._last[freed] = 0
            freed = freed[keep]
        cached = self._cached[freed]
        uncached = freed[~cached]
        self._stack[self._top : self._top + uncached.size] = uncached
        self._top += uncached.size
        for block_id in freed[cached].tolist():
            self._cached_free[block_id] = None

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
        self._cached[block_id] = True
        return True

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def _drop_hash(self, block_id: int, evicted: bool) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            self._cached[block_id] = False
            self.num_evictions += evicted

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (the free list keeps its blocks, each moved to
        the front in turn: the whole list reversed)."""
        cached = np.array(list(self._cached_free), dtype=np.int32)
        for block_id in cached.tolist():
            self._drop_hash(block_id, evicted=False)
        self._cached_free.clear()
        top = self._top
        self._stack[: top + cached.size] = np.concatenate([self._stack[:top][::-1], cached])
        self._top = top + cached.size
