"""Per-request KV blocks on top of the block pool, with the radix prefix cache.

The scheduler asks three things: how much of a prompt is already cached (``match_prefix``, which
never changes state), whether a step's tokens fit (``allocate``, which answers None and changes
nothing when they do not), and to give a request's blocks back (``free``). Full blocks whose KV
has been computed are registered under their chained hash (``cache_blocks``), so later requests
with the same prefix map the same blocks instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from sparse_cache.block_hash import BlockHash, hash_full_blocks
from sparse_cache.block_pool import BlockPool
from sparse_cache.block_table import BlockTable


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached blocks covering the first ``num_tokens`` tokens of a prompt."""

    block_ids: tuple[int, ...] = ()
    hashes: tuple[BlockHash, ...] = ()
    num_tokens: int = 0


@dataclass(slots=True)
class _RequestBlocks:
    table: BlockTable
    hashes: list[BlockHash] = field(default_factory=list)  # hashes of the leading full blocks


class KVCacheManager:
    """Allocates blocks to requests from one pool (all layers share each request's table).

    Parameters
    ----------
    num_blocks : blocks in the pool (the same ids index every layer's KV tensors).
    block_size : tokens per block.
    enable_prefix_caching : share computed full blocks between requests by content hash.
    salt : fingerprint of what the KV depends on besides tokens (model, dtype, method config).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True, salt: bytes = b""):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self._requests: dict[Hashable, _RequestBlocks] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def table(self, request_id: Hashable) -> BlockTable:
        return self._requests[request_id].table

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached leading blocks, leaving at least the last token to compute.

        The last token is never served from cache because its logits are needed. Pure lookup.
        """
        if not self.enable_prefix_caching or len(token_ids) < 2:
            return PrefixMatch()
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = hash_full_blocks(token_ids[: max_blocks * self.block_size], self.block_size, self.salt)
        block_ids = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        n = len(block_ids)
        return PrefixMatch(tuple(block_ids), tuple(hashes[:n]), n * self.block_size)

    def allocate(self, request_id: Hashable, num_tokens: int, prefix: PrefixMatch | None = None) -> list[int] | None:
        """Grow a request's table to hold ``num_tokens`` tokens.

        ``prefix`` (first allocation only) maps cached blocks in before new ones. Returns the newly
        allocated block ids, or None when the pool cannot supply them (nothing changes then).
        """
        req = self._requests.get(request_id)
        if prefix is not None and prefix.block_ids and req is not None:
            raise ValueError(f"request {request_id!r} already holds blocks; a prefix can only start a table")
        prefix = prefix or PrefixMatch()
        table = req.table if req is not None else BlockTable(self.block_size)
        held = len(table.block_ids) + len(prefix.block_ids)
        needed = max(0, -(-num_tokens // self.block_size) - held)
        # Prefix blocks nobody holds sit in the free list; taking them costs free capacity too.
        revived = sum(1 for b in prefix.block_ids if self.pool.refcount(b) == 0)
        if needed + revived > self.pool.num_free_blocks:
            return None
        if req is None:
            req = self._requests[request_id] = _RequestBlocks(table)
            self.prefix_query_tokens += num_tokens
        if prefix.block_ids:
            self.pool.acquire(prefix.block_ids)
            table.block_ids.extend(prefix.block_ids)
            req.hashes.extend(prefix.hashes)
            self.prefix_hit_tokens += prefix.num_tokens
        new_blocks = self.pool.allocate(needed)
        assert new_blocks is not None  # checked above
        table.block_ids.extend(new_blocks)
        table.num_tokens = max(table.num_tokens, min(num_tokens, table.capacity))
        return new_blocks

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is computed (``token_ids[:num_computed_tokens]``)."""
        if not self.enable_prefix_caching:
            return
        req = self._requests[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(req.table.block_ids))
        if num_full <= len(req.hashes):
            return
        start = len(req.hashes)
        parent = req.hashes[-1] if req.hashes else None
        new_hashes = hash_full_blocks(
            token_ids[: num_full * self.block_size], self.block_size, self.salt, start=start, parent=parent
        )
        for block_id, block_hash in zip(req.table.block_ids[start:num_full], new_hashes, strict=True):
            self.pool.register(block_id, block_hash)
        req.hashes.extend(new_hashes)

    def shrink(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Keep only the blocks needed for the first ``num_tokens`` slots; release the rest (tail first).

        Used after eviction compacted a request's kept KV to the front of its table. Blocks that were
        registered in the prefix cache cannot be shrunk away (their content is shared by hash).
        Returns the released block ids.
        """
        req = self._requests[request_id]
        table = req.table
        if not 0 <= num_tokens <= table.capacity:
            raise ValueError(f"cannot shrink to {num_tokens} tokens: the table holds {table.capacity} slots")
        keep_blocks = -(-num_tokens // self.block_size)
        if keep_blocks < len(req.hashes):
            raise ValueError("cannot shrink into blocks registered in the prefix cache")
        released = table.block_ids[keep_blocks:]
        del table.block_ids[keep_blocks:]
        table.num_tokens = num_tokens
        self.pool.release(reversed(released))
        return released

    def free(self, request_id: Hashable) -> None:
        """Give back all of a request's blocks, tail first."""
        req = self._requests.pop(request_id)
        self.pool.release(reversed(req.table.block_ids))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
