"""Per-request KV blocks on top of the block pool, with the radix prefix cache and the chain cache.

The scheduler asks three things: how much of a prompt is already cached (``match_prefix``, which
never changes state), whether a step's tokens fit (``allocate``, which answers None and changes
nothing when they do not), and to give a request's blocks back (``free``). Full blocks whose KV
has been computed are registered under their chained hash (``cache_blocks``), so later requests
with the same prefix map the same blocks instead of recomputing them.

Chains (``chains``, see ``chain_cache``) hand a request a table whose blocks may be shared with a
fork. Writes never reach a shared block: ``allocate(..., write_from=...)`` and ``make_exclusive``
swap every shared block in the region about to be written for a fresh one and queue a
``(source, destination)`` copy, which the engine performs (``take_copies``) before the write.
Idle chains' blocks are reclaimed, least recently used first, whenever an allocation falls short.

Each held table also has a packed int32 copy of its block ids (``block_id_array``), kept in step
with every change this manager makes, so that building a step's block lists costs a memory copy
per request instead of converting Python ints: while a request holds a table, only this manager
changes its block ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from sparse_cache.block_hash import BlockHash, hash_full_blocks
from sparse_cache.block_pool import BlockPool
from sparse_cache.block_table import BlockTable
from sparse_cache.chain_cache import ChainCache, ChainCheckout
from sparse_cache.pruning import PrunePlan


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
    cacheable: bool = True  # False: the KV is not token-exact (resumed from a compressed chain)
    ids: array = field(init=False)  # table.block_ids as packed int32, kept equal by the manager

    def __post_init__(self) -> None:
        self.ids = array("i", self.table.block_ids)


class KVCacheManager:
    """Allocates blocks to requests from one pool (all layers share each request's table).

    Parameters
    ----------
    num_blocks : blocks in the pool (the same ids index every layer's KV tensors).
    block_size : tokens per block.
    enable_prefix_caching : share computed full blocks between requests by content hash.
    salt : fingerprint of what the KV depends on besides tokens (model, dtype, method config).
    max_chains : most chains the chain cache keeps.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        max_chains: int = 4096,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.chains = ChainCache(self.pool, max_chains)
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self._requests: dict[Hashable, _RequestBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus those that evicting every idle chain's KV would free."""
        return self.pool.num_free_blocks + self.chains.num_reclaimable_blocks()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def table(self, request_id: Hashable) -> BlockTable:
        return self._requests[request_id].table

    def has_request(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def block_id_array(self, request_id: Hashable) -> array:
        """The request's block ids as an ``array('i')`` equal to ``table(request_id).block_ids``
        (the manager's own copy: read it, do not change it)."""
        return self._requests[request_id].ids

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached leading blocks, leaving at least the last token to compute.

        The last token is never served from cache because its logits are needed. Pure lookup.
        """
        if len(token_ids) < 2:
            return PrefixMatch()
        return self.cached_prefix(token_ids[: (len(token_ids) - 1) // self.block_size * self.block_size])

    def cached_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest run of cached leading full blocks of ``token_ids`` (all of them may match). Pure lookup."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        max_blocks = len(token_ids) // self.block_size
        hashes = hash_full_blocks(token_ids[: max_blocks * self.block_size], self.block_size, self.salt)
        block_ids = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        n = len(block_ids)
        return PrefixMatch(tuple(block_ids), tuple(hashes[:n]), n * self.block_size)

    def allocate(
        self,
        request_id: Hashable,
        num_tokens: int,
        prefix: PrefixMatch | None = None,
        *,
        write_from: int | None = None,
    ) -> list[int] | None:
        """Grow a request's table to hold ``num_tokens`` tokens.

        ``prefix`` (first allocation only) maps cached blocks in before new ones. ``write_from``: the
        first slot the coming step writes (its smallest layer's KV length); shared blocks from there
        on are swapped for copies (``take_copies``). Returns the newly allocated block ids, or None
        when the pool cannot supply them even after reclaiming idle chains (nothing changes then).
        """
        req = self._requests.get(request_id)
        if prefix is not None and prefix.block_ids and req is not None:
            raise ValueError(f"request {request_id!r} already holds blocks; a prefix can only start a table")
        prefix = prefix or PrefixMatch()
        table = req.table if req is not None else BlockTable(self.block_size)
        held = len(table.block_ids) + len(prefix.block_ids)
        needed = max(0, -(-num_tokens // self.block_size) - held)
        shared = self._shared(table, write_from // self.block_size) if write_from is not None else []
        if req is not None and not needed and not shared:  # most decode steps: the table has room
            table.num_tokens = max(table.num_tokens, min(num_tokens, table.capacity))
            return []
        # Prefix blocks nobody holds sit in the free list; taking them costs free capacity too.
        if not self._ensure_free(needed + len(shared), prefix.block_ids):
            return None
        if req is None:
            req = self._requests[request_id] = _RequestBlocks(table)
            self.prefix_query_tokens += num_tokens
        if prefix.block_ids:
            self.pool.acquire(prefix.block_ids)
            table.block_ids.extend(prefix.block_ids)
            req.ids.extend(prefix.block_ids)
            req.hashes.extend(prefix.hashes)
            self.prefix_hit_tokens += prefix.num_tokens
        self._swap_for_copies(req, shared)
        new_blocks = self.pool.allocate(needed)
        assert new_blocks is not None  # checked above
        table.block_ids.extend(new_blocks)
        req.ids.extend(new_blocks)
        table.num_tokens = max(table.num_tokens, min(num_tokens, table.capacity))
        return new_blocks

    def make_exclusive(self, request_id: Hashable, first_block: int, end_block: int) -> bool:
        """Swap the shared blocks among ``block_ids[first_block:end_block]`` for copies before they are
        rewritten in place (compaction). False, changing nothing, when the pool cannot supply them."""
        req = self._requests[request_id]
        shared = [i for i in self._shared(req.table, first_block) if i < end_block]
        if not self._ensure_free(len(shared)):
            return False
        self._swap_for_copies(req, shared)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """``(source, destination)`` block copies owed since the last call, in order; the caller must
        copy every layer's K/V before anything writes to the destinations."""
        copies, self._copies = self._copies, []
        return copies

    def num_exclusive_blocks(self, request_id: Hashable) -> int:
        """Blocks of the request's table that nobody else holds."""
        return sum(1 for b in self._requests[request_id].table.block_ids if self.pool.refcount(b) == 1)

    def _shared(self, table: BlockTable, first_block: int) -> list[int]:
        ids = table.block_ids
        return [i for i in range(max(0, first_block), len(ids)) if self.pool.refcount(ids[i]) > 1]

    def _ensure_free(self, num_blocks: int, revive: Sequence[int] = ()) -> bool:
        """Whether ``num_blocks`` new blocks plus the free ones among ``revive`` fit, reclaiming idle
        chains' KV if needed (which can turn a revived block free, hence the second look)."""
        for _ in range(2):
            wanted = num_blocks + sum(1 for b in revive if self.pool.refcount(b) == 0)
            if wanted <= self.pool.num_free_blocks:
                return True
            if not self.chains.reclaim(wanted):
                return False
        return num_blocks + sum(1 for b in revive if self.pool.refcount(b) == 0) <= self.pool.num_free_blocks

    def _swap_for_copies(self, req: _RequestBlocks, indices: list[int]) -> None:
        if not indices:
            return
        fresh = self.pool.allocate(len(indices))
        assert fresh is not None  # the caller checked
        table = req.table
        for i, new in zip(indices, fresh, strict=True):
            old = table.block_ids[i]
            table.block_ids[i] = req.ids[i] = new
            self._copies.append((old, new))
            self.pool.release([old])  # still held by its other holders: the content stays until copied

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is computed (``token_ids[:num_computed_tokens]``)."""
        req = self._requests[request_id]
        if not self.enable_prefix_caching or not req.cacheable:
            return
        num_full = min(num_computed_tokens // self.block_size, len(req.table.block_ids))
        if num_full <= len(req.hashes):
            return
        start = len(req.hashes)
        parent = req.hashes[-1] if req.hashes else None
        bs = self.block_size
        # Hash only the new blocks' tokens: slicing from 0 would copy the whole sequence every time.
        new_hashes = hash_full_blocks(token_ids[start * bs : num_full * bs], bs, self.salt, parent=parent)
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
        del req.ids[keep_blocks:]
        table.num_tokens = num_tokens
        self._release(released)
        return released

    def free(self, request_id: Hashable) -> None:
        """Give back all of a request's blocks, tail first."""
        req = self._requests.pop(request_id)
        self._release(req.table.block_ids)

    def _release(self, block_ids: list[int]) -> None:
        if self._copies:  # a copy into a block given back (preempted in the same schedule) is moot
            gone = set(block_ids)
            self._copies = [(s, d) for s, d in self._copies if d not in gone]
        self.pool.release(reversed(block_ids))

    # -- chains ---------------------------------------------------------------------------------
    def attach(self, request_id: Hashable, table: BlockTable, hashes: Sequence[BlockHash] | None = None) -> None:
        """Adopt ``table`` (and its block references) as a request's table. ``hashes``: the radix hashes
        of its leading full blocks when its KV is token-exact; None keeps its blocks out of the radix cache."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        self._requests[request_id] = _RequestBlocks(table, list(hashes or ()), cacheable=hashes is not None)

    def detach(self, request_id: Hashable) -> tuple[BlockTable, tuple[BlockHash, ...] | None]:
        """Hand a request's table (and its references) to the caller, with its radix hashes when exact."""
        req = self._requests.pop(request_id)
        exact = req.cacheable and self.enable_prefix_caching
        return req.table, tuple(req.hashes) if exact else None

    def resume_chain(
        self, request_id: Hashable, chain_id: str, token_ids: Sequence[int], *, create: bool = True
    ) -> ChainCheckout:
        """Check chain ``chain_id`` out for a request whose full prompt is ``token_ids``; when it is
        resumed, the request now holds the retained table. Raises the chain cache's errors."""
        checkout = self.chains.checkout(chain_id, token_ids, self.salt, request_id, create=create)
        if checkout.table is not None:
            self.attach(request_id, checkout.table, checkout.hashes)
        return checkout

    def save_chain(
        self,
        request_id: Hashable,
        chain_id: str,
        token_ids: Sequence[int],
        kv_lens: Sequence[int],
        state=None,
        pending: Sequence[int] = (),
    ) -> None:
        """The request's turn on the chain ended: the chain takes its table (KV of ``token_ids``, each
        layer holding ``kv_lens`` slots), ``state`` and the ``pending`` tokens after them whose KV is
        not computed; a request holding no blocks leaves no KV (its tokens all become pending)."""
        if request_id not in self._requests:
            self.chains.checkin(chain_id, request_id, (), None, pending=[*token_ids, *pending])
            return
        if kv_lens and len(self.table(request_id).block_ids) > -(-max(kv_lens) // self.block_size):
            self.shrink(request_id, max(kv_lens))
        table, hashes = self.detach(request_id)
        self.chains.checkin(chain_id, request_id, token_ids, table, kv_lens, state, hashes, pending)

    def add_pruned_chain(
        self, chain_id: str | None, token_ids: Sequence[int], source: PrefixMatch, plan: PrunePlan, num_layers: int
    ) -> tuple[str, list[tuple[int, int]]]:
        """Register the pruned copy of a cached history as a degraded chain.

        ``source``: the history's cached blocks (the caller holds them); ``plan``: what is retained.
        The chain shares the source's unchanged leading blocks and gets fresh blocks for the rest.
        Returns the chain id and the ``(source slot, destination slot)`` KV copies the caller must
        make. Raises ValueError when the pool cannot supply the blocks, ``ChainError`` on capacity.
        """
        self.chains.check_room(chain_id)
        bs = self.block_size
        shared = list(source.block_ids[: plan.num_shared_blocks])
        num_fresh = -(-plan.num_retained // bs) - len(shared)
        if not self._ensure_free(num_fresh):
            raise ValueError(f"pruning needs {num_fresh} free KV blocks; the pool has {self.num_free_blocks}")
        self.pool.acquire(shared)
        fresh = self.pool.allocate(num_fresh)
        assert fresh is not None  # checked above
        table = BlockTable(bs, shared + fresh, plan.num_retained)
        try:
            chain_id = self.chains.add(
                chain_id,
                self.salt,
                token_ids[: plan.num_tokens],
                table,
                [plan.num_retained] * num_layers,
                degraded=True,
            )
        except Exception:
            self.pool.release(reversed(table.block_ids))
            raise
        src = [source.block_ids[p // bs] * bs + p % bs for p in plan.copied_positions()]
        dst = [table.slot(i) for i in range(plan.first_copied_slot, plan.num_retained)]
        return chain_id, list(zip(src, dst, strict=True))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
